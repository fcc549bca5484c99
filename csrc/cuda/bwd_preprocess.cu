// The backward's preprocessing, one pass over the query rows for every fused backward (sm80 and Hopper):
// delta_i = rowsum(dO * O)_i - dlse_i, and row i of dq_accum zeroed for the kernels' additions (block 0 also zeroes
// the Hopper kernel's tile counter).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/launchers.h"

namespace flashattn {
namespace {

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }

constexpr int kThreads = 256;

// A row is a group of `lanes` lanes (a power of two, up to 32), each owning 16-byte chunks (8 elements) of dO and O
// and the matching 32 bytes of dq_accum: every lane of a warp is busy at head dims 64 and 128 too.
template <typename T2>
__global__ void __launch_bounds__(kThreads) bwd_preprocess_kernel(const __grid_constant__ BwdPreprocessParams p,
                                                                  int lanes) {
  if (p.tile_counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.tile_counter = 0;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / lanes) + threadIdx.x / lanes;
  const int lane = threadIdx.x % lanes;
  const bool in_range = row < static_cast<int64_t>(p.batch) * p.heads * p.len_q;
  const int chunks = p.head_dim / 8;  // head_dim is a multiple of 8 and rows are 16-byte aligned
  float sum = 0.f;
  if (in_range) {  // out-of-range lanes still take part in the shuffles below
    const int i = static_cast<int>(row % p.len_q);
    const int64_t batch_head = row / p.len_q;
    const int64_t head = batch_head % p.heads, batch = batch_head / p.heads;
    const char* const dout = static_cast<const char*>(p.dout) +
                             2 * (batch * p.do_batch_stride + head * p.do_head_stride + i * p.do_row_stride);
    const char* const out = static_cast<const char*>(p.out) +
                            2 * (batch * p.o_batch_stride + head * p.o_head_stride + i * p.o_row_stride);
    float4* const dq_row = reinterpret_cast<float4*>(p.dq_accum + row * p.head_dim);
    for (int c = lane; c < chunks; c += lanes) {
      const uint4 d_raw = *reinterpret_cast<const uint4*>(dout + 16 * c);
      const uint4 o_raw = *reinterpret_cast<const uint4*>(out + 16 * c);
      const T2* const d2 = reinterpret_cast<const T2*>(&d_raw);
      const T2* const o2 = reinterpret_cast<const T2*>(&o_raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 d = to_float2(d2[j]);
        const float2 o = to_float2(o2[j]);
        sum += d.x * o.x + d.y * o.y;
      }
      if (p.dq_accum != nullptr) dq_row[2 * c] = dq_row[2 * c + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  for (int offset = lanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (in_range && lane == 0) p.delta[row] = p.dlse == nullptr ? sum : sum - p.dlse[row];
}

}  // namespace

cudaError_t run_bwd_preprocess(const BwdPreprocessParams& params, bool is_bf16, cudaStream_t stream) {
  int lanes = 8;
  while (lanes < 32 && lanes * 8 < params.head_dim) lanes *= 2;
  const int64_t rows = static_cast<int64_t>(params.batch) * params.heads * params.len_q;
  if (rows == 0) {
    return params.tile_counter != nullptr ? cudaMemsetAsync(params.tile_counter, 0, sizeof(int), stream) : cudaSuccess;
  }
  const int64_t rows_per_block = kThreads / lanes;
  const dim3 grid(static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block));
  if (is_bf16) {
    bwd_preprocess_kernel<__nv_bfloat162><<<grid, kThreads, 0, stream>>>(params, lanes);
  } else {
    bwd_preprocess_kernel<__half2><<<grid, kThreads, 0, stream>>>(params, lanes);
  }
  return cudaGetLastError();
}

}  // namespace flashattn
