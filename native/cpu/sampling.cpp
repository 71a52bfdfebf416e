// Batched sampling, penalties and token masks on the CPU; kernels.h defines the semantics.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "kernels.h"

namespace folio::cpu {
namespace {

uint32_t key_of(float weight) {
  uint32_t key;
  std::memcpy(&key, &weight, 4);
  return key;
}

int64_t argmax_row(const float* logits, int64_t vocab_size) {
  int64_t best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab_size; ++i) {
    if (logits[i] > best_value) {  // strict: the first of equal maxima wins, NaN never does
      best_value = logits[i];
      best = i;
    }
  }
  return best;
}

// The k-th largest key (k >= 1), counting ties.
uint32_t kth_largest_key(std::vector<uint32_t> keys, int64_t k) {
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  return keys[k - 1];
}

int64_t sample_row(const SampleParams& p, int64_t row) {
  const float* logits = p.logits + row * p.logits_row_stride;
  const int64_t vocab = p.vocab_size;
  const int64_t argmax = argmax_row(logits, vocab);
  if (!(p.temperature[row] >= kGreedyTemperature)) return argmax;

  const float inv_temperature = 1.0f / p.temperature[row];
  const float max_z = logits[argmax] * inv_temperature;
  if (!std::isfinite(max_z)) return argmax;  // every logit -inf or NaN, or the max is +inf: nothing to weigh
  std::vector<uint32_t> keys(vocab);
  std::vector<uint64_t> mass(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    const float z = logits[i] * inv_temperature;
    const float w = std::isnan(z) ? 0.0f : std::exp(z - max_z);
    keys[i] = key_of(w);
    mass[i] = static_cast<uint64_t>(static_cast<double>(w) * kSampleWeightScale);
  }

  uint32_t threshold = 0;  // keep key >= threshold
  const int32_t top_k = p.top_k[row];
  if (top_k > 0 && top_k < vocab) threshold = kth_largest_key(keys, top_k);

  if (p.top_p[row] < 1.0f) {
    std::vector<uint32_t> kept;
    uint64_t kept_mass = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (keys[i] >= threshold) {
        kept.push_back(keys[i]);
        kept_mass += mass[i];
      }
    }
    const double p_target = std::max(0.0, static_cast<double>(p.top_p[row])) * static_cast<double>(kept_mass);
    const uint64_t target = std::max<uint64_t>(1, static_cast<uint64_t>(p_target));
    // Walk the kept keys from the largest down; a key's mass counts all its ties (mass is a function of the key).
    std::sort(kept.begin(), kept.end(), std::greater<uint32_t>());
    uint64_t cumulative = 0;
    size_t i = 0;
    while (i < kept.size()) {
      const uint32_t key = kept[i];
      float w;
      std::memcpy(&w, &key, 4);
      const uint64_t unit = static_cast<uint64_t>(static_cast<double>(w) * kSampleWeightScale);
      size_t j = i;
      while (j < kept.size() && kept[j] == key) ++j;
      cumulative += unit * (j - i);
      threshold = key;
      if (cumulative >= target) break;
      i = j;
    }
  }

  const float min_p = p.min_p[row];
  if (min_p > 0.0f) threshold = std::max(threshold, key_of(min_p));

  uint64_t total = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (keys[i] >= threshold) total += mass[i];
  }
  if (total == 0) return argmax;
  const uint64_t target = static_cast<uint64_t>(static_cast<double>(p.uniform[row]) * static_cast<double>(total));
  uint64_t cumulative = 0;
  int64_t last_kept = argmax;
  for (int64_t i = 0; i < vocab; ++i) {
    if (keys[i] < threshold || mass[i] == 0) continue;
    cumulative += mass[i];
    last_kept = i;
    if (cumulative > target) return i;
  }
  return last_kept;  // only when u >= 1 (out of contract) pushes the target past the total
}

}  // namespace

void sample_rows(const SampleParams& p, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) p.out_token_ids[row] = sample_row(p, row);
}

void apply_penalties(const PenaltyParams& p, int64_t begin, int64_t end) {
  std::vector<int64_t> ids;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t* history = p.history + row * p.history_row_stride;
    ids.clear();
    for (int64_t j = 0; j < p.history_len; ++j) {
      if (history[j] >= 0 && history[j] < p.vocab_size) ids.push_back(history[j]);
    }
    std::sort(ids.begin(), ids.end());
    float* logits = p.logits + row * p.logits_row_stride;
    const float rep = p.repetition[row], freq = p.frequency[row], pres = p.presence[row];
    for (size_t i = 0; i < ids.size();) {
      size_t j = i;
      while (j < ids.size() && ids[j] == ids[i]) ++j;
      const float count = static_cast<float>(j - i);
      float l = logits[ids[i]];
      l = l > 0.0f ? l / rep : l * rep;
      logits[ids[i]] = l - (freq * count + pres);
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
