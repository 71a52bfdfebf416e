// The router's index of which replica slots hold which routing keys (folio.router.index): plain C++, no torch,
// no pybind11. Applying a replica's batch of stored / evicted keys costs a hash-map update per key that changes,
// and matching a prompt one lookup per key plus one step per holder found.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace folio::cpu {

class KeyIndex {
 public:
  // The slot holds `stored` now and no longer holds `evicted` (evictions first; unknown keys are ignored).
  void apply(int32_t slot, const uint64_t* stored, int64_t num_stored, const uint64_t* evicted, int64_t num_evicted);
  // The slot holds exactly `keys` (a snapshot).
  void replace(int32_t slot, const uint64_t* keys, int64_t num_keys);
  // The slot holds nothing.
  void clear(int32_t slot);
  bool holds(int32_t slot, uint64_t key) const;
  std::vector<uint64_t> keys_of(int32_t slot) const;
  int64_t num_keys(int32_t slot) const;
  // Distinct keys held by any slot.
  int64_t size() const { return static_cast<int64_t>(holders_.size()); }
  // For each slot holding any of keys[0..n): the 1-based position of the deepest one it holds, as (slot, depth).
  std::vector<std::pair<int32_t, int32_t>> match(const uint64_t* keys, int64_t num_keys) const;

 private:
  void add(int32_t slot, uint64_t key);
  void remove(int32_t slot, uint64_t key);
  std::unordered_set<uint64_t>& slot_keys(int32_t slot);

  std::unordered_map<uint64_t, std::vector<int32_t>> holders_;  // key -> slots holding it (a few at most)
  std::vector<std::unordered_set<uint64_t>> keys_;               // slot -> keys it holds
};

}  // namespace folio::cpu
