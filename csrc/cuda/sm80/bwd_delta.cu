// The backward's preprocessing: delta_i = rowsum(dO * O)_i - dlse_i for every query row, one warp per row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/launchers.h"

namespace flashattn::sm80 {
namespace {

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }

template <typename T2>
__global__ void bwd_delta_kernel(const __grid_constant__ BwdDeltaParams p) {
  constexpr int kWarpsPerBlock = 8;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(p.batch) * p.heads * p.len_q) return;
  const int i = static_cast<int>(row % p.len_q);
  const int64_t batch_head = row / p.len_q;
  const int head = static_cast<int>(batch_head % p.heads);
  const int batch = static_cast<int>(batch_head / p.heads);
  const T2* dout = reinterpret_cast<const T2*>(static_cast<const char*>(p.dout)) +
                   (batch * p.do_batch_stride + head * p.do_head_stride + i * p.do_row_stride) / 2;
  const T2* out = reinterpret_cast<const T2*>(static_cast<const char*>(p.out)) +
                  (batch * p.o_batch_stride + head * p.o_head_stride + i * p.o_row_stride) / 2;
  float sum = 0.f;
  // 16 bytes (4 pairs) per lane and step; head_dim is a multiple of 8 and rows are 16-byte aligned.
  for (int pair = lane * 4; pair < p.head_dim / 2; pair += 32 * 4) {
    const uint4 d_raw = *reinterpret_cast<const uint4*>(dout + pair);
    const uint4 o_raw = *reinterpret_cast<const uint4*>(out + pair);
    const T2* d2 = reinterpret_cast<const T2*>(&d_raw);
    const T2* o2 = reinterpret_cast<const T2*>(&o_raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 d = to_float2(d2[j]);
      const float2 o = to_float2(o2[j]);
      sum += d.x * o.x + d.y * o.y;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) p.delta[row] = p.dlse == nullptr ? sum : sum - p.dlse[row];
}

}  // namespace

cudaError_t run_bwd_delta(const BwdDeltaParams& params, bool is_bf16, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(params.batch) * params.heads * params.len_q;
  const dim3 grid(static_cast<unsigned>((rows + 7) / 8));
  if (is_bf16) {
    bwd_delta_kernel<__nv_bfloat162><<<grid, 256, 0, stream>>>(params);
  } else {
    bwd_delta_kernel<__half2><<<grid, 256, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

}  // namespace flashattn::sm80
