// Hopper backward for head dim 256 (the kernel for 64 and 128 is bwd_kernel.h's). At D = 256 one warpgroup cannot
// hold dK and dV of 64 keys (256 registers per thread), so the two consumer warpgroups split the work by role and by
// half of the head dim:
//
//     warpgroup 1: S^T = K Q^T (64 keys x 64 queries, all 256 columns), P^T -> shared memory (bf16/fp16)
//     warpgroup 2: dP^T = V dO^T, then dS^T = P^T (dP^T - delta) with P^T passed in fp32 -> shared memory
//     both, for their half h of the columns: dV[:, h] += P^T dO[:, h] (issued once P^T is stored, under dS^T),
//     then dQ[:, h] = dS K[:, h] (dS^T read M-major) and dK[:, h] += dS^T Q[:, h]; A operands from shared memory.
//
// CTA = 64 keys of one (batch, kv head); the producer warpgroup loads K and V once, then Q blocks of 64 rows into a
// 2-stage ring and dO blocks into one buffer (the dQ tiles take the second's room). Each warpgroup's dQ half goes to
// dq_accum as bwd_kernel.h's does: registers -> a swizzled fp32 tile of 64 columns in shared memory, added by the
// warpgroup's dQ writer warp's TMA reduce-add (fp32 atomics from the registers held the kernel at two thirds of its
// speed). A step's second tile waits in registers until the next step's first GEMM is in flight, while the writer
// reads the first. With p.dq_semaphore the writers add in key-block order (deterministic), as in bwd_kernel.h. Three
// 256-thread named barriers per step: step start (lse/delta staged, the previous step's tiles free), P^T ready, dS^T
// ready. 226 KB of shared memory.
//
// The options variant (kOptions) walks only the query blocks of a sliding window's band and masks its edges. Its
// softcap kernel (kSoftcap, a kernel of its own, as in bwd_kernel.h) has warpgroup 1 form t = tanh(scale * S^T /
// softcap), P^T = exp2(softcap * t * log2 e - lse), and pass P^T (1 - t^2) as the fp32 P^T, so that warpgroup 2's
// dS^T = P^T (dP^T - delta) (1 - t^2) needs nothing more.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "cuda/params.h"
#include "cuda/ptx_common.h"
#include "cuda/sm90/bwd_common.h"
#include "cuda/sm90/mask.h"
#include "cuda/sm90/named_barrier.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/tma.h"
#include "cuda/sm90/wgmma_ops.h"

namespace flashattn::sm90 {

struct BwdSplitTraits {
  static constexpr int kHeadDim = 256;
  static constexpr int kHalf = 128;    // columns of dK, dV and dQ per consumer warpgroup
  static constexpr int kBlockN = bwd_tile_shape(kHeadDim, true).block_n;  // keys per CTA: the M of every GEMM but dQ
  static constexpr int kBlockM = bwd_tile_shape(kHeadDim, true).block_m;  // queries per step
  static constexpr int kStages = 2;    // Q buffers
  static constexpr int kStagesDo = 1;  // dO buffers
  static constexpr int kNThreads = 3 * 128;
  static constexpr int kColumnBlocks = kHeadDim / 64;
  static constexpr int kTileKV = kBlockN * kHeadDim;  // elements
  static constexpr int kSubTileKV = kBlockN * 64;
  static constexpr int kTileQ = kBlockM * kHeadDim;   // a Q or dO buffer
  static constexpr int kSubTileQ = kBlockM * 64;
  static constexpr int kTileP = kBlockN * kBlockM;    // P^T or dS^T: 64 keys x 64 queries
  static constexpr int kDqRows = 64;
  static constexpr int kTileDQ = kDqRows * 64;  // one consumer's dQ tile, fp32: two TMA boxes of 64 x 32
  // Consumer c's dQ tiles (the writer's side): the step's 64 queries, columns 64 (2 c + part) .. of its half.
  static constexpr int kDqParts = kHalf / 64;  // a step's dQ tiles per consumer
  __host__ __device__ static constexpr int dq_query_block(int /*consumer*/) { return 0; }
  __host__ __device__ static constexpr int dq_column_block(int consumer, int part) {
    return kDqParts * consumer + part;
  }
  static constexpr int kProducerRegs = 24;  // the loader thread and the dQ writer warps
  static constexpr int kConsumerRegs = 240;
  template <typename T>
  static constexpr int smem_bytes() {
    return (2 * kTileDQ + kTileP /* P^T in fp32 */ + 2 * kBlockM /* lse, delta */) * static_cast<int>(sizeof(float)) +
           (2 * kTileKV + (kStages + kStagesDo) * kTileQ + 2 * kTileP) * static_cast<int>(sizeof(T)) +
           1024 /* alignment */ + 256 /* barriers */;
  }
  // One warpgroup covers the CTA's keys (wgmma M = 64), a step's queries fill one 128-byte swizzle row of the P^T
  // and dS^T tiles and are the 64 rows of a dQ tile, and the two warpgroups split the columns in halves.
  static_assert(kBlockN == 64 && kBlockM == 64 && 2 * kHalf == kHeadDim, "the split backward's fixed shape");
  static_assert((kProducerRegs + 2 * kConsumerRegs) * 128 <= (65536 / kNThreads / 8) * 8 * kNThreads,
                "producer + consumer registers exceed the register file");
};

template <typename T, typename Traits>
struct BwdSplitSharedStorage {
  float* dq;  // [2 consumers][2 boxes][64 rows][32 columns], swizzled: the TMA reduction's source
  T* k;       // [kColumnBlocks][kBlockN][64], swizzled
  T* v;
  T* q;       // [kStages][kColumnBlocks][kBlockM][64]
  T* dout;    // [kStagesDo][kColumnBlocks][kBlockM][64]
  T* p;       // P^T [kBlockN][kBlockM], swizzled
  T* ds;      // dS^T, likewise
  float* p_exact;   // [kBlockM / 2][128]: consumer 0's fp32 P^T, slot i of thread t at i * 128 + t (the two
                    // warpgroups hold the same accumulator positions, so consumer 1's thread t reads its own)
  float* lse_log2;  // [kBlockM]
  float* delta;
  uint64_t* kv_full;
  uint64_t* kv_empty;  // unused: one key block per CTA
  uint64_t* q_full;    // [kStages]
  uint64_t* do_full;  // [kStagesDo]
  uint64_t* q_empty;
  uint64_t* do_empty;

  __device__ explicit BwdSplitSharedStorage(unsigned char* raw) {
    dq = reinterpret_cast<float*>(align_smem<1024>(raw));
    k = reinterpret_cast<T*>(dq + 2 * Traits::kTileDQ);
    v = k + Traits::kTileKV;
    q = v + Traits::kTileKV;
    dout = q + Traits::kStages * Traits::kTileQ;
    p = dout + Traits::kStagesDo * Traits::kTileQ;
    ds = p + Traits::kTileP;
    p_exact = reinterpret_cast<float*>(ds + Traits::kTileP);
    lse_log2 = p_exact + Traits::kTileP;
    delta = lse_log2 + Traits::kBlockM;
    kv_full = reinterpret_cast<uint64_t*>(delta + Traits::kBlockM);
    kv_empty = kv_full + 1;
    q_full = kv_empty + 1;
    do_full = q_full + Traits::kStages;
    q_empty = do_full + Traits::kStagesDo;
    do_empty = q_empty + Traits::kStages;
  }
  __device__ T* q_stage(int stage) const { return q + stage * Traits::kTileQ; }
  __device__ T* dout_stage(int stage) const { return dout + stage * Traits::kTileQ; }
};

// acc (64 keys x 128 columns of half h) += A block[:, h]: A = P^T or dS^T from shared memory (K-major: queries
// along the row), block = dO or Q read transposed, starting at its 64-column sub-tile 2 h.
template <typename T, typename Traits>
__device__ __forceinline__ void issue_tile_times_half(float (&acc)[Traits::kHalf / 2], const T* tile,
                                                      const T* block_half) {
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk) {
    Wgmma<T, Traits::kHalf>::template ss<true>(
        acc, smem_desc_sw128(tile + kk * 16),
        smem_desc_sw128(block_half + kk * 16 * 64, Traits::kSubTileQ * sizeof(T)), true);
  }
}

// This warpgroup's dK (times scale) and dV, kCols columns of the 64 keys, leave through the K and V tiles (free once
// both consumer warpgroups' GEMMs have ended: `barrier`, 256 threads), staged at `offset` elements into each, then as
// whole lines (store_key_rows) by both warpgroups.
template <typename T, typename Traits, int kCols, typename Block, typename Storage>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, const Block& block, const Storage& smem, int offset,
                                            int barrier, const float (&dk)[kCols / 2], const float (&dv)[kCols / 2],
                                            int warp, int lane) {
  named_barrier_sync(barrier, 256);
  store_swizzled_tile<T, kCols, Traits::kSubTileKV>(smem.k + offset, dk, warp, lane, p.scale);
  store_swizzled_tile<T, kCols, Traits::kSubTileKV>(smem.v + offset, dv, warp, lane);
  named_barrier_sync(barrier, 256);
  constexpr int kRows = Traits::kBlockN;
  store_key_rows<T, Traits::kHeadDim, kRows, 256, Traits::kSubTileKV>(p, block, smem.k, false, 0, threadIdx.x - 128);
  store_key_rows<T, Traits::kHeadDim, kRows, 256, Traits::kSubTileKV>(p, block, smem.v, true, 0, threadIdx.x - 128);
}

template <typename T, typename Traits, bool kCausal, bool kOptions, bool kSequences, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_split_sm90_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                                const __grid_constant__ CUtensorMap dq_map, const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHalf = Traits::kHalf;
  static_assert(kOptions || !kSoftcap, "softcap is an option");

  using Block = KeyBlock<Traits, kCausal, kOptions, kSequences>;
  const Block block(p, static_cast<int>(blockIdx.x));
  const int n_start = block.n_start;
  const int causal_shift = block.len_k(p) - block.len_q(p);

  extern __shared__ unsigned char smem_raw[];
  const BwdSplitSharedStorage<T, Traits> smem(smem_raw);
  init_bwd_barriers<Traits>(smem);
  __syncthreads();

  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (warpgroup == 0) {  // ------------------------------------------------------------------- producer, dQ writer
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x == 0) run_bwd_producer<T, Traits>(smem, q_map, k_map, v_map, do_map, p, block, 0, 0);
    const int warp = threadIdx.x / 32;
    if (warp == 1 || warp == 2) {
      run_dq_writer<Traits>(smem, dq_map, p, block, warp - 1, threadIdx.x % 32);
      if (threadIdx.x % 32 == 0) bulk_wait_group<0>();  // the reductions end before the CTA's shared memory goes
    }
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int consumer = warpgroup - 1;  // 0: S^T and P^T; 1: dP^T and dS^T; both: columns kHalf * consumer ..
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int key0 = n_start + 16 * warp + lane / 4;  // + 8 for the thread's second row
  float* const dq_tile = smem.dq + consumer * Traits::kTileDQ;

  float dk[kHalf / 2], dv[kHalf / 2];
#pragma unroll
  for (int i = 0; i < kHalf / 2; ++i) dk[i] = dv[i] = 0.f;

  // lse (log2 domain, consumer 0) and delta (consumer 1) of a step's rows (RowStats), loaded a step ahead (thread
  // t < kBlockM: row t) and staged in shared memory at the step's start.
  const int num_steps = block.num_steps(p);
  RowStats stats;
  const auto load_stats = [&](int step) {
    stats.load(p, block.row_base(step, p), block.m_start(step) + thread, block.len_q(p), consumer == 1);
  };
  // A band or an idle slot can leave a key block without steps.
  if (thread < kBlockM && (!(kOptions || kSequences) || num_steps > 0)) load_stats(0);

  // A step's dQ half leaves in two tiles of 64 columns through this warpgroup's one buffer: the first once computed,
  // the second (dq_late) under the next step's first GEMM, while the writer reads the first.
  const auto store_dq_tile = [&](const auto& tile, bool first) {  // its first 64 columns
    if (!first) named_barrier_sync(BwdBarrier::dq_empty(consumer), BwdBarrier::kWriterThreads);  // the last was read
    store_swizzled_fp32_tile(dq_tile, tile, warp, lane);
    fence_proxy_async_smem();
    named_barrier_arrive(BwdBarrier::dq_full(consumer), BwdBarrier::kWriterThreads);
  };
  float dq_late[32];

  mbarrier_wait(smem.kv_full, 0);
  for (int step = 0; step < num_steps; ++step) {
    const int m_start = block.m_start(step);
    const int stage = step % Traits::kStages, do_stage = step % Traits::kStagesDo;
    const uint32_t parity = (step / Traits::kStages) & 1, do_parity = (step / Traits::kStagesDo) & 1;

    // The barrier publishes the statistics and ends every read of the previous step's lse, delta, P^T and dS^T
    // tiles (each warpgroup waited for its wgmmas before arriving).
    if (thread < kBlockM) {
      if (consumer == 0) {
        smem.lse_log2[thread] = stats.lse_log2();
      } else {
        smem.delta[thread] = stats.delta_or_zero();
      }
      if (step + 1 < num_steps) load_stats(step + 1);
    }
    named_barrier_sync(BwdSplitBarrier::kStepStart, 256);

    float acc[kBlockM / 2];  // consumer 0: S^T then P^T; consumer 1: dP^T then dS^T
    if (consumer == 0) {
      mbarrier_wait(&smem.q_full[stage], parity);
      issue_rows_times_block<T, Traits>(acc, smem.k, smem.q_stage(stage));
      if (step > 0) store_dq_tile(dq_late, false);
      wgmma_wait<0>();
      wgmma_fence_registers(acc);
      if constexpr (kOptions) {
        // Masked: queries past Lq, keys past Lk, and outside the band; only blocks at an edge test them, in a copy of
        // the loop of their own, each entry against its key's visible columns (mask.h: band_query_cols).
        const int len_q = block.len_q(p), len_k = block.len_k(p);
        const int left = Block::left(p), right = Block::right(p);
        const bool needs_mask =
            band_step_edges<kBlockM, kBlockN>(m_start, n_start, causal_shift, left, right, len_q, len_k) != 0;
        const float cap_scale = kSoftcap ? p.scale / p.softcap : 0.f;
        const float exp_scale = kSoftcap ? p.softcap * 1.4426950408889634f : p.scale_log2;
        const auto probabilities = [&](auto masked) {
          int first[2], last[2];
          if constexpr (decltype(masked)::value) {
            band_query_cols(key0, m_start + 2 * (lane % 4), left, right, len_q, len_k, first, last);
          }
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int col = 8 * j + 2 * (lane % 4) + i % 2;
              const float t = kSoftcap ? fast_tanh(acc[4 * j + i] * cap_scale) : acc[4 * j + i];
              float prob = fast_exp2(fmaf(t, exp_scale, -smem.lse_log2[col]));
              if constexpr (decltype(masked)::value) {
                if (8 * j + i % 2 < first[i / 2] || 8 * j + i % 2 > last[i / 2]) prob = 0.f;
              }
              acc[4 * j + i] = prob;
              smem.p_exact[(4 * j + i) * 128 + thread] = kSoftcap ? prob * (1.f - t * t) : prob;  // dS from fp32 P
            }
          }
        };
        if (needs_mask) {
          probabilities(std::true_type{});
        } else {
          probabilities(std::false_type{});
        }
        store_swizzled_tile<T, kBlockM>(smem.p, acc, warp, lane);  // the A operand of dV += P^T dO
      } else {
        ColumnPairs<kBlockM> lse_log2;
        lse_log2.load(smem.lse_log2, lane);
        masked_probabilities<kCausal, kBlockM, kBlockN>(acc, lse_log2, p.scale_log2, block.len_q(p),
                                                        block.len_k(p), m_start, n_start, causal_shift, key0, lane);
        store_swizzled_tile<T, kBlockM>(smem.p, acc, warp, lane);  // the A operand of dV += P^T dO
#pragma unroll
        for (int i = 0; i < kBlockM / 2; ++i) smem.p_exact[i * 128 + thread] = acc[i];  // dS from fp32 P
      }
      fence_proxy_async_smem();
    } else {
      mbarrier_wait(&smem.do_full[do_stage], do_parity);
      issue_rows_times_block<T, Traits>(acc, smem.v, smem.dout_stage(do_stage));
      if (step > 0) store_dq_tile(dq_late, false);
      wgmma_wait<0>();
      wgmma_fence_registers(acc);
    }
    named_barrier_sync(BwdSplitBarrier::kPReady, 256);

    // Both, for this warpgroup's half of the columns: dV while consumer 1 forms dS^T, then dQ, then dK, so that dQ's
    // trip to shared memory runs under the dK GEMM.
    mbarrier_wait(&smem.do_full[do_stage], do_parity);  // a completed phase: returns at once for the side that waited
    wgmma_fence_registers(dv);
    wgmma_fence();
    issue_tile_times_half<T, Traits>(dv, smem.p, smem.dout_stage(do_stage) + 2 * consumer * Traits::kSubTileQ);
    wgmma_commit();
    if (consumer == 1) {
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = 8 * j + 2 * (lane % 4) + i % 2;
          const float prob = smem.p_exact[(4 * j + i) * 128 + thread];
          acc[4 * j + i] = prob * (acc[4 * j + i] - smem.delta[col]);  // dS^T
        }
      }
      store_swizzled_tile<T, kBlockM>(smem.ds, acc, warp, lane);
      fence_proxy_async_smem();
    }
    named_barrier_sync(BwdSplitBarrier::kDsReady, 256);

    mbarrier_wait(&smem.q_full[stage], parity);  // likewise
    float dq[kHalf / 2];
    wgmma_fence_registers(dq);
    wgmma_fence_registers(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {  // M = queries, K = keys: dS^T read M-major, K rows transposed
      Wgmma<T, kHalf>::template ss<true, true>(
          dq, smem_desc_sw128(smem.ds + kk * 16 * 64),
          smem_desc_sw128(smem.k + 2 * consumer * Traits::kSubTileKV + kk * 16 * 64, Traits::kSubTileKV * sizeof(T)),
          kk > 0);
    }
    wgmma_commit();
    issue_tile_times_half<T, Traits>(dk, smem.ds, smem.q_stage(stage) + 2 * consumer * Traits::kSubTileQ);
    wgmma_commit();
    wgmma_wait<2>();  // dV done: dO is free
    wgmma_fence_registers(dv);
    mbarrier_arrive(&smem.do_empty[do_stage]);
    wgmma_wait<1>();
    wgmma_fence_registers(dq);
    store_dq_tile(dq, step == 0);
    // A copy the compiler cannot fold (x + 0 is not x for -0): kept in dq's accumulator registers, dq_late's reads
    // under the next step's first GEMM made ptxas wait for that GEMM first (C7517), and spill in the packed kernels.
#pragma unroll
    for (int i = 0; i < 32; ++i) dq_late[i] = __fadd_rn(dq[32 + i], 0.f);
    wgmma_wait<0>();  // dK done: Q of the stage is free
    wgmma_fence_registers(dk);
    mbarrier_arrive(&smem.q_empty[stage]);
  }

  if (num_steps > 0) {
    store_dq_tile(dq_late, false);
    named_barrier_sync(BwdBarrier::dq_empty(consumer), BwdBarrier::kWriterThreads);  // pairs with the writer's last
  }
  // This warpgroup's half of the columns (column blocks 2 c and 2 c + 1), all 64 rows.
  store_dk_dv<T, Traits, kHalf>(p, block, smem, 2 * consumer * Traits::kSubTileKV, BwdSplitBarrier::kStepStart, dk, dv,
                                warp, lane);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace flashattn::sm90
