// Hopper backward, version 0 (issue 3): warp-specialised, TMA + wgmma, head dims 64 and 128 (256: see
// bwd_split_kernel.h). Off by default until it has passed the GPU suite: FLASHATTN_BWD_SM90=1 selects it on sm_90,
// =strict raises instead of falling back to the sm80 kernel (csrc/cuda/sm80/bwd_kernel.h; same params, same
// preprocessing and dQ conversion in flash_api.cpp).
//
// CTA = one block of kBlockN = 128 keys of one (batch, kv head); 3 warpgroups. Warpgroup 0 is the producer: one
// thread loads K and V once and then, for every query head of the kv head's group and every query block that sees
// these keys, Q and dO blocks of kBlockM = 64 rows into a 2-stage ring (TMA, 128-byte swizzle, zero fill past L and
// D). Warpgroups 1 and 2 each own 64 of the keys and work in the transposed frame, keys as the M dimension, so that
// P^T and dS^T come out of the accumulators in the layout of a register A operand:
//
//     S^T  = K Q^T,  dP^T = V dO^T                    (SS wgmma, both in flight together)
//     P^T  = exp2(S^T * scale_log2 - lse_log2)        (masked entries 0)
//     dS^T = P^T * (dP^T - delta)
//     dV  += P^T dO,  dK += dS^T Q                     (RS wgmma, Q and dO read transposed)
//     dQ   = dS K, per 64-column chunk, from dS^T in shared memory (A read M-major); fp32 atomics into dq_accum
//
// Each warpgroup adds the dQ of its own 64 keys (two atomics per element and CTA; version 1 shares dS between
// them). dK (times scale) and dV are complete in registers at the end: one writer per element, no atomics.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "cuda/params.h"
#include "cuda/sm80/ptx.h"  // pack2, fast_exp2
#include "cuda/sm90/bwd_common.h"
#include "cuda/sm90/bwd_split_kernel.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/tma.h"
#include "cuda/sm90/wgmma_ops.h"

namespace flashattn::sm90 {

template <int HeadDim>
struct BwdTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockN = 128;  // keys per CTA: two consumer warpgroups x 64
  static constexpr int kBlockM = 64;   // queries per step: the N of S^T = K Q^T, one 128-byte swizzle row of dS^T
  static constexpr int kStages = 2;
  static constexpr int kNThreads = 3 * 128;
  static constexpr int kColumnBlocks = HeadDim / 64;  // 64-column sub-tiles (one TMA box / swizzle atom wide)
  static constexpr int kTileKV = kBlockN * HeadDim;   // elements
  static constexpr int kSubTileKV = kBlockN * 64;
  static constexpr int kTileQ = kBlockM * HeadDim;  // a Q or dO stage
  static constexpr int kSubTileQ = kBlockM * 64;
  static constexpr int kTileDS = 64 * kBlockM;  // one consumer's dS^T: 64 keys x kBlockM queries
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  template <typename T>
  static constexpr int smem_bytes() {
    return (2 * kTileKV + 2 * kStages * kTileQ + 2 * kTileDS) * static_cast<int>(sizeof(T)) +
           2 * 2 * kBlockM * static_cast<int>(sizeof(float)) /* lse, delta per consumer */ + 1024 /* alignment */ +
           256 /* barriers */;
  }
  static_assert(HeadDim == 64 || HeadDim == 128, "the Hopper backward covers head dims 64 and 128");
  static_assert((kProducerRegs + 2 * kConsumerRegs) * 128 <= (65536 / kNThreads / 8) * 8 * kNThreads,
                "producer + consumer registers exceed the register file");
};

template <typename T, typename Traits>
struct BwdSharedStorage {
  T* k;                  // [kColumnBlocks][kBlockN][64], swizzled
  T* v;
  T* q;                  // [kStages][kColumnBlocks][kBlockM][64]
  T* dout;
  T* ds;                 // [2 consumers][64 keys][kBlockM queries], swizzled (written by the consumers)
  float* lse_log2;       // [2 consumers][kBlockM]
  float* delta;          // [2 consumers][kBlockM]
  uint64_t* kv_full;
  uint64_t* q_full;      // [kStages]
  uint64_t* do_full;
  uint64_t* q_empty;
  uint64_t* do_empty;

  __device__ explicit BwdSharedStorage(unsigned char* raw) {
    k = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    v = k + Traits::kTileKV;
    q = v + Traits::kTileKV;
    dout = q + Traits::kStages * Traits::kTileQ;
    ds = dout + Traits::kStages * Traits::kTileQ;
    lse_log2 = reinterpret_cast<float*>(ds + 2 * Traits::kTileDS);
    delta = lse_log2 + 2 * Traits::kBlockM;
    kv_full = reinterpret_cast<uint64_t*>(delta + 2 * Traits::kBlockM);
    q_full = kv_full + 1;
    do_full = q_full + Traits::kStages;
    q_empty = do_full + Traits::kStages;
    do_empty = q_empty + Traits::kStages;
  }
  __device__ T* q_stage(int stage) const { return q + stage * Traits::kTileQ; }
  __device__ T* dout_stage(int stage) const { return dout + stage * Traits::kTileQ; }
};

// acc (64 keys x D) += A block, A from registers (P^T or dS^T, k16 steps over the block's queries), block (Q or dO,
// queries x D) read transposed: the forward's O += P V.
template <typename T, typename Traits>
__device__ __forceinline__ void issue_transposed_times_block(float (&acc)[Traits::kHeadDim / 2],
                                                             uint32_t (&a)[Traits::kBlockM / 16][4], const T* block) {
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk) {
    Wgmma<T, Traits::kHeadDim>::template rs<true>(
        acc, a[kk], smem_desc_sw128(block + kk * 16 * 64, Traits::kSubTileQ * sizeof(T)), true);
  }
}

template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                          const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kColumnBlocks = Traits::kColumnBlocks;

  const KeyBlock<Traits, kCausal> block(p);
  const int n_start = block.n_start;
  const int causal_shift = p.len_k - p.len_q;

  extern __shared__ unsigned char smem_raw[];
  const BwdSharedStorage<T, Traits> smem(smem_raw);
  init_bwd_barriers<Traits>(smem);
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {  // ---------------------------------------------------------------------------- producer
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    run_bwd_producer<T>(smem, q_map, k_map, v_map, do_map, p, block);
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int consumer = warpgroup - 1;  // keys n_start + 64 * consumer ..
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int key0 = n_start + 64 * consumer + 16 * warp + lane / 4;  // + 8 for the thread's second row
  const T* const k_rows = smem.k + consumer * 64 * 64;  // this warpgroup's 64 rows inside each sub-tile
  const T* const v_rows = smem.v + consumer * 64 * 64;
  T* const ds_tile = smem.ds + consumer * Traits::kTileDS;
  float* const lse_log2 = smem.lse_log2 + consumer * kBlockM;
  float* const delta = smem.delta + consumer * kBlockM;
  const int barrier_id = 1 + consumer;  // this warpgroup's own named barrier (128 threads)
  constexpr float kLog2e = 1.4426950408889634f;

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;

  mbarrier_wait(smem.kv_full, 0);
  int step = 0;
  for (int g = 0; g < p.heads_per_kv; ++g) {
    const int head = block.kv_head * p.heads_per_kv + g;
    const int64_t row_base = (static_cast<int64_t>(block.batch) * p.heads + head) * p.len_q;  // lse, delta, dq_accum
    for (int m_block = block.m_begin; m_block < block.num_m_blocks; ++m_block, ++step) {
      const int stage = step % kStages;
      const uint32_t parity = (step / kStages) & 1;
      const int m_start = m_block * kBlockM;

      // The block's lse (log2 domain) and delta for this warpgroup. The barrier also orders the last step's reads
      // of these and of ds_tile (all before the previous dS barrier or wgmma wait) before this step's writes.
      // A row past the end or with lse = -inf (it sees no key) contributes nothing: exp2(x - inf) = 0, and its
      // delta is zeroed so that a non-finite dlse there cannot turn 0 * inf into NaN (the sm80 kernel's rule).
      {
        const int index = thread % kBlockM;
        const int row = m_start + index;
        const float row_lse = row < p.len_q ? p.lse[row_base + row] : -INFINITY;
        const bool contributes = row_lse != -INFINITY;
        if (thread < kBlockM) {
          lse_log2[index] = contributes ? row_lse * kLog2e : INFINITY;
        } else {
          delta[index] = contributes ? p.delta[row_base + row] : 0.f;
        }
      }
      named_barrier_sync(barrier_id, 128);

      float s[kBlockM / 2], dp[kBlockM / 2];
      mbarrier_wait(&smem.q_full[stage], parity);
      issue_rows_times_block<T, Traits>(s, k_rows, smem.q_stage(stage));
      mbarrier_wait(&smem.do_full[stage], parity);
      issue_rows_times_block<T, Traits>(dp, v_rows, smem.dout_stage(stage));

      // P^T while dP^T is still running. Masked: queries past Lq, keys past Lk, and (causal) key > query + shift.
      wgmma_wait<1>();
      wgmma_fence_registers(s);
      const bool needs_mask = m_start + kBlockM > p.len_q || n_start + kBlockN > p.len_k ||
                              (kCausal && n_start + kBlockN - 1 > m_start + causal_shift);
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = 8 * j + 2 * (lane % 4) + i % 2;
          const int key = key0 + 8 * (i / 2);
          const int query = m_start + col;
          const bool masked = needs_mask && (query >= p.len_q || key >= p.len_k ||
                                             (kCausal && key > query + causal_shift));
          const float x = sm80::fast_exp2(fmaf(s[4 * j + i], p.scale_log2, -lse_log2[col]));
          s[4 * j + i] = masked ? 0.f : x;
        }
      }

      wgmma_wait<0>();
      wgmma_fence_registers(dp);
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = 8 * j + 2 * (lane % 4) + i % 2;
          dp[4 * j + i] = s[4 * j + i] * (dp[4 * j + i] - delta[col]);  // dS^T
        }
      }

      // dS^T to shared memory for dQ = dS K, before the dV/dK GEMMs so that the fp32 dS^T is dead while they run
      // (the wgmma async proxy reads what the threads wrote: fence, then the warpgroup barrier below).
      uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
      pack_a<T, kBlockM>(p_frag, s);
      pack_a<T, kBlockM>(ds_frag, dp);
      store_swizzled_tile<T, kBlockM>(ds_tile, dp, warp, lane);
      fence_proxy_async_smem();

      // dV += P^T dO and dK += dS^T Q, one group.
      wgmma_fence_registers(dv);
      wgmma_fence_registers(dk);
      wgmma_fence_registers(p_frag);
      wgmma_fence_registers(ds_frag);
      wgmma_fence();
      issue_transposed_times_block<T, Traits>(dv, p_frag, smem.dout_stage(stage));
      issue_transposed_times_block<T, Traits>(dk, ds_frag, smem.q_stage(stage));
      wgmma_commit();
      named_barrier_sync(barrier_id, 128);  // every thread's part of dS^T is in shared memory

      // dQ, one 64-column chunk at a time (32 accumulators): M = queries, K = this warpgroup's 64 keys, A = dS^T
      // read M-major, B = the K rows read transposed (keys x 64 columns).
#pragma unroll
      for (int c = 0; c < kColumnBlocks; ++c) {
        float dq[32];
        wgmma_fence_registers(dq);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 64 / 16; ++kk) {
          Wgmma<T, 64>::template ss<true, true>(dq, smem_desc_sw128(ds_tile + kk * 16 * 64),
                                                smem_desc_sw128(k_rows + c * Traits::kSubTileKV + kk * 16 * 64),
                                                kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();  // the first chunk's wait also ends dV/dK: Q and dO of the stage are free
        wgmma_fence_registers(dq);
        if (c == 0) {
          wgmma_fence_registers(dv);
          wgmma_fence_registers(dk);
          wgmma_fence_registers(p_frag);  // read by the dV/dK wgmmas until here
          wgmma_fence_registers(ds_frag);
          mbarrier_arrive(&smem.q_empty[stage]);
          mbarrier_arrive(&smem.do_empty[stage]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int query = m_start + 16 * warp + lane / 4 + 8 * h;
          if (query >= p.len_q) continue;
          float* const dq_row = p.dq_accum + (row_base + query) * p.head_dim;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int col = 64 * c + 8 * j + 2 * (lane % 4);
            if (col < p.head_dim) {
              atomicAdd(reinterpret_cast<float2*>(dq_row + col),
                        make_float2(dq[4 * j + 2 * h] * p.scale, dq[4 * j + 2 * h + 1] * p.scale));
            }
          }
        }
      }
    }
  }

  // Epilogue: dK (times scale) and dV of this thread's two key rows, 4-byte stores (rows past Lk, columns past D
  // skipped). dk and dv are contiguous (B, Hk, Lk, D).
  const int64_t kv_row_base = (static_cast<int64_t>(block.batch) * p.heads_kv + block.kv_head) * p.len_k;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;
    if (key >= p.len_k) continue;
    T* const dk_row = static_cast<T*>(p.dk) + (kv_row_base + key) * p.head_dim;
    T* const dv_row = static_cast<T*>(p.dv) + (kv_row_base + key) * p.head_dim;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      if (col < p.head_dim) {
        *reinterpret_cast<uint32_t*>(dk_row + col) =
            sm80::pack2<T>(dk[4 * j + 2 * h] * p.scale, dk[4 * j + 2 * h + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(dv_row + col) = sm80::pack2<T>(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
      }
    }
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// Launches the Hopper backward on `stream` (delta computed and dq_accum zeroed by the caller): this file's kernel for
// head dims 64 and 128, bwd_split_kernel.h's for 256. Returns cudaErrorNotSupported, having launched nothing, when
// the driver cannot encode the tensor maps for these strides or grant the shared memory (the caller may then use
// another backward).
template <typename T, int HeadDim, bool kCausal>
cudaError_t run_bwd_sm90(const BwdParams& params, cudaStream_t stream) {
  using Traits = std::conditional_t<HeadDim == 256, BwdSplitTraits, BwdTraits<HeadDim == 256 ? 128 : HeadDim>>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  CUtensorMap q_map, k_map, v_map, do_map;
  const bool ok =
      make_bhld_map(&q_map, params.q, kBf16, params.batch, params.heads, params.len_q, params.head_dim,
                    params.q_batch_stride, params.q_head_stride, params.q_row_stride, Traits::kBlockM) &&
      make_bhld_map(&do_map, params.dout, kBf16, params.batch, params.heads, params.len_q, params.head_dim,
                    params.do_batch_stride, params.do_head_stride, params.do_row_stride, Traits::kBlockM) &&
      make_bhld_map(&k_map, params.k, kBf16, params.batch, params.heads_kv, params.len_k, params.head_dim,
                    params.k_batch_stride, params.k_head_stride, params.k_row_stride, Traits::kBlockN) &&
      make_bhld_map(&v_map, params.v, kBf16, params.batch, params.heads_kv, params.len_k, params.head_dim,
                    params.v_batch_stride, params.v_head_stride, params.v_row_stride, Traits::kBlockN);
  if (!ok) return cudaErrorNotSupported;
  constexpr auto kernel = [] {
    if constexpr (HeadDim == 256) {
      return flash_bwd_split_sm90_kernel<T, Traits, kCausal>;
    } else {
      return flash_bwd_sm90_kernel<T, Traits, kCausal>;
    }
  }();
  constexpr int kSmemBytes = Traits::template smem_bytes<T>();
  static_assert(kSmemBytes <= 227 * 1024, "the backward's tiles exceed the 227 KB of shared memory per block");
  if (!allow_dynamic_smem(kernel, kSmemBytes)) return cudaErrorNotSupported;
  const int64_t num_n_blocks = (params.len_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const dim3 grid(static_cast<unsigned>(num_n_blocks * params.heads_kv * params.batch));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(q_map, k_map, v_map, do_map, params);
  return cudaGetLastError();
}

}  // namespace flashattn::sm90
