// Declarations of the forward launchers. Each (dtype, head-dim bucket, causal) is instantiated in its own
// generated file under csrc/cuda/instantiations/ so that the build compiles them in parallel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/params.h"

namespace flashattn {

// Head-dim buckets: a head dim D runs in the smallest bucket >= D (columns past D are zero-filled).
inline constexpr int kHeadDimBuckets[] = {32, 64, 96, 128, 160, 192, 224, 256};

namespace sm80 {
template <typename T, int HeadDim, bool kCausal>
cudaError_t run_fwd_sm80(const FwdParams& params, cudaStream_t stream);
}  // namespace sm80

}  // namespace flashattn
