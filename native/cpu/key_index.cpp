#include "key_index.h"

#include <algorithm>
#include <stdexcept>

namespace folio::cpu {

std::unordered_set<uint64_t>& KeyIndex::slot_keys(int32_t slot) {
  if (slot < 0) throw std::invalid_argument("slot must be >= 0");
  if (static_cast<size_t>(slot) >= keys_.size()) keys_.resize(slot + 1);
  return keys_[slot];
}

void KeyIndex::add(int32_t slot, uint64_t key) {
  if (!slot_keys(slot).insert(key).second) return;
  holders_[key].push_back(slot);
}

void KeyIndex::remove(int32_t slot, uint64_t key) {
  if (slot_keys(slot).erase(key) == 0) return;
  auto found = holders_.find(key);
  if (found == holders_.end()) return;
  auto& slots = found->second;
  slots.erase(std::remove(slots.begin(), slots.end(), slot), slots.end());
  if (slots.empty()) holders_.erase(found);
}

void KeyIndex::apply(int32_t slot, const uint64_t* stored, int64_t num_stored, const uint64_t* evicted,
                     int64_t num_evicted) {
  for (int64_t i = 0; i < num_evicted; ++i) remove(slot, evicted[i]);
  for (int64_t i = 0; i < num_stored; ++i) add(slot, stored[i]);
}

void KeyIndex::replace(int32_t slot, const uint64_t* keys, int64_t num_keys) {
  std::unordered_set<uint64_t> wanted(keys, keys + num_keys);
  std::vector<uint64_t> gone;
  for (uint64_t key : slot_keys(slot)) {
    if (!wanted.count(key)) gone.push_back(key);
  }
  for (uint64_t key : gone) remove(slot, key);
  for (uint64_t key : wanted) add(slot, key);
}

void KeyIndex::clear(int32_t slot) {
  const std::vector<uint64_t> held(slot_keys(slot).begin(), slot_keys(slot).end());
  for (uint64_t key : held) remove(slot, key);
}

bool KeyIndex::holds(int32_t slot, uint64_t key) const {
  return slot >= 0 && static_cast<size_t>(slot) < keys_.size() && keys_[slot].count(key) > 0;
}

std::vector<uint64_t> KeyIndex::keys_of(int32_t slot) const {
  if (slot < 0 || static_cast<size_t>(slot) >= keys_.size()) return {};
  return std::vector<uint64_t>(keys_[slot].begin(), keys_[slot].end());
}

int64_t KeyIndex::num_keys(int32_t slot) const {
  if (slot < 0 || static_cast<size_t>(slot) >= keys_.size()) return 0;
  return static_cast<int64_t>(keys_[slot].size());
}

std::vector<std::pair<int32_t, int32_t>> KeyIndex::match(const uint64_t* keys, int64_t num_keys) const {
  std::vector<std::pair<int32_t, int32_t>> found;
  std::unordered_set<int32_t> seen;
  for (int64_t depth = num_keys; depth > 0; --depth) {
    const auto holders = holders_.find(keys[depth - 1]);
    if (holders == holders_.end()) continue;
    for (int32_t slot : holders->second) {
      if (seen.insert(slot).second) found.emplace_back(slot, static_cast<int32_t>(depth));
    }
  }
  return found;
}

}  // namespace folio::cpu
