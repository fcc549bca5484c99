// The last pass of a KV cache's key splits where each split had its own CTA (the decode path's, and the Hopper
// forward's query chunks): each (batch, head, query) row's split parts folded in split order (row_epilogue.h:
// SplitFold, the arithmetic of a CTA that runs the splits in turn), the sink joining the denominator: deterministic,
// batch-invariant, and the same bits either way.
//
// CTA = one row, head_dim threads: thread (g, c) reads float4 column chunk c of the parts of splits g, g + 4, ...
// (kGroups groups), all before any is needed, so that the row costs one round trip to memory, and stores them to
// shared memory. Warp 0 forms every split's factors at once (the running maxima by a scan); then the first group's
// threads fold their chunk of every split in order, where only the sums wait on the split before.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "cuda/decode.h"
#include "cuda/launchers.h"
#include "cuda/ptx_common.h"
#include "cuda/row_epilogue.h"

namespace flashattn {
namespace {

constexpr int kGroups = 4;                                  // split groups of a row: head_dim / 4 threads each
constexpr int kPartsPerThread = kDecodeMaxSplits / kGroups;  // parts a thread holds in registers
constexpr int kSplitsPerLane = 2;                           // warp 0's lanes: splits lane, lane + 32
constexpr int kMaxHeadDim = 256;
static_assert(kDecodeMaxSplits == 32 * kSplitsPerLane && kDecodeMaxSplits % kGroups == 0, "the splits fit");

// Dynamic shared memory of a row: every split's part (float4 chunks).
inline int combine_smem_bytes(int splits, int head_dim) { return splits * head_dim * static_cast<int>(sizeof(float)); }

template <typename T>
__global__ void __launch_bounds__(kMaxHeadDim)
    decode_combine_kernel(const __grid_constant__ FwdParams p, int head_dim) {
  extern __shared__ float4 parts[];                 // [split][chunk]
  // The splits that saw keys of the row, in order: their index and factors (alpha, beta); how many; the maximum.
  __shared__ int taken[kDecodeMaxSplits];
  __shared__ float2 factors[kDecodeMaxSplits];
  __shared__ int num_taken;
  __shared__ float row_max;

  wait_for_primary();  // launched as a dependent of the splits' grid: every part is written past this
  const int64_t row = blockIdx.x;
  const int splits = p.plan.splits;
  const int chunks = head_dim / 4;  // float4 columns of a part
  const int chunk = threadIdx.x % chunks, group = threadIdx.x / chunks;

  float4 part[kPartsPerThread];
#pragma unroll
  for (int i = 0; i < kPartsPerThread; ++i) {
    const int s = group + kGroups * i;
    // Every split wrote its part (zeros where it saw no keys of the row): the read is in bounds and defined.
    if (s < splits) {
      part[i] = reinterpret_cast<const float4*>(p.split_out + decode_split_part(p, s, row) * head_dim)[chunk];
    }
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float lse[kSplitsPerLane], m[kSplitsPerLane];  // of splits lane, lane + 32 (-inf past the last split)
#pragma unroll
    for (int j = 0; j < kSplitsPerLane; ++j) {
      const int s = lane + 32 * j;
      lse[j] = s < splits ? p.split_lse[decode_split_part(p, s, row)] : -CUDART_INF_F;
      m[j] = fmaxf(-CUDART_INF_F, lse[j]);  // a NaN part leaves the maximum where it was, as in fold_part
    }
    // The running maxima (inclusive), as the fold forms them one split after another.
#pragma unroll
    for (int j = 0; j < kSplitsPerLane; ++j) {
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const float before = __shfl_up_sync(0xffffffff, m[j], offset);
        if (lane >= offset) m[j] = fmaxf(m[j], before);
      }
    }
    const float first_half = __shfl_sync(0xffffffff, m[0], 31);
    m[1] = fmaxf(m[1], first_half);
    float m_prev[kSplitsPerLane];  // the maxima before each split (every lane shuffles, lane 0 then takes its own)
    m_prev[0] = __shfl_up_sync(0xffffffff, m[0], 1);
    m_prev[1] = __shfl_up_sync(0xffffffff, m[1], 1);
    if (lane == 0) m_prev[0] = -CUDART_INF_F, m_prev[1] = first_half;
    int before = 0;  // splits taken before this half
#pragma unroll
    for (int j = 0; j < kSplitsPerLane; ++j) {
      const bool take = lse[j] != -CUDART_INF_F;
      const unsigned half = __ballot_sync(0xffffffff, take);
      if (take) {
        const int slot = before + __popc(half & ((1u << lane) - 1));
        float alpha, beta;
        fold_factors(m_prev[j], m[j], lse[j], alpha, beta);
        taken[slot] = lane + 32 * j;
        factors[slot] = make_float2(alpha, beta);
      }
      before += __popc(half);
    }
    if (lane == 31) row_max = m[1];
    if (lane == 0) num_taken = before;
  }
#pragma unroll
  for (int i = 0; i < kPartsPerThread; ++i) {
    const int s = group + kGroups * i;
    if (s < splits) parts[s * chunks + chunk] = part[i];
  }
  __syncthreads();
  if (group > 0) return;

  // The taken splits in order, without a branch between them, so that their loads run ahead of the sums.
  SplitFold fold{row_max, 0.f};
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int count = num_taken;
#pragma unroll 8
  for (int i = 0; i < count; ++i) {
    const float2 f = factors[i];
    const float4 o = parts[taken[i] * chunks + chunk];
    fold.sum = fmaf(fold.sum, f.x, f.y);
    acc = fold_add(acc, f.x, o, f.y);
  }
  const int query = static_cast<int>(row % p.len_q);
  const int head = static_cast<int>(row / p.len_q % p.heads);
  const int64_t batch = row / p.len_q / p.heads;
  const int len_k = entry_keys(p, static_cast<int>(batch)).len;  // from the left padding, as the kernel
  const bool sees_keys = row_sees_band(query, len_k - p.len_q, p.window_left, p.window_right, len_k);
  float lse;
  const float scale =
      fold_finish(fold, p.options && p.sinks != nullptr ? p.sinks[head] : -CUDART_INF_F, sees_keys, lse);
  if (4 * chunk < p.head_dim) {
    T* const out = static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride +
                   static_cast<int64_t>(query) * p.o_row_stride + 4 * chunk;
    uint2 packed;
    packed.x = pack2<T>(acc.x * scale, acc.y * scale);
    packed.y = pack2<T>(acc.z * scale, acc.w * scale);
    *reinterpret_cast<uint2*>(out) = packed;
  }
  if (threadIdx.x == 0) p.lse[row] = lse;
}

}  // namespace

template <typename T>
cudaError_t run_decode_combine(const FwdParams& params, int head_dim, cudaStream_t stream) {
  if (head_dim % 32 != 0 || head_dim > kMaxHeadDim) return cudaErrorInvalidValue;  // whole warps, one a row
  const int64_t rows = decode_split_rows(params);
  const int smem = combine_smem_bytes(params.plan.splits, head_dim);
  // Past 48 KB with the kernel's own shared arrays, the launch needs the larger limit.
  constexpr int kStaticBytes = kDecodeMaxSplits * static_cast<int>(sizeof(int) + sizeof(float2)) + 16;
  if (smem + kStaticBytes > 48 * 1024) {
    const int bytes = combine_smem_bytes(kDecodeMaxSplits, kMaxHeadDim);
    if (const cudaError_t err = allow_dynamic_smem(decode_combine_kernel<T>, bytes); err != cudaSuccess) return err;
  }
  // A programmatic dependent of the kernel before it (sm90+): where that grid allows it (the decode kernel does, at its
  // start), the CTAs start while its last ones run, and wait for its parts. ~0.9 us a call at batch 1 (H100).
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(rows));
  config.blockDim = dim3(head_dim);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  int device = 0, major = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (const cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      err != cudaSuccess) {
    return err;
  }
  config.attrs = &dependent;
  config.numAttrs = major >= 9 ? 1 : 0;
  return cudaLaunchKernelEx(&config, decode_combine_kernel<T>, params, head_dim);
}

template cudaError_t run_decode_combine<__half>(const FwdParams&, int, cudaStream_t);
template cudaError_t run_decode_combine<__nv_bfloat16>(const FwdParams&, int, cudaStream_t);

}  // namespace flashattn
