// The router's index of which replica slots hold which routing keys (folio.router.index): plain C++, no torch,
// no pybind11.
//
// Layout, and why: a router applies every replica's batch of stored / evicted keys each report period, against an
// index of hundreds of thousands of keys, so an event must cost about one cache miss and no allocation. One
// open-addressing table (linear probing, power-of-two capacity, at most 5/8 full, backward-shift deletion so that no
// tombstones build up) maps a key to its holders, inline in the 16-byte entry as four 16-bit slot numbers (so
// slots are below kMaxSlots, far more replicas than one router tracks). A key held by more slots keeps them in a
// side list (overflow_), where an event on it costs two more dependent misses; a fleet's common prefixes (system
// prompts, templates) are held by several replicas at once, hence four narrow slot numbers rather than two wide.
// Per slot there is only a counter: keys_of / clear / replace scan the table instead (about 5 ms at 850,000 keys,
// where a set per slot took 0.5-2 ms; they run on a replica restart or a snapshot resync, apply on every batch).
// Batches and prompts prefetch the entries of the keys ahead, so that several misses overlap.
// An unused entry is marked in its holder field, not its key, so key 0 is a key like any other. Keys are
// BLAKE2b-derived (uniform), but a multiplicative mix still picks the home so that structured keys (equal low bits,
// say) do not pile up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace folio::cpu {

// Decodes `text` (standard base64 with '=' padding, nothing else: no whitespace, no padding inside) into
// little-endian uint64 keys appended to `out`. False, with `out` unchanged, where the text is not such an encoding
// of a whole number of keys (the caller then takes its slower path, which names the error).
bool decode_base64_keys(const char* text, size_t length, std::vector<uint64_t>& out);

class KeyIndex {
 public:
  // Slots are 0 .. kMaxSlots - 1 (16 bits, less two markers).
  static constexpr int32_t kMaxSlots = 0xFFFE;

  KeyIndex();
  // The slot holds `stored` now and no longer holds `evicted` (evictions first; unknown keys are ignored, a key
  // stored twice is held once). Throws std::invalid_argument for a slot outside [0, kMaxSlots) (as replace and
  // clear do).
  void apply(int32_t slot, const uint64_t* stored, int64_t num_stored, const uint64_t* evicted, int64_t num_evicted);
  // The slot holds exactly `keys` (a snapshot).
  void replace(int32_t slot, const uint64_t* keys, int64_t num_keys);
  // The slot holds nothing.
  void clear(int32_t slot);
  bool holds(int32_t slot, uint64_t key) const;
  // In table order (no order is promised).
  std::vector<uint64_t> keys_of(int32_t slot) const;
  int64_t num_keys(int32_t slot) const;
  // Distinct keys held by any slot.
  int64_t size() const { return num_used_; }
  // For each slot holding any of keys[0..n): the 1-based position of the deepest one it holds, as (slot, depth);
  // deepest first, and the holders of one key in the order they came to hold it.
  std::vector<std::pair<int32_t, int32_t>> match(const uint64_t* keys, int64_t num_keys) const;

 private:
  // holders[0] == kNone: an unused entry. holders[0] == kSpilled: held by the slots in overflow_[spilled_list()]
  // (five or more, in the order they came; the list's index in holders[1..2]). Else held by holders[0..3] up to
  // the first kNone, in the order they came: a removal shifts the later ones down.
  static constexpr int kInline = 4;
  struct Entry {
    uint64_t key;
    uint16_t holders[kInline];
  };
  // Holds its key too: keys_of scans the lists apart from the table, sequentially.
  struct Overflow {
    uint64_t key;
    std::vector<int32_t> holders;  // empty while the list is on free_overflow_
  };
  static constexpr uint16_t kNone = 0xFFFF;
  static constexpr uint16_t kSpilled = 0xFFFE;
  static constexpr size_t kNotFound = ~size_t{0};
  static constexpr size_t kMinCapacity = 64;
  static constexpr int64_t kPrefetchAhead = 16;

  static bool is_free(const Entry& entry) { return entry.holders[0] == kNone; }
  static bool is_spilled(const Entry& entry) { return entry.holders[0] == kSpilled; }
  static uint32_t spilled_list(const Entry& entry) {
    return static_cast<uint32_t>(entry.holders[1]) | static_cast<uint32_t>(entry.holders[2]) << 16;
  }
  static void set_free(Entry& entry);
  static void set_spilled(Entry& entry, uint32_t list);
  size_t home(uint64_t key) const { return static_cast<size_t>(((key ^ (key >> 32)) * kMix) >> shift_); }
  size_t find(uint64_t key) const;
  // apply and match prefetch the home of the key kPrefetchAhead events ahead.
  void prefetch_home(uint64_t key) const { __builtin_prefetch(&table_[home(key)]); }
  void ensure_slot(int32_t slot);
  void add(int32_t slot, uint64_t key);
  void remove(int32_t slot, uint64_t key);
  bool add_holder(Entry& entry, int32_t slot);
  bool remove_holder(Entry& entry, int32_t slot);
  bool entry_holds(const Entry& entry, int32_t slot) const;
  template <class Visit>
  void for_each_holder(const Entry& entry, Visit&& visit) const;
  void erase_at(size_t idx);
  void rehash(size_t capacity);
  void shrink_if_sparse();
  static size_t capacity_for(int64_t num_keys);
  uint32_t new_overflow(uint64_t key);

  static constexpr uint64_t kMix = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, odd
  std::vector<Entry> table_;
  size_t mask_ = 0;     // capacity - 1
  int shift_ = 64;      // 64 - log2(capacity): home() keeps the top bits of the product
  int64_t num_used_ = 0;
  std::vector<Overflow> overflow_;              // holder lists of keys held by five slots or more
  std::vector<uint32_t> free_overflow_;         // indices of overflow_ not in use (keeping their capacity)
  std::vector<int64_t> num_keys_;               // slot -> keys it holds
};

}  // namespace folio::cpu
