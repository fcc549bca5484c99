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

template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    decode_combine_kernel(const __grid_constant__ FwdParams p, int head_dim) {
  const int64_t rows = decode_split_rows(p);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int splits = p.plan.splits;
  const int query = static_cast<int>(row % p.len_q);
  const int head = static_cast<int>(row / p.len_q % p.heads);
  const int64_t batch = row / p.len_q / p.heads;

  // lse = log(sum_s exp(lse_s) + exp(sink)), against the largest term; a NaN part makes the row NaN (fmaxf would
  // pass over it).
  float top = -CUDART_INF_F;
  bool nan = false;
  for (int s = lane; s < splits; s += 32) {
    const float part = p.split_lse[decode_split_part(p, s, row)];
    top = fmaxf(top, part);
    nan |= part != part;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, offset));
  nan = __any_sync(0xffffffff, nan);
  const bool sink = p.options && p.sinks != nullptr;
  const float sink_lse = sink ? p.sinks[head] : -CUDART_INF_F;
  top = fmaxf(top, sink_lse);
  float total = 0.f;
  if (top != -CUDART_INF_F) {
    for (int s = lane; s < splits; s += 32) total += expf(p.split_lse[decode_split_part(p, s, row)] - top);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffff, total, offset);
  if (top != -CUDART_INF_F && sink) total += expf(sink_lse - top);
  const float lse = nan ? CUDART_NAN_F : top == -CUDART_INF_F ? -CUDART_INF_F : top + logf(total);

  T* const out = static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride +
                 static_cast<int64_t>(query) * p.o_row_stride;
  for (int c = 4 * lane; c < p.head_dim; c += 4 * 32) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < splits; ++s) {
      const float part_lse = p.split_lse[decode_split_part(p, s, row)];
      const float w = lse == -CUDART_INF_F ? 0.f : expf(part_lse - lse);  // NaN with a NaN lse
      if (w != 0.f) {  // a split without keys of this row adds nothing (NaN weights do)
        const float4 o = *reinterpret_cast<const float4*>(p.split_out + decode_split_part(p, s, row) * head_dim + c);
        acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
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
