#include "key_index.h"

#include <algorithm>
#include <array>
#include <limits>
#include <stdexcept>

namespace folio::cpu {
namespace {

// Calls visit(slot) for every slot holding the entry's key, in the order they came to hold it.
template <class Entry, class Overflow, class Visit>
void for_each_holder(const Entry& entry, const std::vector<Overflow>& overflow, Visit&& visit) {
  if (entry.first >= 0) {
    visit(entry.first);
    if (entry.second >= 0) visit(entry.second);
  } else {
    for (int32_t slot : overflow[-2 - entry.first].holders) visit(slot);
  }
}

// Linear probing stays short below 5/8 full: about 1.8 entries per hit and 4 per miss, within a cache line or two.
bool over_max_load(int64_t num_used, size_t capacity) { return static_cast<size_t>(num_used) * 8 > capacity * 5; }

}  // namespace

bool decode_base64_keys(const char* text, size_t length, std::vector<uint64_t>& out) {
  static const auto kValues = [] {
    std::array<int8_t, 256> values{};
    values.fill(-1);
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) values[static_cast<uint8_t>(alphabet[i])] = static_cast<int8_t>(i);
    return values;
  }();
  if (length % 4 != 0) return false;
  size_t padding = 0;
  while (padding < 2 && padding < length && text[length - 1 - padding] == '=') ++padding;
  const size_t num_bytes = length / 4 * 3 - padding;
  if (num_bytes % 8 != 0) return false;
  std::vector<uint8_t> bytes(num_bytes);
  size_t written = 0;
  for (size_t i = 0; i < length; i += 4) {
    uint32_t group = 0;
    for (size_t j = 0; j < 4; ++j) {
      const bool pad = i + j >= length - padding;
      const int8_t value = pad ? 0 : kValues[static_cast<uint8_t>(text[i + j])];
      if (value < 0) return false;  // not in the alphabet (an '=' before the end among them)
      group = (group << 6) | static_cast<uint32_t>(value);
    }
    for (int shift = 16; shift >= 0 && written < num_bytes; shift -= 8) bytes[written++] = (group >> shift) & 0xFF;
  }
  const size_t first = out.size();
  out.resize(first + num_bytes / 8);
  for (size_t k = 0; k < num_bytes / 8; ++k) {
    uint64_t key = 0;
    for (int b = 7; b >= 0; --b) key = (key << 8) | bytes[k * 8 + static_cast<size_t>(b)];
    out[first + k] = key;
  }
  return true;
}

KeyIndex::KeyIndex() { rehash(kMinCapacity); }

size_t KeyIndex::capacity_for(int64_t num_keys) {
  size_t capacity = kMinCapacity;
  while (over_max_load(num_keys * 2, capacity)) capacity *= 2;  // half the maximum load: room to grow
  return capacity;
}

void KeyIndex::rehash(size_t capacity) {
  std::vector<Entry> old(capacity, Entry{0, kFree, kFree});
  old.swap(table_);
  mask_ = capacity - 1;
  shift_ = 64 - __builtin_ctzll(capacity);
  for (const Entry& entry : old) {
    if (entry.first == kFree) continue;
    size_t idx = home(entry.key);
    while (table_[idx].first != kFree) idx = (idx + 1) & mask_;
    table_[idx] = entry;
  }
}

void KeyIndex::shrink_if_sparse() {
  // After a replica's keys go (clear, replace): keeps the scans of keys_of / clear / replace proportional to the keys.
  if (table_.size() > kMinCapacity && static_cast<size_t>(num_used_) * 8 < table_.size()) {
    rehash(capacity_for(num_used_));
  }
}

size_t KeyIndex::find(uint64_t key) const {
  for (size_t idx = home(key);; idx = (idx + 1) & mask_) {
    const Entry& entry = table_[idx];
    if (entry.first == kFree) return kNotFound;
    if (entry.key == key) return idx;
  }
}

void KeyIndex::erase_at(size_t idx) {
  // Backward shift: each later entry of the run moves into the hole when its home is not between the hole and it,
  // so every remaining key stays reachable from its home without tombstones.
  size_t hole = idx;
  for (size_t next = (idx + 1) & mask_; table_[next].first != kFree; next = (next + 1) & mask_) {
    const size_t next_home = home(table_[next].key);
    if (((next - next_home) & mask_) >= ((next - hole) & mask_)) {
      table_[hole] = table_[next];
      hole = next;
    }
  }
  table_[hole].first = table_[hole].second = kFree;
  --num_used_;
}

int32_t KeyIndex::new_overflow(uint64_t key) {
  if (!free_overflow_.empty()) {
    const int32_t list = free_overflow_.back();
    free_overflow_.pop_back();
    overflow_[list].key = key;
    return list;
  }
  if (overflow_.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max() - 2)) {
    throw std::length_error("KeyIndex: too many keys held by three slots or more");
  }
  overflow_.push_back(Overflow{key, {}});
  return static_cast<int32_t>(overflow_.size() - 1);
}

bool KeyIndex::entry_holds(const Entry& entry, int32_t slot) const {
  if (entry.first >= 0) return entry.first == slot || entry.second == slot;
  const auto& holders = overflow_[-2 - entry.first].holders;
  return std::find(holders.begin(), holders.end(), slot) != holders.end();
}

bool KeyIndex::add_holder(Entry& entry, int32_t slot) {
  if (entry.first >= 0) {
    if (entry.first == slot || entry.second == slot) return false;
    if (entry.second == kFree) {
      entry.second = slot;
      return true;
    }
    const int32_t list = new_overflow(entry.key);
    overflow_[list].holders.assign({entry.first, entry.second, slot});
    entry.first = -2 - list;
    entry.second = kFree;
    return true;
  }
  auto& holders = overflow_[-2 - entry.first].holders;
  if (std::find(holders.begin(), holders.end(), slot) != holders.end()) return false;
  holders.push_back(slot);
  return true;
}

bool KeyIndex::remove_holder(Entry& entry, int32_t slot) {
  if (entry.first >= 0) {
    if (entry.second == slot) {
      entry.second = kFree;
    } else if (entry.first == slot) {
      entry.first = entry.second;  // kFree when it was the only holder: the caller erases the entry
      entry.second = kFree;
    } else {
      return false;
    }
    return true;
  }
  const int32_t list = -2 - entry.first;
  auto& holders = overflow_[list].holders;
  const auto found = std::find(holders.begin(), holders.end(), slot);
  if (found == holders.end()) return false;
  holders.erase(found);
  if (holders.size() == 2) {  // back inline: an overflow list always has three holders or more
    entry.first = holders[0];
    entry.second = holders[1];
    holders.clear();
    free_overflow_.push_back(list);
  }
  return true;
}

void KeyIndex::ensure_slot(int32_t slot) {
  if (slot < 0) throw std::invalid_argument("slot must be >= 0");
  if (static_cast<size_t>(slot) >= num_keys_.size()) num_keys_.resize(static_cast<size_t>(slot) + 1, 0);
}

void KeyIndex::add(int32_t slot, uint64_t key) {
  size_t idx = home(key);
  for (;; idx = (idx + 1) & mask_) {
    Entry& entry = table_[idx];
    if (entry.first == kFree) break;
    if (entry.key == key) {
      num_keys_[slot] += add_holder(entry, slot);
      return;
    }
  }
  if (over_max_load(num_used_ + 1, table_.size())) {
    rehash(table_.size() * 2);
    for (idx = home(key); table_[idx].first != kFree;) idx = (idx + 1) & mask_;
  }
  table_[idx] = Entry{key, slot, kFree};
  ++num_used_;
  ++num_keys_[slot];
}

void KeyIndex::remove(int32_t slot, uint64_t key) {
  const size_t idx = find(key);
  if (idx == kNotFound) return;
  Entry& entry = table_[idx];
  if (!remove_holder(entry, slot)) return;
  --num_keys_[slot];
  if (entry.first == kFree) erase_at(idx);
}

void KeyIndex::apply(int32_t slot, const uint64_t* stored, int64_t num_stored, const uint64_t* evicted,
                     int64_t num_evicted) {
  ensure_slot(slot);
  // One pass over evicted then stored keys, prefetching the home of the key kPrefetchAhead further on.
  const int64_t num_events = num_evicted + num_stored;
  const auto key_at = [&](int64_t i) { return i < num_evicted ? evicted[i] : stored[i - num_evicted]; };
  for (int64_t i = 0; i < std::min(kPrefetchAhead, num_events); ++i) prefetch_home(key_at(i));
  for (int64_t i = 0; i < num_events; ++i) {
    if (i + kPrefetchAhead < num_events) prefetch_home(key_at(i + kPrefetchAhead));
    if (i < num_evicted) {
      remove(slot, evicted[i]);
    } else {
      add(slot, stored[i - num_evicted]);
    }
  }
}

void KeyIndex::replace(int32_t slot, const uint64_t* keys, int64_t num_keys) {
  ensure_slot(slot);
  if (num_keys_[slot] > 0) {
    std::vector<uint64_t> wanted(keys, keys + num_keys);
    std::sort(wanted.begin(), wanted.end());
    for (uint64_t key : keys_of(slot)) {
      if (!std::binary_search(wanted.begin(), wanted.end(), key)) remove(slot, key);
    }
  }
  apply(slot, keys, num_keys, nullptr, 0);
  shrink_if_sparse();
}

void KeyIndex::clear(int32_t slot) {
  ensure_slot(slot);
  if (num_keys_[slot] == 0) return;
  for (uint64_t key : keys_of(slot)) remove(slot, key);
  shrink_if_sparse();
}

bool KeyIndex::holds(int32_t slot, uint64_t key) const {
  if (slot < 0 || static_cast<size_t>(slot) >= num_keys_.size() || num_keys_[slot] == 0) return false;
  const size_t idx = find(key);
  return idx != kNotFound && entry_holds(table_[idx], slot);
}

std::vector<uint64_t> KeyIndex::keys_of(int32_t slot) const {
  const int64_t count = num_keys(slot);
  std::vector<uint64_t> keys;
  if (count == 0) return keys;
  keys.reserve(static_cast<size_t>(count));
  // Without a branch per entry (used or not is a coin flip): the table scan runs at memory speed. Overflow entries
  // (first <= -2, second == kFree) never match here; their lists are scanned next.
  for (const Entry& entry : table_) {
    if ((entry.first == slot) | (entry.second == slot)) keys.push_back(entry.key);
  }
  for (const Overflow& list : overflow_) {
    if (std::find(list.holders.begin(), list.holders.end(), slot) != list.holders.end()) keys.push_back(list.key);
  }
  return keys;
}

int64_t KeyIndex::num_keys(int32_t slot) const {
  if (slot < 0 || static_cast<size_t>(slot) >= num_keys_.size()) return 0;
  return num_keys_[slot];
}

std::vector<std::pair<int32_t, int32_t>> KeyIndex::match(const uint64_t* keys, int64_t num_keys) const {
  std::vector<std::pair<int32_t, int32_t>> found;
  std::vector<uint64_t> seen((num_keys_.size() + 63) / 64, 0);  // a bit per slot
  for (int64_t i = 0; i < std::min(kPrefetchAhead, num_keys); ++i) prefetch_home(keys[num_keys - 1 - i]);
  for (int64_t depth = num_keys; depth > 0; --depth) {
    if (depth - 1 - kPrefetchAhead >= 0) prefetch_home(keys[depth - 1 - kPrefetchAhead]);
    const size_t idx = find(keys[depth - 1]);
    if (idx == kNotFound) continue;
    for_each_holder(table_[idx], overflow_, [&](int32_t slot) {
      uint64_t& word = seen[static_cast<size_t>(slot) >> 6];
      const uint64_t bit = uint64_t{1} << (slot & 63);
      if (word & bit) return;
      word |= bit;
      found.emplace_back(slot, static_cast<int32_t>(depth));
    });
  }
  return found;
}

}  // namespace folio::cpu
