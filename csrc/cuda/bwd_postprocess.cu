// The backward's last pass over the query rows, for every fused backward (sm80 and Hopper): dQ = scale * dq_accum,
// the fp32 sums of dS K over the key blocks, rounded to the inputs' type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/launchers.h"

namespace flashattn {
namespace {

template <typename T2>
__device__ T2 to_pair(float x, float y);
template <>
__device__ __forceinline__ __nv_bfloat162 to_pair<__nv_bfloat162>(float x, float y) {
  return __floats2bfloat162_rn(x, y);
}
template <>
__device__ __forceinline__ __half2 to_pair<__half2>(float x, float y) {
  return __floats2half2_rn(x, y);
}

constexpr int kThreads = 256;

// As the preprocessing: a row is a group of `lanes` lanes, each converting 8-element chunks (32 bytes in, 16 out).
template <typename T2>
__global__ void __launch_bounds__(kThreads) bwd_postprocess_kernel(const __grid_constant__ BwdPostprocessParams p,
                                                                   int lanes) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / lanes) + threadIdx.x / lanes;
  if (row >= static_cast<int64_t>(p.batch) * p.heads * p.len_q) return;
  const int lane = threadIdx.x % lanes;
  const int i = static_cast<int>(row % p.len_q);
  const int64_t batch_head = row / p.len_q;
  const int64_t head = batch_head % p.heads, batch = batch_head / p.heads;
  char* const dq = static_cast<char*>(p.dq) + 2 * (batch * p.dq_batch_stride + head * p.dq_head_stride +
                                                   i * p.dq_row_stride);
  const float4* const accum = reinterpret_cast<const float4*>(p.dq_accum + row * p.head_dim);
  for (int c = lane; c < p.head_dim / 8; c += lanes) {
    const float4 lo = accum[2 * c], hi = accum[2 * c + 1];
    const float sums[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint4 out;
    T2* const pairs = reinterpret_cast<T2*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) pairs[j] = to_pair<T2>(p.scale * sums[2 * j], p.scale * sums[2 * j + 1]);
    *reinterpret_cast<uint4*>(dq + 16 * c) = out;
  }
}

}  // namespace

cudaError_t run_bwd_postprocess(const BwdPostprocessParams& params, bool is_bf16, cudaStream_t stream) {
  int lanes = 8;
  while (lanes < 32 && lanes * 8 < params.head_dim) lanes *= 2;
  const int64_t rows = static_cast<int64_t>(params.batch) * params.heads * params.len_q;
  if (rows == 0) return cudaSuccess;
  const int64_t rows_per_block = kThreads / lanes;
  const dim3 grid(static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block));
  if (is_bf16) {
    bwd_postprocess_kernel<__nv_bfloat162><<<grid, kThreads, 0, stream>>>(params, lanes);
  } else {
    bwd_postprocess_kernel<__half2><<<grid, kThreads, 0, stream>>>(params, lanes);
  }
  return cudaGetLastError();
}

}  // namespace flashattn
