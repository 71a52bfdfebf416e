#include "key_index.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace folio::cpu {
namespace {

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
  // The bytes go straight into the keys' storage (a report's batches are decoded on every report of every replica).
  const size_t first = out.size();
  out.resize(first + num_bytes / 8);
  auto* bytes = reinterpret_cast<uint8_t*>(out.data() + first);
  size_t written = 0;
  const auto value_at = [&](size_t i) -> int32_t { return kValues[static_cast<uint8_t>(text[i])]; };
  // Every group but a padded last one: four characters, three bytes. (A character outside the alphabet, an '='
  // before the end among them, reads as -1.)
  const size_t unpadded = padding ? length - 4 : length;
  for (size_t i = 0; i < unpadded; i += 4) {
    const int32_t a = value_at(i), b = value_at(i + 1), c = value_at(i + 2), d = value_at(i + 3);
    if ((a | b | c | d) < 0) {
      out.resize(first);
      return false;
    }
    const uint32_t group = static_cast<uint32_t>(a) << 18 | static_cast<uint32_t>(b) << 12 |
                           static_cast<uint32_t>(c) << 6 | static_cast<uint32_t>(d);
    bytes[written] = static_cast<uint8_t>(group >> 16);
    bytes[written + 1] = static_cast<uint8_t>(group >> 8);
    bytes[written + 2] = static_cast<uint8_t>(group);
    written += 3;
  }
  if (padding) {
    const size_t i = length - 4;
    const int32_t a = value_at(i), b = value_at(i + 1), c = padding == 2 ? 0 : value_at(i + 2);
    if ((a | b | c) < 0) {
      out.resize(first);
      return false;
    }
    const uint32_t group =
        static_cast<uint32_t>(a) << 18 | static_cast<uint32_t>(b) << 12 | static_cast<uint32_t>(c) << 6;
    bytes[written] = static_cast<uint8_t>(group >> 16);
    if (padding == 1) bytes[written + 1] = static_cast<uint8_t>(group >> 8);
  }
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  for (size_t k = first; k < out.size(); ++k) out[k] = __builtin_bswap64(out[k]);
#endif
  return true;
}

KeyIndex::KeyIndex() { rehash(kMinCapacity); }

void KeyIndex::set_free(Entry& entry) { std::fill(entry.holders, entry.holders + kInline, kNone); }

void KeyIndex::set_spilled(Entry& entry, uint32_t list) {
  entry.holders[0] = kSpilled;
  entry.holders[1] = static_cast<uint16_t>(list);
  entry.holders[2] = static_cast<uint16_t>(list >> 16);
  entry.holders[3] = kNone;
}

template <class Visit>
void KeyIndex::for_each_holder(const Entry& entry, Visit&& visit) const {
  if (is_spilled(entry)) {
    for (int32_t slot : overflow_[spilled_list(entry)].holders) visit(slot);
    return;
  }
  for (int i = 0; i < kInline && entry.holders[i] != kNone; ++i) visit(static_cast<int32_t>(entry.holders[i]));
}

size_t KeyIndex::capacity_for(int64_t num_keys) {
  size_t capacity = kMinCapacity;
  while (over_max_load(num_keys * 2, capacity)) capacity *= 2;  // half the maximum load: room to grow
  return capacity;
}

void KeyIndex::rehash(size_t capacity) {
  Entry unused{0, {}};
  set_free(unused);
  std::vector<Entry> old(capacity, unused);
  old.swap(table_);
  mask_ = capacity - 1;
  shift_ = 64 - __builtin_ctzll(capacity);
  for (const Entry& entry : old) {
    if (is_free(entry)) continue;
    size_t idx = home(entry.key);
    while (!is_free(table_[idx])) idx = (idx + 1) & mask_;
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
    if (is_free(entry)) return kNotFound;
    if (entry.key == key) return idx;
  }
}

void KeyIndex::erase_at(size_t idx) {
  // Backward shift: each later entry of the run moves into the hole when its home is not between the hole and it,
  // so every remaining key stays reachable from its home without tombstones.
  size_t hole = idx;
  for (size_t next = (idx + 1) & mask_; !is_free(table_[next]); next = (next + 1) & mask_) {
    const size_t next_home = home(table_[next].key);
    if (((next - next_home) & mask_) >= ((next - hole) & mask_)) {
      table_[hole] = table_[next];
      hole = next;
    }
  }
  set_free(table_[hole]);
  --num_used_;
}

uint32_t KeyIndex::new_overflow(uint64_t key) {
  if (!free_overflow_.empty()) {
    const uint32_t list = free_overflow_.back();
    free_overflow_.pop_back();
    overflow_[list].key = key;
    return list;
  }
  if (overflow_.size() >= std::numeric_limits<uint32_t>::max()) {
    throw std::length_error("KeyIndex: too many keys held by five slots or more");
  }
  overflow_.push_back(Overflow{key, {}});
  return static_cast<uint32_t>(overflow_.size() - 1);
}

bool KeyIndex::entry_holds(const Entry& entry, int32_t slot) const {
  if (is_spilled(entry)) {
    const auto& holders = overflow_[spilled_list(entry)].holders;
    return std::find(holders.begin(), holders.end(), slot) != holders.end();
  }
  return std::find(entry.holders, entry.holders + kInline, static_cast<uint16_t>(slot)) != entry.holders + kInline;
}

bool KeyIndex::add_holder(Entry& entry, int32_t slot) {
  if (!is_spilled(entry)) {
    for (int i = 0; i < kInline; ++i) {
      if (entry.holders[i] == slot) return false;
      if (entry.holders[i] == kNone) {
        entry.holders[i] = static_cast<uint16_t>(slot);
        return true;
      }
    }
    const uint32_t list = new_overflow(entry.key);
    overflow_[list].holders.assign(entry.holders, entry.holders + kInline);
    overflow_[list].holders.push_back(slot);
    set_spilled(entry, list);
    return true;
  }
  auto& holders = overflow_[spilled_list(entry)].holders;
  if (std::find(holders.begin(), holders.end(), slot) != holders.end()) return false;
  holders.push_back(slot);
  return true;
}

bool KeyIndex::remove_holder(Entry& entry, int32_t slot) {
  if (!is_spilled(entry)) {
    int i = 0;
    while (i < kInline && entry.holders[i] != slot) ++i;
    if (i == kInline) return false;
    for (; i + 1 < kInline; ++i) entry.holders[i] = entry.holders[i + 1];  // the later holders keep their order
    entry.holders[kInline - 1] = kNone;  // (and holders[0] is kNone where it held the key alone)
    return true;
  }
  const uint32_t list = spilled_list(entry);
  auto& holders = overflow_[list].holders;
  const auto found = std::find(holders.begin(), holders.end(), slot);
  if (found == holders.end()) return false;
  holders.erase(found);
  // back inline: a side list always has more holders than fit in the entry
  if (holders.size() == static_cast<size_t>(kInline)) {
    std::copy(holders.begin(), holders.end(), entry.holders);
    holders.clear();
    free_overflow_.push_back(list);
  }
  return true;
}

void KeyIndex::ensure_slot(int32_t slot) {
  if (slot < 0 || slot >= kMaxSlots) throw std::invalid_argument("slot must be in [0, 65534)");
  if (static_cast<size_t>(slot) >= num_keys_.size()) num_keys_.resize(static_cast<size_t>(slot) + 1, 0);
}

void KeyIndex::add(int32_t slot, uint64_t key) {
  size_t idx = home(key);
  for (;; idx = (idx + 1) & mask_) {
    Entry& entry = table_[idx];
    if (is_free(entry)) break;
    if (entry.key == key) {
      num_keys_[slot] += add_holder(entry, slot);
      return;
    }
  }
  if (over_max_load(num_used_ + 1, table_.size())) {
    rehash(table_.size() * 2);
    for (idx = home(key); !is_free(table_[idx]);) idx = (idx + 1) & mask_;
  }
  Entry& entry = table_[idx];
  entry.key = key;
  set_free(entry);
  entry.holders[0] = static_cast<uint16_t>(slot);
  ++num_used_;
  ++num_keys_[slot];
}

void KeyIndex::remove(int32_t slot, uint64_t key) {
  const size_t idx = find(key);
  if (idx == kNotFound) return;
  Entry& entry = table_[idx];
  if (!remove_holder(entry, slot)) return;
  --num_keys_[slot];
  if (is_free(entry)) erase_at(idx);
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
  // Without a branch per entry (used or not is a coin flip): the table scan runs at memory speed. The four holders
  // are tested at once, as the lanes of one word: a lane equal to the slot is a zero lane of their xor. A spilled
  // entry (its list's index in the middle lanes) never matches here; the lists are scanned next.
  constexpr uint64_t kLanes = 0x0001000100010001ull, kHighBits = 0x8000800080008000ull;
  const uint64_t wanted = kLanes * static_cast<uint16_t>(slot);
  for (const Entry& entry : table_) {
    uint64_t lanes;
    std::memcpy(&lanes, entry.holders, sizeof(lanes));
    const uint64_t diff = lanes ^ wanted;
    const bool has_slot = ((diff - kLanes) & ~diff & kHighBits) != 0;
    if (has_slot & (entry.holders[0] != kSpilled)) keys.push_back(entry.key);
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
    for_each_holder(table_[idx], [&](int32_t slot) {
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
