// The decode path's last pass with several splits: each (batch, head, query) row's split parts merged by their lse,
// in a fixed order (deterministic, batch-invariant), the sink joining the denominator.
//
// CTA = one row, head_dim threads: thread (g, c) reads float4 column chunk c of the parts of splits g, g + 4, ...
// (kGroups groups), all before any is needed, so that the row costs one round trip to memory; warp 0 meanwhile forms
// the lse and the splits' weights. Each group adds its parts in split order, then the groups add in order g = 0 .. 3.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "cuda/decode.h"
#include "cuda/ptx_common.h"

namespace flashattn {
namespace {

constexpr int kGroups = 4;                                  // split groups of a row: head_dim / 4 threads each
constexpr int kPartsPerThread = kDecodeMaxSplits / kGroups;  // parts a thread holds in registers
constexpr int kSplitsPerLane = 2;                           // warp 0's lanes hold the splits' lse
constexpr int kMaxHeadDim = 256;
static_assert(kDecodeMaxSplits <= 32 * kSplitsPerLane && kDecodeMaxSplits % kGroups == 0, "the splits fit the groups");

template <typename T>
__global__ void __launch_bounds__(kMaxHeadDim)
    decode_combine_kernel(const __grid_constant__ FwdParams p, int head_dim) {
  __shared__ float weight[kDecodeMaxSplits];
  __shared__ float row_lse;
  __shared__ float4 group_sum[kGroups - 1][kMaxHeadDim / 4];

  const int64_t row = blockIdx.x;
  const int splits = p.plan.splits;
  const int chunks = head_dim / 4;  // float4 columns of a part
  const int chunk = threadIdx.x % chunks, group = threadIdx.x / chunks;

  float4 part[kPartsPerThread];
#pragma unroll
  for (int i = 0; i < kPartsPerThread; ++i) {
    const int s = group + kGroups * i;
    // Every split wrote its part (zeros where it saw no keys of the row): the read is in bounds and defined.
    part[i] = s < splits ? reinterpret_cast<const float4*>(p.split_out + decode_split_part(p, s, row) * head_dim)[chunk]
                         : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  const int query = static_cast<int>(row % p.len_q);
  const int head = static_cast<int>(row / p.len_q % p.heads);
  const int64_t batch = row / p.len_q / p.heads;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float part_lse[kSplitsPerLane];  // of splits lane, lane + 32 (-inf past the last split)
#pragma unroll
    for (int j = 0; j < kSplitsPerLane; ++j) {
      const int s = lane + 32 * j;
      part_lse[j] = s < splits ? p.split_lse[decode_split_part(p, s, row)] : -CUDART_INF_F;
    }
    // lse = log(sum_s exp(lse_s) + exp(sink)), against the largest term; a NaN part makes the row NaN (fmaxf would
    // pass over it).
    float top = -CUDART_INF_F;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < kSplitsPerLane; ++j) {
      top = fmaxf(top, part_lse[j]);
      nan |= part_lse[j] != part_lse[j];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, offset));
    nan = __any_sync(0xffffffff, nan);
    const bool sink = p.options && p.sinks != nullptr;
    const float sink_lse = sink ? p.sinks[head] : -CUDART_INF_F;
    top = fmaxf(top, sink_lse);
    float total = 0.f;
    if (top != -CUDART_INF_F) {
#pragma unroll
      for (int j = 0; j < kSplitsPerLane; ++j) total += expf(part_lse[j] - top);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffff, total, offset);
    if (top != -CUDART_INF_F && sink) total += expf(sink_lse - top);
    const float lse = nan ? CUDART_NAN_F : top == -CUDART_INF_F ? -CUDART_INF_F : top + logf(total);
    // A split's weight: 0 where it saw no keys of the row, NaN with a NaN lse.
#pragma unroll
    for (int j = 0; j < kSplitsPerLane; ++j) {
      const int s = lane + 32 * j;
      if (s < kDecodeMaxSplits) weight[s] = lse == -CUDART_INF_F ? 0.f : expf(part_lse[j] - lse);
    }
    if (lane == 0) row_lse = lse;
  }
  __syncthreads();

  // This group's splits in order; a split without keys of the row adds nothing (a NaN weight does).
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kPartsPerThread; ++i) {
    const int s = group + kGroups * i;
    const float w = s < splits ? weight[s] : 0.f;
    if (w != 0.f) {
      acc.x += w * part[i].x, acc.y += w * part[i].y, acc.z += w * part[i].z, acc.w += w * part[i].w;
    }
  }
  if (group > 0) group_sum[group - 1][chunk] = acc;
  __syncthreads();
  if (group > 0) return;
#pragma unroll
  for (int g = 0; g < kGroups - 1; ++g) {
    const float4 o = group_sum[g][chunk];
    acc.x += o.x, acc.y += o.y, acc.z += o.z, acc.w += o.w;
  }
  if (4 * chunk < p.head_dim) {
    T* const out = static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride +
                   static_cast<int64_t>(query) * p.o_row_stride + 4 * chunk;
    uint2 packed;
    packed.x = pack2<T>(acc.x, acc.y);
    packed.y = pack2<T>(acc.z, acc.w);
    *reinterpret_cast<uint2*>(out) = packed;
  }
  if (threadIdx.x == 0) p.lse[row] = row_lse;
}

}  // namespace

template <typename T>
cudaError_t run_decode_combine(const FwdParams& params, int head_dim, cudaStream_t stream) {
  if (head_dim % 32 != 0 || head_dim > kMaxHeadDim) return cudaErrorInvalidValue;  // whole warps, one a row
  const int64_t rows = decode_split_rows(params);
  decode_combine_kernel<T><<<static_cast<unsigned>(rows), head_dim, 0, stream>>>(params, head_dim);
  return cudaGetLastError();
}

template cudaError_t run_decode_combine<__half>(const FwdParams&, int, cudaStream_t);
template cudaError_t run_decode_combine<__nv_bfloat16>(const FwdParams&, int, cudaStream_t);

}  // namespace flashattn
