// folio._native_cpu: checks the tensors, releases the GIL, and runs the CPU kernels of native/cpu over
// torch's intra-op thread pool. Signatures: op_signatures.h (those of folio/reference_ops.py, plus the sampling ops).
#include <ATen/Parallel.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/key_index.h"
#include "../cpu/kernels.h"
#include "../cpu/route_waits.h"
#include "op_args.h"
#include "op_signatures.h"

namespace folio::bind {
namespace {

constexpr c10::DeviceType kCpu = c10::DeviceType::CPU;

// Runs kernel(begin, end) over [0, num_items) on torch's thread pool with the GIL released. `item_cost` is a
// rough count of elements one item touches; small ops stay on the calling thread.
template <typename Kernel>
void run_items(int64_t num_items, int64_t item_cost, Kernel&& kernel) {
  if (num_items <= 0) return;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, item_cost));
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) { kernel(begin, end); });
}

at::Tensor rms_norm(const at::Tensor& x,       // [N, H] float32/float16/bfloat16
                    const at::Tensor& weight,  // [H] x's dtype or float32
                    double eps) {
  check_all_on(kCpu, {{&x, "x"}, {&weight, "weight"}});
  const auto out = at::empty_like(x, at::MemoryFormat::Contiguous);  // [N, H] x's dtype
  const RmsNormParams p = rms_norm_args(out, x, nullptr, weight, eps);
  run_items(p.num_rows, p.hidden_size, [&](int64_t b, int64_t e) { cpu::rms_norm(p, b, e); });
  return out;
}

void fused_add_rms_norm(const at::Tensor& x,         // [N, H] float; in place: rms_norm(residual + x) * weight
                        const at::Tensor& residual,  // [N, H] x's dtype; in place: residual + x
                        const at::Tensor& weight,    // [H] x's dtype or float32
                        double eps) {
  check_all_on(kCpu, {{&x, "x"}, {&residual, "residual"}, {&weight, "weight"}});
  const RmsNormParams p = rms_norm_args(x, x, &residual, weight, eps);
  run_items(p.num_rows, p.hidden_size, [&](int64_t b, int64_t e) { cpu::rms_norm(p, b, e); });
}

at::Tensor silu_and_mul(const at::Tensor& x) {  // [N, 2F] float
  check_all_on(kCpu, {{&x, "x"}});
  check_dim(x, "x", 2, "[num_rows, 2 * width]");
  const auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());  // [N, F] x's dtype
  const SiluAndMulParams p = silu_and_mul_args(out, x);
  run_items(p.num_rows, 2 * p.half_width, [&](int64_t b, int64_t e) { cpu::silu_and_mul(p, b, e); });
  return out;
}

void rotary_cache_write(const at::Tensor& q,             // [T, Hq, D] float; rotated in place
                        const at::Tensor& k,             // [T, Hkv, D] q's dtype; rotated in place
                        const at::Tensor& v,             // [T, Hkv, D] q's dtype
                        const at::Tensor& positions,     // [T] int64
                        const at::Tensor& inv_freq,      // [D/2] float32
                        const at::Tensor& k_cache,       // [P, S, Hkv, D] q's dtype
                        const at::Tensor& v_cache,       // [P, S, Hkv, D] q's dtype
                        const at::Tensor& slot_mapping)  // [T] int64, < 0 = do not write
{
  check_all_on(kCpu, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&positions, "positions"}, {&inv_freq, "inv_freq"},
                      {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&slot_mapping, "slot_mapping"}});
  const RotaryCacheWriteParams p = rotary_cache_write_args(q, k, v, positions, inv_freq, k_cache, v_cache,
                                                           slot_mapping);
  const int64_t num_slots = k_cache.size(0) * p.page_size;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    FOLIO_CHECK_VALUE(p.slot_mapping[t] < num_slots, "slot_mapping[", t, "] = ", p.slot_mapping[t],
                      " outside the cache's ", num_slots, " slots");
  }
  run_items(p.num_tokens, (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim,
            [&](int64_t b, int64_t e) { cpu::rotary_cache_write(p, b, e); });
}

// Host-side checks the CPU can afford: every sequence's pages exist and every page index that a query reads is
// valid. With a window, the entries wholly before the window of a sequence's first query are not read (they may
// name pages released to the pool) and are not checked. first_query_pos: [B] positions of each first query.
void check_sequences(const PagedAttentionParams& p, int64_t num_pages, const std::vector<int64_t>& first_query_pos) {
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t context_len = p.context_lens[b];
    FOLIO_CHECK_VALUE(0 <= context_len && context_len <= p.max_blocks * p.page_size, "context_lens[", b, "] = ",
                      context_len, " outside [0, max_blocks * page_size = ", p.max_blocks * p.page_size, "]");
    const int64_t used_blocks = (context_len + p.page_size - 1) / p.page_size;
    for (int64_t j = first_visible_key(p, first_query_pos[b]) / p.page_size; j < used_blocks; ++j) {
      const int64_t page = p.block_tables[b * p.block_table_stride + j];
      FOLIO_CHECK_VALUE(0 <= page && page < num_pages, "block_tables[", b, ", ", j, "] = ", page,
                        " outside [0, num_pages = ", num_pages, ")");
    }
  }
}

at::Tensor paged_attention(const at::Tensor& q,             // [T, Hq, D] float
                           const at::Tensor& k_cache,       // [P, S, Hkv, D] q's dtype
                           const at::Tensor& v_cache,       // [P, S, Hkv, D] q's dtype
                           const at::Tensor& block_tables,  // [B, max_blocks] int32
                           const at::Tensor& cu_seqlens_q,  // [B + 1] int32
                           const at::Tensor& context_lens,  // [B] int32
                           double scale, int64_t max_q_len,
                           int64_t window,   // 0 = the whole context; else keys j with i - window < j <= i
                           double softcap) {  // 0 = none; else scores become softcap * tanh(score / softcap)
  check_all_on(kCpu, {{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_tables, "block_tables"},
                      {&cu_seqlens_q, "cu_seqlens_q"}, {&context_lens, "context_lens"}});
  const auto out = at::empty(q.sizes(), q.options());  // [T, Hq, D] q's dtype, contiguous
  const PagedAttentionParams p =
      attention_args(out, q, k_cache, v_cache, block_tables, &cu_seqlens_q, context_lens, scale, max_q_len, window,
                     softcap);
  const int64_t num_tokens = q.size(0);
  FOLIO_CHECK_VALUE(p.cu_seqlens_q[0] == 0 && p.cu_seqlens_q[p.num_seqs] == num_tokens,
                    "cu_seqlens_q must start at 0 and end at num_tokens = ", num_tokens, ", got ",
                    p.cu_seqlens_q[0], " .. ", p.cu_seqlens_q[p.num_seqs]);
  std::vector<int32_t> token_seq(num_tokens);
  std::vector<int64_t> first_query_pos(p.num_seqs);
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    FOLIO_CHECK_VALUE(0 <= q_len && q_len <= max_q_len && q_len <= p.context_lens[b], "sequence ", b, ": ", q_len,
                      " queries but max_q_len=", max_q_len, ", context_len=", p.context_lens[b]);
    for (int64_t t = p.cu_seqlens_q[b]; t < p.cu_seqlens_q[b + 1]; ++t) token_seq[t] = static_cast<int32_t>(b);
    first_query_pos[b] = static_cast<int64_t>(p.context_lens[b]) - q_len;
  }
  check_sequences(p, k_cache.size(0), first_query_pos);
  run_items(num_tokens * p.num_q_heads, p.max_blocks * p.page_size * p.head_dim,
            [&](int64_t b, int64_t e) { cpu::paged_attention(p, token_seq.data(), b, e); });
  return out;
}

at::Tensor paged_attention_decode(const at::Tensor& q,             // [B, Hq, D] float
                                  const at::Tensor& k_cache,       // [P, S, Hkv, D] q's dtype
                                  const at::Tensor& v_cache,       // [P, S, Hkv, D] q's dtype
                                  const at::Tensor& block_tables,  // [B, max_blocks] int32
                                  const at::Tensor& context_lens,  // [B] int32
                                  double scale,
                                  int64_t window,   // 0 = the whole context; else the last `window` positions
                                  double softcap) {  // 0 = none; else scores become softcap * tanh(score / softcap)
  check_all_on(kCpu, {{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_tables, "block_tables"},
                      {&context_lens, "context_lens"}});
  const auto out = at::empty(q.sizes(), q.options());  // [B, Hq, D] q's dtype, contiguous
  const PagedAttentionParams p =
      attention_args(out, q, k_cache, v_cache, block_tables, nullptr, context_lens, scale, 1, window, softcap);
  std::vector<int64_t> first_query_pos(p.num_seqs);
  for (int64_t b = 0; b < p.num_seqs; ++b) first_query_pos[b] = static_cast<int64_t>(p.context_lens[b]) - 1;
  check_sequences(p, k_cache.size(0), first_query_pos);
  run_items(p.num_seqs * p.num_q_heads, p.max_blocks * p.page_size * p.head_dim,
            [&](int64_t b, int64_t e) { cpu::paged_attention_decode(p, b, e); });
  return out;
}

void copy_page_slots(const at::Tensor& k_cache,  // [L, P, S, Hkv, D] float or uint8 codes, contiguous
                     const at::Tensor& v_cache,  // [L, P, S, Hkv, D] k_cache's dtype, contiguous
                     int64_t src_page, int64_t dst_page, int64_t num_slots) {
  check_all_on(kCpu, {{&k_cache, "k_cache"}, {&v_cache, "v_cache"}});
  const PageCopyParams p = copy_page_slots_args(k_cache, v_cache, src_page, dst_page, num_slots);
  run_items(p.num_layers, 2 * p.num_slots * p.slot_elems, [&](int64_t b, int64_t e) { cpu::copy_page_slots(p, b, e); });
}

std::tuple<at::Tensor, at::Tensor> sample_rows(
    const at::Tensor& logits,       // [B, V] float32 (penalties, bias and masks already applied)
    const at::Tensor& temperature,  // [B] float32; < 0.01 = greedy
    const at::Tensor& top_k,        // [B] int32; 1 = greedy, <= 0 = off
    const at::Tensor& top_p,        // [B] float32; >= 1 = off
    const at::Tensor& min_p,        // [B] float32; <= 0 = off
    const at::Tensor& u) {          // [B] float32 uniform draws in [0, 1)
  check_all_on(kCpu, {{&logits, "logits"}, {&temperature, "temperature"}, {&top_k, "top_k"}, {&top_p, "top_p"},
                      {&min_p, "min_p"}, {&u, "u"}});
  logits_args(logits);
  const auto token_ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));  // [B] int64
  const auto probs = at::empty({logits.size(0)}, logits.options());                      // [B] float32
  const SampleParams p = sample_rows_args(token_ids, probs, logits, temperature, top_k, top_p, min_p, u);
  run_items(p.num_rows, 8 * p.vocab_size, [&](int64_t b, int64_t e) { cpu::sample_rows(p, b, e); });
  return {token_ids, probs};
}

void apply_penalties(const at::Tensor& logits,    // [B, V] float32, modified in place
                     const at::Tensor& history,   // [B, H] int64 token ids, newest last, -1 = padding
                     const at::Tensor& rep,       // [B] float32 repetition penalty (1 = off)
                     const at::Tensor& freq,      // [B] float32 frequency penalty (0 = off)
                     const at::Tensor& pres,      // [B] float32 presence penalty (0 = off)
                     const at::Tensor& sustain,   // [B] int32 newest tokens at full strength
                     const at::Tensor& decay) {   // [B] int32 tokens over which the strength fades after those
  check_all_on(kCpu, {{&logits, "logits"}, {&history, "history"}, {&rep, "rep"}, {&freq, "freq"}, {&pres, "pres"},
                      {&sustain, "sustain"}, {&decay, "decay"}});
  const PenaltyParams p = apply_penalties_args(logits, history, rep, freq, pres, sustain, decay);
  run_items(p.num_rows, p.history_len, [&](int64_t b, int64_t e) { cpu::apply_penalties(p, b, e); });
}

void mask_tokens(const at::Tensor& logits,      // [B, V] float32, modified in place
                 const at::Tensor& token_ids) {  // [B, K] int64 ids set to -inf, -1 = padding
  check_all_on(kCpu, {{&logits, "logits"}, {&token_ids, "token_ids"}});
  const MaskTokensParams p = mask_tokens_args(logits, token_ids);
  run_items(p.num_rows, p.num_ids, [&](int64_t b, int64_t e) { cpu::mask_tokens(p, b, e); });
}

// The router's buffers: one-dimensional, contiguous, 8-byte items of one of the struct-format kinds `kinds` (keys:
// 'Q' / 'L' / 'K' unsigned; load-table columns: 'd' double; candidate rows: 'q' / 'l' 64-bit int), as numpy
// arrays and array('Q') give them.
const void* items_of(const pybind11::buffer_info& info, const char* what, const char* kinds, const char* type_name,
                     int64_t& length) {
  const std::string& f = info.format;
  const char kind = f.empty() ? '?' : f.back();
  const bool prefix_ok = f.size() == 1 || (f.size() == 2 && (f[0] == '<' || f[0] == '=' || f[0] == '@'));
  if (info.ndim != 1 || info.itemsize != 8 || !prefix_ok || std::string(kinds).find(kind) == std::string::npos ||
      (info.shape[0] > 1 && info.strides[0] != 8)) {
    throw std::invalid_argument(std::string(what) + " must be a contiguous 1-d buffer of " + type_name +
                                ", got format '" + f + "', itemsize " + std::to_string(info.itemsize));
  }
  length = info.shape[0];
  return info.ptr;
}

// The router's key index takes batches of keys as buffers of unsigned 64-bit ints (array('Q'), numpy uint64).
std::pair<const uint64_t*, int64_t> u64_items(const pybind11::buffer_info& info, const char* what) {
  int64_t length = 0;
  const auto* keys = static_cast<const uint64_t*>(items_of(info, what, "QLK", "uint64", length));
  return {keys, length};
}

struct CandidateWaits {};  // the namespace of candidate_waits_least in the module

// folio.router.cost.LoadTable.least_waiting's pass over the candidates: fills wait_out (one per candidate) and
// returns the positions of the k least `unshared` waits (native/cpu/route_waits.h).
pybind11::list candidate_waits_least(const pybind11::buffer& busy_until, const pybind11::buffer& settled,
                                     const pybind11::buffer& one_job_s, const pybind11::buffer& fit_tokens,
                                     const pybind11::object& rows, double now, double uncached_tokens, int64_t k,
                                     const pybind11::buffer& wait_out) {
  const pybind11::buffer_info b = busy_until.request(), s = settled.request(), o = one_job_s.request(),
                              f = fit_tokens.request(), w = wait_out.request(true);
  int64_t num_slots = std::numeric_limits<int64_t>::max(), n = 0;
  auto column = [&num_slots](const pybind11::buffer_info& info, const char* what) {  // (rows: the shortest's)
    int64_t length = 0;
    const auto* values = static_cast<const double*>(items_of(info, what, "d", "float64", length));
    num_slots = std::min(num_slots, length);
    return values;
  };
  const double *busy = column(b, "busy_until"), *settled_s = column(s, "settled"), *one_job = column(o, "one_job_s"),
               *fit = column(f, "fit_tokens");
  auto* wait = static_cast<double*>(const_cast<void*>(items_of(w, "wait_out", "d", "float64", n)));
  const int64_t* row_of = nullptr;
  pybind11::buffer_info r;
  if (!rows.is_none()) {
    r = pybind11::reinterpret_borrow<pybind11::buffer>(rows).request();
    int64_t num_rows = 0;
    row_of = static_cast<const int64_t*>(items_of(r, "rows", "ql", "int64", num_rows));
    if (num_rows != n) throw std::invalid_argument("rows and wait_out differ in length");
    for (int64_t i = 0; i < n; ++i) {
      if (row_of[i] < 0 || row_of[i] >= num_slots) throw std::invalid_argument("a row is outside the load table");
    }
  } else if (n > num_slots) {
    throw std::invalid_argument("more candidates than load-table rows");
  }
  k = std::clamp<int64_t>(k, 0, n);
  std::vector<double> unshared(static_cast<size_t>(n));
  std::vector<int64_t> least(static_cast<size_t>(k));
  cpu::candidate_waits(busy, settled_s, one_job, fit, row_of, n, now, uncached_tokens, wait, unshared.data());
  cpu::least_k(unshared.data(), n, k, least.data());
  pybind11::list out(k);
  for (int64_t i = 0; i < k; ++i) out[i] = pybind11::int_(least[i]);
  return out;
}

// One cache-event batch of a routing report, decoded: [seq, stored, evicted] or [seq, stored, evicted, moved]
// (folio.router.digest; moved keys stay held, so they change nothing here).
struct DecodedBatch {
  int64_t seq;
  std::vector<uint64_t> stored, evicted;
};

int64_t exact_int_or(PyObject* value, int64_t otherwise) {
  int overflow = 0;  // (an exact int sets it rather than raising)
  const long long number = PyLong_CheckExact(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : otherwise;
  return overflow ? otherwise : number;
}

bool decode_str(PyObject* value, std::vector<uint64_t>& out) {
  Py_ssize_t length = 0;
  const char* text = PyUnicode_CheckExact(value) ? PyUnicode_AsUTF8AndSize(value, &length) : nullptr;
  if (text == nullptr) PyErr_Clear();  // (not a str, or one with no UTF-8 form)
  return text != nullptr && cpu::decode_base64_keys(text, static_cast<size_t>(length), out);
}

// The batches of `batches` (a report's list, oldest first) after after_seq, decoded; false where any of them is
// not a well-formed batch with seqs increasing up to max_seq (the caller's slower path then names the error).
bool decode_new_batches(PyObject* batches, int64_t after_seq, int64_t max_seq, std::vector<DecodedBatch>& out) {
  if (!PyList_CheckExact(batches)) return false;
  // Walk back from the newest while batches are new; a malformed one is not known to be applied: it is included.
  Py_ssize_t first = PyList_GET_SIZE(batches);
  while (first > 0) {
    PyObject* batch = PyList_GET_ITEM(batches, first - 1);
    const bool has_seq = PyList_CheckExact(batch) && PyList_GET_SIZE(batch) >= 1;
    if (has_seq && exact_int_or(PyList_GET_ITEM(batch, 0), after_seq + 1) <= after_seq) break;
    --first;
  }
  int64_t previous = after_seq;
  for (Py_ssize_t i = first; i < PyList_GET_SIZE(batches); ++i) {
    PyObject* batch = PyList_GET_ITEM(batches, i);
    if (!PyList_CheckExact(batch) || (PyList_GET_SIZE(batch) != 3 && PyList_GET_SIZE(batch) != 4)) return false;
    DecodedBatch decoded{exact_int_or(PyList_GET_ITEM(batch, 0), -1), {}, {}};
    std::vector<uint64_t> moved;
    if (decoded.seq <= previous || decoded.seq > max_seq || !decode_str(PyList_GET_ITEM(batch, 1), decoded.stored) ||
        !decode_str(PyList_GET_ITEM(batch, 2), decoded.evicted) ||
        (PyList_GET_SIZE(batch) == 4 && !decode_str(PyList_GET_ITEM(batch, 3), moved))) {
      return false;
    }
    previous = decoded.seq;
    out.push_back(std::move(decoded));
  }
  return true;
}

// A report as apply_report reads it: its s/i/p/q/f fields (a tuple, then their numbers packed) and its batches
// after the applied ones, decoded.
struct ReadReport {
  pybind11::tuple values;
  std::vector<DecodedBatch> batches;
};

// Reads report[names[i]] by kinds[i] (folio.router.digest COMMON_REPORT_KINDS) and decodes its batches after
// after_seq; false where the report is not a dict, a field is missing or not of its kind (exact types: a bool is
// not a count), or a batch is malformed.
bool read_report(PyObject* report, const pybind11::tuple& names, const std::string& kinds, int64_t after_seq,
                 ReadReport& out) {
  if (kinds.size() != names.size()) throw std::invalid_argument("apply_report: one kind per field name");
  if (!PyDict_CheckExact(report)) return false;
  // Its objects are scattered and cold: touch them all at once, so that the look-ups wait on one round of misses.
  Py_ssize_t position = 0;
  PyObject *key = nullptr, *value = nullptr, *batches = nullptr;
  while (PyDict_Next(report, &position, &key, &value)) {
    __builtin_prefetch(key);
    __builtin_prefetch(value);
  }
  const auto returned = [](char kind) { return kind != 'n' && kind != 'b'; };
  out.values = pybind11::tuple(1 + std::count_if(kinds.begin(), kinds.end(), returned));
  std::vector<double> numbers;  // the i/p/q/f fields as doubles (as Python's float() of each)
  int64_t max_seq = -1;
  Py_ssize_t next = 0;
  for (size_t i = 0; i < kinds.size(); ++i) {
    value = PyDict_GetItemWithError(report, PyTuple_GET_ITEM(names.ptr(), static_cast<Py_ssize_t>(i)));  // borrowed
    if (value == nullptr) {
      if (PyErr_Occurred()) throw pybind11::error_already_set();  // an unhashable name: the spec is wrong
      return false;
    }
    const char kind = kinds[i];
    if (kind == 'b') batches = value;
    if (kind == 'n' || kind == 'b') {
      if (kind == 'n' && value != Py_None) return false;
      continue;
    }
    if (kind == 'f') {
      const double number = PyFloat_CheckExact(value) ? PyFloat_AS_DOUBLE(value) : -1.0;
      if (!(number >= 0.0 && number < std::numeric_limits<double>::infinity())) return false;  // (NaN fails too)
      numbers.push_back(number);
    } else if (kind == 'i' || kind == 'p' || kind == 'q') {
      int overflow = 0;
      const long long number = PyLong_CheckExact(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : -1;
      if (overflow < 0 || (overflow == 0 && number < (kind == 'p' ? 1 : 0))) return false;
      if (kind == 'q') max_seq = overflow > 0 ? std::numeric_limits<int64_t>::max() : number;
      numbers.push_back(overflow > 0 ? PyLong_AsDouble(value) : static_cast<double>(number));
      if (numbers.back() == -1.0 && PyErr_Occurred()) {  // beyond a double: the full decode's business
        PyErr_Clear();
        return false;
      }
    } else if (kind != 's') {
      throw std::invalid_argument(std::string("apply_report: unknown field kind '") + kind + "'");
    } else if (!PyUnicode_CheckExact(value)) {
      return false;
    }
    Py_INCREF(value);
    PyTuple_SET_ITEM(out.values.ptr(), next++, value);
  }
  if (batches == nullptr || max_seq < 0) throw std::invalid_argument("apply_report: no b or q field");
  PyObject* packed = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(numbers.data()),
                                               static_cast<Py_ssize_t>(numbers.size() * sizeof(double)));
  if (packed == nullptr) throw pybind11::error_already_set();
  PyTuple_SET_ITEM(out.values.ptr(), next, packed);  // (the tuple takes the reference)
  return decode_new_batches(batches, after_seq, max_seq, out.batches);
}

}  // namespace
}  // namespace folio::bind

PYBIND11_MODULE(_native_cpu, m) {
  namespace py = pybind11;
  using namespace folio::bind;
  m.doc() = "folio CPU kernels (see native/); signatures match folio.reference_ops";
  FOLIO_NATIVE_OPS(FOLIO_DEF_CPU)

  using folio::cpu::KeyIndex;
  py::class_<KeyIndex>(m, "KeyIndex", "Routing keys held per replica slot (folio.router.index)")
      .def(py::init<>())
      .def(
          "apply",
          [](KeyIndex& self, int32_t slot, const py::buffer& stored, const py::buffer& evicted) {
            const py::buffer_info stored_info = stored.request(), evicted_info = evicted.request();
            const auto [stored_keys, num_stored] = u64_items(stored_info, "stored");
            const auto [evicted_keys, num_evicted] = u64_items(evicted_info, "evicted");
            self.apply(slot, stored_keys, num_stored, evicted_keys, num_evicted);
          },
          py::arg("slot"), py::arg("stored"), py::arg("evicted"))
      .def(
          "replace",
          [](KeyIndex& self, int32_t slot, const py::buffer& keys) {
            const py::buffer_info info = keys.request();
            const auto [items, num_items] = u64_items(info, "keys");
            self.replace(slot, items, num_items);
          },
          py::arg("slot"), py::arg("keys"))
      .def(
          "apply_report",
          [](KeyIndex& self, int32_t slot, const py::handle& report, const py::tuple& names, const std::string& kinds,
             int64_t after_seq, bool want_stored) -> py::object {
            // A replica's report as it came (a JSON-able dict), read and its new batches applied in one call: a
            // router applies every replica's report each period. All batches are decoded before any is applied.
            ReadReport read;
            if (!read_report(report.ptr(), names, kinds, after_seq, read)) return py::none();
            const std::vector<DecodedBatch>& decoded = read.batches;
            int64_t num_events = 0;
            py::object stored_keys = want_stored ? py::object(py::list()) : py::object(py::none());  // (most: not)
            for (const DecodedBatch& batch : decoded) {
              self.apply(slot, batch.stored.data(), static_cast<int64_t>(batch.stored.size()), batch.evicted.data(),
                         static_cast<int64_t>(batch.evicted.size()));
              num_events += static_cast<int64_t>(batch.stored.size() + batch.evicted.size());
              if (want_stored) stored_keys.attr("extend")(batch.stored);
            }
            const int64_t first_seq = decoded.empty() ? 0 : decoded.front().seq;
            const int64_t last_seq = decoded.empty() ? 0 : decoded.back().seq;
            return py::make_tuple(std::move(read.values), first_seq, last_seq, static_cast<int64_t>(decoded.size()),
                                  num_events, stored_keys);
          },
          py::arg("slot"), py::arg("report"), py::arg("names"), py::arg("kinds"), py::arg("after_seq"),
          py::arg("want_stored"),
          "Read report[names[i]] by kinds[i] (folio.router.digest COMMON_REPORT_KINDS), apply its batches after "
          "after_seq. None, with nothing applied, where the report is not that; else ((the s/i/p/q/f fields, then "
          "the i/p/q/f ones as float64s, packed), first seq, last seq, batches applied, events, stored or None).")
      .def("clear", &KeyIndex::clear, py::arg("slot"))
      .def("holds", &KeyIndex::holds, py::arg("slot"), py::arg("key"))
      .def("keys_of", &KeyIndex::keys_of, py::arg("slot"))
      .def("num_keys", &KeyIndex::num_keys, py::arg("slot"))
      .def("__len__", &KeyIndex::size)
      .def(
          "match",
          [](const KeyIndex& self, const std::vector<uint64_t>& keys) {
            return self.match(keys.data(), static_cast<int64_t>(keys.size()));
          },
          py::arg("keys"));
  // (a class, as KeyIndex: the module's functions are the ops of op_signatures.h, each with a reference)
  py::class_<CandidateWaits>(m, "CandidateWaits", "The router's pass over its candidates (folio.router.cost)")
      .def_static("least", &candidate_waits_least, py::arg("busy_until"), py::arg("settled"), py::arg("one_job_s"),
                  py::arg("fit_tokens"), py::arg("rows"), py::arg("now"), py::arg("uncached_tokens"), py::arg("k"),
                  py::arg("wait_out"),
                  "The candidates' waits into wait_out, and the positions of the k least unshared waits in order "
                  "of (wait, position) (folio.router.cost.LoadTable.least_waiting).");
}
