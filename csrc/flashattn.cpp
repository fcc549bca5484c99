// The op contract: every schema of the flashattn namespace, defined once, with its defaults.
// Backends register implementations with TORCH_LIBRARY_IMPL in csrc/cpu and csrc/cuda; the fake (meta)
// implementations live in flashattn_ext/ops.py.
#include <Python.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

extern "C" {
// `import flashattn_ext._C` only needs to load this shared library: loading it runs the registrations below.
// No pybind11: the dispatcher is the whole interface.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace {

// The head-dim buckets (multiples of 32: a head dim D runs in ceil(D / 32) * 32) whose CUDA kernels this build holds
// (setup.py passes FLASHATTN_BUILT_HEADDIMS to CUDA builds only); none for a CPU-only build.
std::vector<int64_t> cuda_head_dims() {
#ifdef FLASHATTN_BUILT_HEADDIMS
  return {FLASHATTN_BUILT_HEADDIMS};
#else
  return {};
#endif
}

// Whether this build holds the Hopper kernels (sm_90a in FLASHATTN_CUDA_ARCHS): on a Hopper GPU they take what the
// portable ones take more slowly or not at all (long KV-cache chunks, the packed backward above D128).
bool cuda_hopper_kernels() {
#ifdef FLASHATTN_WITH_SM90
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(flashattn, m) {
  // What this build's CUDA kernels take (for callers that must know before a call, such as the SDPA provider and the
  // Hugging Face integration).
  m.def("cuda_head_dims() -> int[]", &cuda_head_dims);
  m.def("cuda_hopper_kernels() -> bool", &cuda_hopper_kernels);
  // q: (B, H, Lq, D); k, v: (B, Hk, Lk, D) with H % Hk == 0. Returns out (q's shape and dtype, its memory order:
  // api/layouts.h) and lse (float32, (B, H, Lq), natural-log logsumexp of the scaled scores). causal is bottom-right
  // aligned.
  // window_size (left, right): query i sees key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded
  // on that side; causal sets right = 0). softcap > 0 caps the scores: softcap * tanh(scale * q.k / softcap).
  // sinks: float32 (H,), one logit per query head in each row's softmax denominator, with no value row.
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, int[2] window_size=[-1, -1], "
      "float softcap=0.0, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  // Gradients of fwd given dout (and optionally dlse, the gradient flowing into lse, which ring/context-parallel
  // attention needs). dq has q's shape and memory order, dk/dv k's and v's; all in the input dtype; dsinks is
  // float32 (H,) with sinks, else empty. deterministic=True forbids order-dependent accumulation (bitwise-identical
  // results across runs).
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal=False, float? scale=None, "
      "Tensor? dlse=None, bool deterministic=False, int[2] window_size=[-1, -1], float softcap=0.0, "
      "Tensor? sinks=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  // Packed variable-length sequences: q (total_q, H, D), k and v (total_k, Hk, D); sequence b is rows
  // cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] .. of k and v (int32 (B + 1,), from 0,
  // non-decreasing). Every rule of fwd holds per sequence. max_seqlen_* are hints (never needed for correctness).
  // out (and bwd_varlen's dq, dk, dv) contiguous; lse float32 (H, total_q).
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q=None, "
      "int? max_seqlen_k=None, bool causal=False, float? scale=None, int[2] window_size=[-1, -1], "
      "float softcap=0.0, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int? max_seqlen_q=None, int? max_seqlen_k=None, bool causal=False, float? scale=None, "
      "Tensor? dlse=None, bool deterministic=False, int[2] window_size=[-1, -1], float softcap=0.0, "
      "Tensor? sinks=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  // Decoding against a KV cache, forward only. q (B, H, Lq, D). k_cache, v_cache: dense (B, Hk, Lmax, D), or paged
  // (num_pages, Hk, page_size, D) with block_table int32 (B, max_pages). cache_seqlens int32 (B,): valid lengths
  // (default: the capacity less Lnew). k, v (B, Hk, Lnew, D), if given, are written into the caches at cache_seqlens[b]
  // .. (the caches are mutated, cache_seqlens is not); attention then runs over cache_seqlens[b] + Lnew keys, causal
  // bottom-right per batch entry. num_splits: key splits (0: chosen from the shape) on CUDA. cache_leftpad int32 (B,),
  // dense caches: entry b's keys start there (left padding; default 0). lse float32 (B, H, Lq).
  m.def(
      "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, Tensor? v=None, "
      "Tensor? cache_seqlens=None, Tensor? block_table=None, bool causal=False, float? scale=None, "
      "int[2] window_size=[-1, -1], float softcap=0.0, Tensor? sinks=None, int num_splits=0, "
      "Tensor? cache_leftpad=None) -> (Tensor out, Tensor lse)");
}
