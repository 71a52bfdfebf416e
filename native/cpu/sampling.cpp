// Batched sampling, penalties and token masks on the CPU; kernels.h defines the semantics.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels.h"

namespace folio::cpu {
namespace {

constexpr double kTopPSlack = 1e-6;

int64_t argmax_row(const float* logits, int64_t vocab_size) {
  int64_t best = -1;
  float best_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab_size; ++i) {
    if (logits[i] > best_value) {  // strict: the first of equal maxima wins; NaN and -inf never do
      best_value = logits[i];
      best = i;
    }
  }
  return best;
}

uint64_t mass_of(float weight) { return static_cast<uint64_t>(static_cast<double>(weight) * kSampleWeightScale); }

// Number of leading ranks whose inclusive mass first reaches `target` (>= 1), within the first `kept` ranks.
size_t ranks_to_reach(const std::vector<uint64_t>& ranked_mass, size_t kept, uint64_t target) {
  uint64_t cumulative = 0;
  for (size_t r = 0; r < kept; ++r) {
    cumulative += ranked_mass[r];
    if (cumulative >= target) return r + 1;
  }
  return kept;
}

void sample_row(const SampleParams& p, int64_t row) {
  const float* logits = p.logits + row * p.logits_row_stride;
  const int64_t vocab = p.vocab_size;
  const int64_t argmax = argmax_row(logits, vocab);
  const float temperature = p.temperature[row];
  const int32_t top_k = p.top_k[row];
  if (argmax < 0 || !(temperature >= kGreedyTemperature) || top_k == 1 || std::isinf(logits[argmax])) {
    // greedy, nothing pickable, or a +inf logit that takes all the mass
    p.out_token_ids[row] = argmax;
    p.out_probs[row] = argmax < 0 ? 0.0f : 1.0f;
    return;
  }
  const float max_z = logits[argmax] / temperature;
  std::vector<float> weight(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    const float w = std::exp(logits[i] / temperature - max_z);
    weight[i] = std::isnan(w) ? 0.0f : w;
  }
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return weight[a] > weight[b]; });
  std::vector<uint64_t> ranked_mass(vocab);
  for (int64_t r = 0; r < vocab; ++r) ranked_mass[r] = mass_of(weight[order[r]]);

  size_t kept = static_cast<size_t>(vocab);
  if (top_k > 0 && top_k < vocab) kept = static_cast<size_t>(top_k);
  const float top_p = p.top_p[row];
  if (top_p < 1.0f) {
    const uint64_t kept_mass = std::accumulate(ranked_mass.begin(), ranked_mass.begin() + kept, uint64_t{0});
    const double target = std::ceil((static_cast<double>(top_p) - kTopPSlack) * static_cast<double>(kept_mass));
    kept = ranks_to_reach(ranked_mass, kept, target < 1.0 ? 1 : static_cast<uint64_t>(target));
  }
  const float min_p = p.min_p[row];
  if (min_p > 0.0f) {
    size_t above = 0;
    while (above < kept && weight[order[above]] >= min_p) ++above;
    kept = std::max<size_t>(above, 1);  // rank 0 has w == 1 >= min_p unless min_p > 1
  }
  const uint64_t total = std::accumulate(ranked_mass.begin(), ranked_mass.begin() + kept, uint64_t{0});
  const double scaled = static_cast<double>(p.uniform[row]) * static_cast<double>(total);
  const uint64_t target = std::min(total, static_cast<uint64_t>(scaled) + 1);
  const size_t rank = ranks_to_reach(ranked_mass, kept, target) - 1;
  p.out_token_ids[row] = order[rank];
  p.out_probs[row] = static_cast<float>(static_cast<double>(ranked_mass[rank]) / static_cast<double>(total));
}

// Strength of the history entry at distance `distance` from the newest (PenaltyParams).
float strength(int64_t distance, int64_t sustain, int64_t decay) {
  if (distance < sustain) return 1.0f;
  if (distance >= sustain + decay) return 0.0f;
  return 1.0f - static_cast<float>(distance - sustain) / static_cast<float>(std::max<int64_t>(decay, 1));
}

}  // namespace

void sample_rows(const SampleParams& p, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) sample_row(p, row);
}

void apply_penalties(const PenaltyParams& p, int64_t begin, int64_t end) {
  struct Entry { int64_t id; int64_t distance; };
  std::vector<Entry> entries;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t* history = p.history + row * p.history_row_stride;
    entries.clear();
    for (int64_t j = 0; j < p.history_len; ++j) {
      if (history[j] >= 0 && history[j] < p.vocab_size) entries.push_back({history[j], p.history_len - 1 - j});
    }
    // by id, newest occurrence (smallest distance) first within an id
    std::sort(entries.begin(), entries.end(),
              [](const Entry& a, const Entry& b) { return a.id != b.id ? a.id < b.id : a.distance < b.distance; });
    float* logits = p.logits + row * p.logits_row_stride;
    const float rep = p.repetition[row], freq = p.frequency[row], pres = p.presence[row];
    const int64_t sustain = p.sustain[row], decay = p.decay[row];
    for (size_t i = 0; i < entries.size();) {
      const float newest = strength(entries[i].distance, sustain, decay);
      float total = 0.0f;
      size_t j = i;
      for (; j < entries.size() && entries[j].id == entries[i].id; ++j) {
        total += strength(entries[j].distance, sustain, decay);
      }
      const float factor = 1.0f + (rep - 1.0f) * newest;
      float l = logits[entries[i].id];
      l = l > 0.0f ? l / factor : l * factor;
      logits[entries[i].id] = l - pres * newest - freq * total;
      i = j;
    }
  }
}

void mask_tokens(const MaskTokensParams& p, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t* ids = p.token_ids + row * p.token_ids_row_stride;
    float* logits = p.logits + row * p.logits_row_stride;
    for (int64_t j = 0; j < p.num_ids; ++j) {
      if (ids[j] >= 0 && ids[j] < p.vocab_size) logits[ids[j]] = -std::numeric_limits<float>::infinity();
    }
  }
}

}  // namespace folio::cpu
