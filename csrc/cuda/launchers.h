// Declarations of the kernel launchers. Each templated (dtype, head dim, variant) launcher is instantiated in its own
// generated file under csrc/cuda/instantiations/ (generate_instantiations.py), so that the build compiles them in
// parallel. Each launches on the given stream, never synchronises, and returns the first CUDA error.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.h"

namespace flashattn {

// Lets `kernel` use `bytes` of dynamic shared memory (past the default 48 KB). Where the device refuses, returns the
// attribute's error without leaving it behind (it is not sticky) for the next call to find.
template <typename Kernel>
inline cudaError_t allow_dynamic_smem(Kernel kernel, int bytes) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

namespace sm80 {
// kOptions: the variants with a sliding window, softcap and sinks (the params' score modifications; kCausal false).
// kSequences (with kOptions): per-sequence lengths and offsets too: packed sequences (params.cu_seqlens_*), a KV
// cache (params.seqlens_k, params.block_table); in the backward also dQ in a fixed order (params.dq_semaphore: one
// int32 per query block of kBwdBlockM rows, (B, H, ceil(Lq / kBwdBlockM)), or (H, total_q / kBwdBlockM + B) packed;
// zero on entry).
template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_fwd_sm80(const FwdParams& params, cudaStream_t stream);

template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_bwd_sm80(const BwdParams& params, cudaStream_t stream);
inline constexpr int kBwdBlockM = 64;

// The decode path (decode.h): params.plan.splits key splits, then their combine; kPaged: K/V through the block table.
template <typename T, int HeadDim, bool kPaged>
cudaError_t run_decode(const FwdParams& params, cudaStream_t stream);
}  // namespace sm80

// The KV cache's append of new keys and values, before the decode path reads them (kvcache_append.cu).
cudaError_t run_kvcache_append(const KvAppendParams& params, cudaStream_t stream);

// The passes before and after every fused backward (bwd_preprocess.cu, bwd_postprocess.cu).
cudaError_t run_bwd_preprocess(const BwdPreprocessParams& params, bool is_bf16, cudaStream_t stream);
cudaError_t run_bwd_postprocess(const BwdPostprocessParams& params, bool is_bf16, cudaStream_t stream);

namespace sm90 {
// As params.plan says (fwd_plan.h); cudaErrorNotSupported where the driver refuses a tensor map or the shared memory.
// kSequences (with kOptions): packed sequences (params.cu_seqlens_*, the workspace's seq_* parts).
template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream);

// kOptions: windows and softcap; kSequences (with kOptions): packed sequences (params.seq_maps: kBwdSeqMaps maps per
// sequence, 128-byte aligned, for the preparation to fill).
template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_bwd_sm90(const BwdParams& params, cudaStream_t stream);
}  // namespace sm90

}  // namespace flashattn
