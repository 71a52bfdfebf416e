// The router's per-decision pass over every candidate replica (folio.router.cost.LoadTable.least_waiting): plain
// C++, no torch, no pybind11. In numpy it was half a dozen whole-array operations and a partial sort, each paying
// numpy's fixed cost per call on arrays of a few hundred entries; here it is one loop and one selection.
#pragma once

#include <cstdint>

namespace folio::cpu {

// For candidate i (load-table row rows[i], or row i when rows is null), in seconds:
//   wait[i]     = max(busy_until[r] - now, 0) + settled[r]      (before a new request's own prefill could start)
//   unshared[i] = (uncached_tokens > fit_tokens[r] ? one_job_s[r] : 0) + wait[i]   (plus a job's decode time where
//                 the replica lacks the pages for the request's uncached tokens)
// with the same floating-point operations, in the same order, as the numpy expression they replace.
void candidate_waits(const double* busy_until, const double* settled, const double* one_job_s,
                     const double* fit_tokens, const int64_t* rows, int64_t n, double now, double uncached_tokens,
                     double* wait, double* unshared);

// The positions of the min(k, n) smallest of values[0, n) into out, in increasing order of (value, position), NaN
// after every number.
void least_k(const double* values, int64_t n, int64_t k, int64_t* out);

}  // namespace folio::cpu
