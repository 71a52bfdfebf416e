#include "route_waits.h"

#include <algorithm>
#include <cmath>

namespace folio::cpu {

void candidate_waits(const double* busy_until, const double* settled, const double* one_job_s,
                     const double* fit_tokens, const int64_t* rows, int64_t n, double now, double uncached_tokens,
                     double* wait, double* unshared) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows != nullptr ? rows[i] : i;
    // numpy: w = busy_until[rows] - now; np.maximum(w, 0.0, out=w); w += settled[rows]  (NaN and -0.0 stay)
    double w = busy_until[r] - now;
    if (w < 0.0) w = 0.0;
    w += settled[r];
    wait[i] = w;
    // numpy: one_job_s[rows] * (uncached > fit_tokens[rows]) + w
    unshared[i] = one_job_s[r] * (uncached_tokens > fit_tokens[r] ? 1.0 : 0.0) + w;
  }
}

void least_k(const double* values, int64_t n, int64_t k, int64_t* out) {
  // (value, position) with NaN after every number: numpy's sort order, made total by the position
  auto before = [values](int64_t a, int64_t b) {
    const double x = values[a], y = values[b];
    const bool x_nan = std::isnan(x), y_nan = std::isnan(y);
    if (x_nan != y_nan) return y_nan;
    if (!x_nan && x != y) return x < y;
    return a < b;
  };
  // One pass keeping the k least so far in order (k is a shortlist's size, n a fleet's): most positions are
  // turned away by one comparison with the largest kept.
  k = std::min(k, n);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (kept == k && (k == 0 || !before(i, out[k - 1]))) continue;
    int64_t at = kept < k ? kept++ : k - 1;
    while (at > 0 && before(i, out[at - 1])) {
      out[at] = out[at - 1];
      --at;
    }
    out[at] = i;
  }
}

}  // namespace folio::cpu
