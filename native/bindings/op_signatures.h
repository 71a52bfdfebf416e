// The Python signature of every native op, written once for both modules: FOLIO_NATIVE_OPS(OP) calls
//   OP(name, modules, launch, py::arg(...)...)
// once per op, where
//   name     the op's function, folio::bind::<name> in each module that defines it;
//   modules  BOTH (folio._native_cpu and folio._native_cuda) or CUDA_ONLY;
//   launch   the CUDA launch options the CUDA module appends as keyword-only arguments (FOLIO_LAUNCH_ARGS_*):
//            NONE, PDL (`pdl`) or PDL_MMA (`pdl`, `use_mma`); the CPU module takes none;
//   py::arg  the arguments, named and ordered as in folio/reference_ops.py.
// folio/op_registry.py lists the same ops; tests/test_op_registry.py parses this file and checks that the two agree
// (and the built modules' signatures too). pybind11 refuses at compile time a py::arg list whose length differs
// from the C++ function's parameters, so the functions cannot drift from this file either.
//
// Each module expands the list with its FOLIO_DEF_* macro below, where `m` is its py::module_.
#pragma once

#include <pybind11/pybind11.h>

// clang-format off
#define FOLIO_NATIVE_OPS(OP)                                                                                         \
  OP(rms_norm, BOTH, PDL, py::arg("x"), py::arg("weight"), py::arg("eps"))                                           \
  OP(fused_add_rms_norm, BOTH, PDL, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"))            \
  OP(silu_and_mul, BOTH, PDL, py::arg("x"))                                                                          \
  OP(rotary_cache_write, BOTH, PDL, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("positions"),                  \
     py::arg("inv_freq"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"))                           \
  OP(paged_attention, BOTH, PDL, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),      \
     py::arg("cu_seqlens_q"), py::arg("context_lens"), py::arg("scale"), py::arg("max_q_len"), py::arg("window"),    \
     py::arg("softcap"))                                                                                             \
  OP(paged_attention_decode, BOTH, PDL_MMA, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),                    \
     py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("window"), py::arg("softcap"))      \
  OP(copy_page_slots, BOTH, NONE, py::arg("k_cache"), py::arg("v_cache"), py::arg("src_page"), py::arg("dst_page"),  \
     py::arg("num_slots"))                                                                                           \
  OP(rotary_cache_write_quant, CUDA_ONLY, PDL, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("positions"),       \
     py::arg("inv_freq"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),            \
     py::arg("slot_mapping"), py::arg("kv_format"))                                                                  \
  OP(paged_attention_quant, CUDA_ONLY, PDL, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), \
     py::arg("v_scale"), py::arg("block_tables"), py::arg("cu_seqlens_q"), py::arg("context_lens"), py::arg("scale"), \
     py::arg("max_q_len"), py::arg("window"), py::arg("softcap"), py::arg("kv_format"))                             \
  OP(paged_attention_decode_quant, CUDA_ONLY, PDL, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),             \
     py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),     \
     py::arg("window"), py::arg("softcap"), py::arg("kv_format"))                                                    \
  OP(sample_rows, BOTH, NONE, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),         \
     py::arg("min_p"), py::arg("u"))                                                                                 \
  OP(apply_penalties, BOTH, NONE, py::arg("logits"), py::arg("history"), py::arg("rep"), py::arg("freq"),            \
     py::arg("pres"), py::arg("sustain"), py::arg("decay"))                                                          \
  OP(mask_tokens, BOTH, NONE, py::arg("logits"), py::arg("token_ids"))                                               \
  OP(linear, CUDA_ONLY, PDL, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),                          \
     py::arg("silu_gate") = false)                                                                                   \
  OP(linear_fp8, CUDA_ONLY, PDL, py::arg("x"), py::arg("weight"), py::arg("weight_scale"),                          \
     py::arg("bias") = py::none(), py::arg("silu_gate") = false)                                                     \
  OP(quantize_rows_fp8, CUDA_ONLY, PDL, py::arg("x"))                                                                \
  OP(wait_host_value, CUDA_ONLY, NONE, py::arg("device"), py::arg("flag"), py::arg("value"), py::arg("timeout_ns"))
// clang-format on

// Launch options: keyword-only, defaulting to EngineOptions' defaults (PDL on, the tensor-core decode kernel) so
// that a direct call with the reference's arguments behaves as the engine does by default. folio.ops passes them
// explicitly, from the model's EngineOptions.
#define FOLIO_LAUNCH_ARGS_PDL py::kw_only(), py::arg("pdl") = true
#define FOLIO_LAUNCH_ARGS_PDL_MMA FOLIO_LAUNCH_ARGS_PDL, py::arg("use_mma") = true

// folio._native_cpu: every BOTH op, with its arguments only.
#define FOLIO_DEF_CPU(name, modules, launch, ...) FOLIO_DEF_CPU_##modules(name, __VA_ARGS__)
#define FOLIO_DEF_CPU_BOTH(name, ...) m.def(#name, &name, __VA_ARGS__);
#define FOLIO_DEF_CPU_CUDA_ONLY(name, ...)

// folio._native_cuda: every op, with its arguments and then its launch options.
#define FOLIO_DEF_CUDA(name, modules, launch, ...) FOLIO_DEF_CUDA_##launch(name, __VA_ARGS__)
#define FOLIO_DEF_CUDA_NONE(name, ...) m.def(#name, &name, __VA_ARGS__);
#define FOLIO_DEF_CUDA_PDL(name, ...) m.def(#name, &name, __VA_ARGS__, FOLIO_LAUNCH_ARGS_PDL);
#define FOLIO_DEF_CUDA_PDL_MMA(name, ...) m.def(#name, &name, __VA_ARGS__, FOLIO_LAUNCH_ARGS_PDL_MMA);
