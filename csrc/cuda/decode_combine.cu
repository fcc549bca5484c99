// The decode path's last pass with several splits: each (batch, head, query) row's split parts merged by their lse,
// in split order (deterministic), the sink joining the denominator.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "cuda/decode.h"
#include "cuda/ptx_common.h"

namespace flashattn {
namespace {

constexpr int kRowsPerBlock = 4;  // a warp per row
// Split parts read before any is added: their loads overlap, one round trip per kPartsInFlight splits instead of one
// per split (33 serial round trips took 20 us at B8 Hk8 32k).
constexpr int kPartsInFlight = 16;
constexpr int kSplitsPerLane = 2;  // lanes hold the splits' lse and weights
static_assert(kDecodeMaxSplits <= 32 * kSplitsPerLane, "a lse per split in the warp's registers");

template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    decode_combine_kernel(const __grid_constant__ FwdParams p, int head_dim) {
  const int64_t rows = decode_split_rows(p);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // whole warps: the shuffles below see every lane
  const int lane = threadIdx.x % 32;
  const int splits = p.plan.splits;
  const int query = static_cast<int>(row % p.len_q);
  const int head = static_cast<int>(row / p.len_q % p.heads);
  const int64_t batch = row / p.len_q / p.heads;

  // Lane l holds the lse of splits l, l + 32, ... (-inf past the last split).
  float part_lse[kSplitsPerLane];
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
  float weight[kSplitsPerLane];  // of split lane + 32 j: 0 for a split without keys of this row, NaN with a NaN lse
#pragma unroll
  for (int j = 0; j < kSplitsPerLane; ++j) weight[j] = lse == -CUDART_INF_F ? 0.f : expf(part_lse[j] - lse);

  T* const out = static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride +
                 static_cast<int64_t>(query) * p.o_row_stride;
  for (int c = 4 * lane; c < p.head_dim; c += 4 * 32) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += kPartsInFlight) {
      float w[kPartsInFlight];
      float4 o[kPartsInFlight];
#pragma unroll
      for (int i = 0; i < kPartsInFlight; ++i) {
        const int s = s0 + i;  // the same for every lane
        w[i] = __shfl_sync(0xffffffff, s < 32 ? weight[0] : weight[1], s % 32);
        // Every split wrote its part (zeros where it saw no keys of the row), so the read is in bounds and defined.
        o[i] = s < splits ? *reinterpret_cast<const float4*>(p.split_out + decode_split_part(p, s, row) * head_dim + c)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      // Added in split order; a split without keys of this row adds nothing (NaN weights do).
#pragma unroll
      for (int i = 0; i < kPartsInFlight; ++i) {
        if (s0 + i < splits && w[i] != 0.f) {
          acc.x += w[i] * o[i].x, acc.y += w[i] * o[i].y, acc.z += w[i] * o[i].z, acc.w += w[i] * o[i].w;
        }
      }
    }
    uint2 packed;
    packed.x = pack2<T>(acc.x, acc.y);
    packed.y = pack2<T>(acc.z, acc.w);
    *reinterpret_cast<uint2*>(out + c) = packed;
  }
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace

template <typename T>
cudaError_t run_decode_combine(const FwdParams& params, int head_dim, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(params.batch) * params.heads * params.len_q;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  decode_combine_kernel<T><<<static_cast<unsigned>(blocks), kRowsPerBlock * 32, 0, stream>>>(params, head_dim);
  return cudaGetLastError();
}

template cudaError_t run_decode_combine<__half>(const FwdParams&, int, cudaStream_t);
template cudaError_t run_decode_combine<__nv_bfloat16>(const FwdParams&, int, cudaStream_t);

}  // namespace flashattn
