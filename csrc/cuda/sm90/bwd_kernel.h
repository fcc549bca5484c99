// Hopper backward: warp-specialised, TMA + wgmma, head dims 64 and 128 (256: bwd_split_kernel.h). It shares the
// params and the passes before and after (bwd_preprocess.cu: delta, dq_accum zeroed; bwd_postprocess.cu: dQ) with
// the sm80 kernel (sm80/bwd_kernel.h).
//
// Persistent: a grid of at most one CTA per SM takes blocks of kBlockN = 128 keys of one (batch, kv head) in turn
// (BwdTileScheduler); 3 warpgroups. Warpgroup 0 is the producer: one thread loads, for every query head of the kv
// head's group and every query block that sees the block's keys, Q and dO blocks of kBlockM rows into 2-stage rings
// that run on from block to block, and K and V once the first step's are on their way (TMA, 128-byte swizzle, zero
// fill past L and D).
// Warpgroups 1 and 2 each own 64 of the keys and work in the transposed frame, keys as the M dimension, so that
// P^T and dS^T come out of the accumulators in the layout of a register A operand:
//
//     S^T  = K Q^T,  dP^T = V dO^T                    (SS wgmma, both in flight together)
//     P^T  = exp2(S^T * scale_log2 - lse_log2)        (masked entries 0)
//     dS^T = P^T * (dP^T - delta)
//     dV  += P^T dO,  dK += dS^T Q                     (RS wgmma, Q and dO read transposed)
//     dQ   = dS K over all 128 keys                    (SS wgmma from both warpgroups' dS^T tiles, read M-major;
//                                                       80 queries: dQ^T = K^T dS^T from their dS tiles)
//
// dQ of a step is taken a step late, after the next step's dV has been issued (the block's last at its end), so that
// neither warpgroup waits for the other's dS of the step it is in: each passes its dS tile, and the next step's
// statistics, through mbarriers (ds_full, ds_empty over two buffers) and the two drift up to a step apart, where a
// barrier of both per step held them in one phase, exponentials together and the tensor pipe idle (ncu: +9 to +12%).
//
// dQ of a step is two fp32 tiles, one per warpgroup: 64x64 (kBlockM = 64 queries x D = 128, or 128 queries x D = 64),
// or, at D128 without a mask, where a step takes 80 queries, 80 queries x 64 columns computed transposed as
// dQ^T = K^T dS^T (wgmma's M is 64 rows; the warpgroups store dS query-major for it). Each goes registers -> swizzled
// shared memory, and the warpgroup's dQ writer (warp 1 or 2 of the producer warpgroup) adds it into the fp32 dq_accum
// by one TMA reduce-add: one reduction per element and CTA, in bulk, where per-thread fp32 atomics held the kernel at
// about half its speed. Deterministic (p.dq_semaphore): each writer waits for its turn before a step's addition and
// counts it done once written, so the key blocks add into each dQ tile in a fixed order (KeyBlock::dq_turn) while the
// consumers go on. lse and delta of the next step are loaded from global memory a step ahead, out of the critical
// path. dK (times scale) and dV are complete in registers at the end (one writer per element) and leave through the
// warpgroup's dQ and dS^T tiles in whole 128-byte lines while the next block's K and V load (they were the CTA's last
// cost outside the steps, with the wait for the first K and V).
//
// The options variant (kOptions) walks only the query blocks of a sliding window's band and masks its edges (each
// warpgroup where they cut its own 64 keys; where a step sees none of them, only its dQ share with a zero dS). Its
// softcap kernel (kSoftcap, a kernel of its own: its registers made the window kernel spill, which then ran 9% slower)
// forms t = tanh(scale * S^T / softcap) and P^T = exp2(softcap * t * log2 e - lse) while dP^T runs, then dS^T =
// P^T (dP^T - delta) (1 - t^2): at D128 with u = P^T (1 - t^2) formed beside P^T, at D64 from t kept as fp16 pairs.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/launchers.h"
#include "cuda/params.h"
#include "cuda/ptx_common.h"
#include "cuda/sm90/bwd_common.h"
#include "cuda/sm90/bwd_split_kernel.h"
#include "cuda/sm90/mask.h"
#include "cuda/sm90/named_barrier.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/sequences.h"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/tma.h"
#include "cuda/sm90/wgmma_ops.h"

namespace flashattn::sm90 {

template <int HeadDim, bool Masked>
struct BwdTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockN = bwd_tile_shape(HeadDim, Masked).block_n;  // keys per CTA: two consumers x 64
  // Queries per step, the N of S^T = K Q^T: 128 at D64, 64 at D128, 80 at D128 without a mask.
  static constexpr int kBlockM = bwd_tile_shape(HeadDim, Masked).block_m;
  // dQ^T = K^T dS^T (wgmma M = a 64-column block of the head dim, N = the step's queries) where kBlockM is no multiple
  // of wgmma's M, with dS stored query-major; else dQ = dS K in 64x64 tiles, dS^T stored key-major.
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  static constexpr int kStages = 2;    // Q buffers
  static constexpr int kStagesDo = 2;  // dO buffers
  static constexpr int kNThreads = 3 * 128;
  static constexpr int kColumnBlocks = HeadDim / 64;  // 64-column sub-tiles (one TMA box / swizzle atom wide)
  static constexpr int kQueryBlocks = kDqTransposed ? 1 : kBlockM / 64;  // query sub-tiles of a step's dQ
  static constexpr int kTileKV = kBlockN * HeadDim;   // elements
  static constexpr int kSubTileKV = kBlockN * 64;
  static constexpr int kTileQ = kBlockM * HeadDim;  // a Q or dO stage
  static constexpr int kSubTileQ = kBlockM * 64;
  static constexpr int kTileDS = 64 * kBlockM;  // one consumer's dS^T (64 keys x kBlockM queries) or dS
  // One consumer's dQ tile, fp32: two TMA boxes of kDqRows rows x 32 columns.
  static constexpr int kDqRows = kDqTransposed ? kBlockM : 64;
  static constexpr int kTileDQ = kDqRows * 64;
  // Consumer c's dQ tile: query sub-tile and 64-column block of the step's dQ (for the consumer and the writer), one
  // part per step.
  static constexpr int kDqParts = 1;
  __host__ __device__ static constexpr int dq_query_block(int consumer) { return consumer % kQueryBlocks; }
  __host__ __device__ static constexpr int dq_column_block(int consumer, int /*part*/) {
    return consumer / kQueryBlocks;
  }
  static constexpr int kProducerRegs = 24;  // the loader thread and the dQ writer warps
  static constexpr int kConsumerRegs = 240;
  template <typename T>
  static constexpr int smem_bytes() {
    return 2 * kTileDQ * static_cast<int>(sizeof(float)) +
           (2 * kTileKV + 2 * kStages * kTileQ + 2 * 2 * kTileDS) * static_cast<int>(sizeof(T)) +
           2 * 2 * kBlockM * static_cast<int>(sizeof(float)) /* lse, delta per buffer */ + 1024 /* alignment */ +
           256 /* barriers */;
  }
  static_assert(HeadDim == 64 || HeadDim == 128, "the Hopper backward covers head dims 64 and 128");
  static_assert(kBlockN == 128, "two consumer warpgroups of 64 keys");
  static_assert(kStagesDo == kStages, "the consumers index the Q and dO rings by one stage");
  static_assert(kQueryBlocks * kColumnBlocks == 2, "a step's dQ is one tile per consumer warpgroup");
  static_assert(kBlockM % 16 == 0 && kTileDS * 2 % 1024 == 0 && kDqRows * 128 % 1024 == 0,
                "k16 steps over the queries; tiles on 1024-byte swizzle atoms");
  static_assert((kProducerRegs + 2 * kConsumerRegs) * 128 <= (65536 / kNThreads / 8) * 8 * kNThreads,
                "producer + consumer registers exceed the register file");
};

template <typename T, typename Traits>
struct BwdSharedStorage {
  float* dq;        // [2 consumers][2 boxes][kDqRows rows][32 columns], swizzled: the TMA reduction's source
  T* k;             // [kColumnBlocks][kBlockN][64], swizzled
  T* v;
  T* q;             // [kStages][kColumnBlocks][kBlockM][64]
  T* dout;
  // [2 buffers][2 consumers][kQueryBlocks][64 keys][64 queries], or (kDqTransposed) [2][2][kBlockM queries][64 keys],
  // swizzled (written by the threads)
  T* ds;
  float* lse_log2;  // [2 buffers][kBlockM]
  float* delta;     // [2 buffers][kBlockM]
  uint64_t* kv_full;
  uint64_t* kv_empty;
  uint64_t* q_full;  // [kStages]
  uint64_t* do_full;
  uint64_t* q_empty;
  uint64_t* do_empty;
  uint64_t* block_full;  // [2] BwdTileScheduler's mailbox
  uint64_t* block_empty;
  uint64_t* ds_full;   // [2 buffers][2 consumers]: the consumer's dS tile (and the next step's statistics) stored
  uint64_t* ds_empty;  // [2 buffers][2 consumers]: the other consumer's dQ GEMM has read that tile
  int* block_slots;

  __device__ explicit BwdSharedStorage(unsigned char* raw) {
    dq = reinterpret_cast<float*>(align_smem<1024>(raw));
    k = reinterpret_cast<T*>(dq + 2 * Traits::kTileDQ);
    v = k + Traits::kTileKV;
    q = v + Traits::kTileKV;
    dout = q + Traits::kStages * Traits::kTileQ;
    ds = dout + Traits::kStages * Traits::kTileQ;
    lse_log2 = reinterpret_cast<float*>(ds + 2 * 2 * Traits::kTileDS);
    delta = lse_log2 + 2 * Traits::kBlockM;
    kv_full = reinterpret_cast<uint64_t*>(delta + 2 * Traits::kBlockM);
    kv_empty = kv_full + 1;
    q_full = kv_empty + 1;
    do_full = q_full + Traits::kStages;
    q_empty = do_full + Traits::kStages;
    do_empty = q_empty + Traits::kStages;
    block_full = do_empty + Traits::kStages;
    block_empty = block_full + 2;
    ds_full = block_empty + 2;
    ds_empty = ds_full + 4;
    block_slots = reinterpret_cast<int*>(ds_empty + 4);
  }
  __device__ T* q_stage(int stage) const { return q + stage * Traits::kTileQ; }
  __device__ T* dout_stage(int stage) const { return dout + stage * Traits::kTileQ; }
  __device__ T* ds_tile(int buffer, int consumer) const { return ds + (2 * buffer + consumer) * Traits::kTileDS; }
  // Thread 0, before the CTA's first barrier: the dS handoff's mbarriers, 128 arrivals each (one consumer's threads).
  __device__ void init_ds_barriers() const {
    for (int i = 0; i < 4; ++i) {
      mbarrier_init(&ds_full[i], 128);
      mbarrier_init(&ds_empty[i], 128);
    }
  }
};

// acc (64 keys x D) += A block, A from registers (P^T or dS^T, k16 steps over the block's queries), block (Q or dO,
// queries x D) read transposed: the forward's O += P V.
template <typename T, typename Traits>
__device__ __forceinline__ void issue_transposed_times_block(float (&acc)[Traits::kHeadDim / 2],
                                                             uint32_t (&a)[Traits::kBlockM / 16][4], const T* block) {
  const uint64_t desc = smem_desc_sw128(block, Traits::kSubTileQ * sizeof(T));
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk) {
    Wgmma<T, Traits::kHeadDim>::template rs<true>(acc, a[kk], desc_advance(desc, kk * 16 * 64 * sizeof(T)), true);
  }
}

template <typename T, typename Traits, bool kCausal, bool kOptions, bool kSequences, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                          const __grid_constant__ CUtensorMap dq_map, const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  static_assert(kOptions || !kSoftcap, "softcap is an option");
  // Softcap at 64-query steps (D128): u = P^T (1 - t^2) and P^T's A operand formed with P^T, under dP^T, so that dS^T =
  // u (dP^T - delta) is all that waits for dP^T (+4.8%). At 128-query steps (D64) that ran 20% slower: t is kept as
  // fp16 pairs and dS^T = P^T (dP^T - delta) (1 - t^2) formed once dP^T lands.
  constexpr bool kSoftcapFactorEarly = kSoftcap && kBlockM == 64;

  using Block = KeyBlock<Traits, kCausal, kOptions, kSequences>;
  const int num_blocks = Block::num_blocks(p);

  extern __shared__ unsigned char smem_raw[];
  const BwdSharedStorage<T, Traits> smem(smem_raw);
  const BwdTileScheduler scheduler(smem);
  init_bwd_barriers<Traits>(smem);
  if (threadIdx.x == 0) {
    scheduler.init();
    smem.init_ds_barriers();
  }
  __syncthreads();

  // Warp-uniform (a shuffle from lane 0), so that the tile addresses derived from it live in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (warpgroup == 0) {  // ------------------------------------------------------------------- producer, dQ writer
    setmaxnreg_dec<Traits::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
      int index = BwdTileScheduler::take(p);
      for (int iter = 0, first_step = 0;; ++iter) {
        scheduler.publish(iter, index);
        if (index >= num_blocks) break;
        const Block block(p, index);
        run_bwd_producer<T, Traits>(smem, q_map, k_map, v_map, do_map, p, block, first_step, iter);
        first_step += block.num_steps(p);
        // Taken once this block's loads are out, about two steps before its end: taken at its start, a long next
        // block waited behind a long current one at the end of a causal grid (-5 to -9%).
        index = BwdTileScheduler::take(p);
      }
    } else if (warp == 1 || warp == 2) {
      for (int iter = 0;; ++iter) {
        const int index = scheduler.read(iter);
        if (index >= num_blocks) break;
        run_dq_writer<Traits>(smem, dq_map, p, Block(p, index), warp - 1, threadIdx.x % 32);
      }
      if (threadIdx.x % 32 == 0) bulk_wait_group<0>();  // the reductions end before the CTA's shared memory goes
    }
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int consumer = warpgroup - 1;  // keys n_start + 64 * consumer ..
  const int thread = threadIdx.x % 128;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const T* const k_rows = smem.k + consumer * 64 * 64;  // this warpgroup's 64 rows inside each sub-tile
  const T* const v_rows = smem.v + consumer * 64 * 64;
  // This warpgroup's dQ tile of every step: a 64-query sub-tile (all 80 queries when transposed) and a 64-column
  // block.
  const int dq_query_block = Traits::dq_query_block(consumer);
  const int dq_column_block = Traits::dq_column_block(consumer, 0);
  float* const dq_tile = smem.dq + consumer * Traits::kTileDQ;

  // lse (log2 domain) and delta of a step's rows (RowStats), staged in shared memory for both warpgroups: thread
  // t < kBlockM of consumer 0 stages the lse of row t, of consumer 1 the delta (whose rule for rows without keys reads
  // the lse too).
  const bool stages_stats = thread < kBlockM;
  RowStats stats;  // loaded a step ahead, the first step's during the key block before
  const auto load_stats = [&](const Block& b, int step) {
    if (stages_stats) stats.load(p, b.row_base(step, p), b.m_start(step) + thread, b.len_q(p), consumer == 1);
  };
  const auto store_stats = [&](int buffer) {
    if (!stages_stats) return;
    if (consumer == 0) {
      smem.lse_log2[buffer * kBlockM + thread] = stats.lse_log2();
    } else {
      smem.delta[buffer * kBlockM + thread] = stats.delta_or_zero();
    }
  };

  // Block `index`'s first statistics (a band or an idle slot can leave a block without steps).
  const auto load_first_stats = [&](int index) {
    if (const Block b(p, index); b.num_steps(p) > 0) load_stats(b, 0);
  };

  // dQ of the CTA's step g, one step late, so that neither consumer waits for the other's dS of the step it is in:
  // over the CTA's 128 keys (k16 steps: consumer kk / 4's tile, 16 keys of it), either dQ^T = K^T dS^T for the column
  // block (A = K rows read transposed, B = both dS tiles, K-major), or the dQ tile = dS[query block] K[:, column
  // block] (A = the two dS^T tiles read M-major, B = K rows read transposed).
  constexpr int kDqRegs = Traits::kTileDQ / 128;  // a thread's share of its warpgroup's dQ tile
  // Both dS tiles of step g stored: the other consumer's, and this one's by all of its threads (the wgmma reads what
  // every thread of the warpgroup wrote).
  const auto wait_for_ds = [&](int g) {
    mbarrier_wait(&smem.ds_full[2 * (g % 2) + (consumer ^ 1)], (g / 2) & 1);
    mbarrier_wait(&smem.ds_full[2 * (g % 2) + consumer], (g / 2) & 1);
  };
  // A key block's first step has no dQ to take; it runs the GEMM on the K and V tiles (read-only there) and drops it,
  // as a branch around the GEMM keeps the accumulator live across the step (600 B of spills).
  constexpr int kDroppedDqExtent = Traits::kDqTransposed ? 2 * Traits::kTileDS
                                                        : (kBlockM / 64 - 1) * 64 * 64 + Traits::kTileDS + 64 * 64;
  static_assert(kDroppedDqExtent <= 2 * Traits::kTileKV, "the dropped dQ GEMM reads within the K and V tiles");
  const auto issue_dq = [&](int g, bool real, float (&dq)[kDqRegs]) {
    wgmma_fence_registers(dq);
    wgmma_fence();
    const T* const ds_tiles = real ? smem.ds_tile(g % 2, 0) : smem.k;
    const uint64_t ds_desc = smem_desc_sw128(ds_tiles + dq_query_block * 64 * 64);
    const uint64_t k_desc = smem_desc_sw128(smem.k + dq_column_block * Traits::kSubTileKV);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t k_step = desc_advance(k_desc, kk * 16 * 64 * sizeof(T));
      if constexpr (Traits::kDqTransposed) {
        const int ds_offset = (kk / 4) * Traits::kTileDS + (kk % 4) * 16;
        Wgmma<T, kBlockM>::template ss<false, true>(dq, k_step, desc_advance(ds_desc, ds_offset * sizeof(T)),
                                                    kk > 0);
      } else {
        const int ds_offset = (kk / 4) * Traits::kTileDS + (kk % 4) * 16 * 64;
        Wgmma<T, 64>::template ss<true, true>(dq, desc_advance(ds_desc, ds_offset * sizeof(T)), k_step, kk > 0);
      }
    }
    wgmma_commit();
  };
  // Once the dQ GEMM of step g has ended: the other consumer's tile is free, and the tile goes to the writer (after it
  // has read the last one, unless this is the key block's first).
  const auto finish_dq = [&](int g, float (&dq)[kDqRegs], bool wait_for_writer) {
    wgmma_fence_registers(dq);
    mbarrier_arrive(&smem.ds_empty[2 * (g % 2) + (consumer ^ 1)]);
    if (wait_for_writer) named_barrier_sync(BwdBarrier::dq_empty(consumer), BwdBarrier::kWriterThreads);
    if constexpr (Traits::kDqTransposed) {
      store_transposed_fp32_tile<kBlockM>(dq_tile, dq, warp, lane);
    } else {
      store_swizzled_fp32_tile(dq_tile, dq, warp, lane);
    }
    fence_proxy_async_smem();
    named_barrier_arrive(BwdBarrier::dq_full(consumer), BwdBarrier::kWriterThreads);
  };

  int index = scheduler.read(0);
  if (index >= num_blocks) return;
  load_first_stats(index);
  for (int iter = 0, first_step = 0;; ++iter) {
    const Block block(p, index);
    const int n_start = block.n_start;
    const int causal_shift = block.len_k(p) - block.len_q(p);
    const int key0 = n_start + 64 * consumer + 16 * warp + lane / 4;  // + 8 for the thread's second row
    const int num_steps = block.num_steps(p);
    if (num_steps > 0) store_stats(0);
    // Publishes step 0's statistics; ends the last block's epilogue reads of this warpgroup's dQ and dS^T tiles.
    named_barrier_sync(BwdBarrier::kBothConsumers, 256);

    float dk[kHeadDim / 2], dv[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;

    mbarrier_wait(smem.kv_full, iter & 1);
    for (int step = 0; step < num_steps; ++step) {
      const int m_start = block.m_start(step);
      const int stage = (first_step + step) % kStages;  // the rings run on across key blocks
      const uint32_t parity = ((first_step + step) / kStages) & 1;
      // Double buffers: lse/delta written at step n - 1, read at n (by block); dS tiles (by the CTA's step count g)
      // written at g, read by both consumers' dQ GEMMs at g + 1 (the last at the block's end), rewritten at g + 2.
      const int buffer = step % 2;
      const int g = first_step + step;
      if (step > 0) wait_for_ds(g - 1);  // and this step's statistics
      // The step's lse in registers before its GEMMs: read after them, the loads wait behind the GEMMs' operands.
      // delta once S^T has ended.
      const int stats_offset = buffer * kBlockM;
      ColumnPairs<kBlockM> lse_log2, delta;
      lse_log2.load(smem.lse_log2 + stats_offset, lane);
      if (step + 1 < num_steps) load_stats(block, step + 1);  // in flight during this step

      if constexpr (kOptions) {
        // A step whose queries see none of this warpgroup's keys (a band's first or last steps): no GEMM but its
        // share of the dQ handoff, with a zero dS tile.
        static_assert(!Traits::kDqTransposed, "masked steps store dS^T key-major");
        if (block.keys_unseen(m_start, n_start + 64 * consumer, causal_shift, p)) {
          mbarrier_wait(&smem.q_full[stage], parity);
          mbarrier_wait(&smem.do_full[stage], parity);
          if (g >= 2) mbarrier_wait(&smem.ds_empty[2 * (g % 2) + consumer], ((g / 2) - 1) & 1);
          float zero[kBlockM / 2];
#pragma unroll
          for (int i = 0; i < kBlockM / 2; ++i) zero[i] = 0.f;
          store_swizzled_tile<T, kBlockM>(smem.ds_tile(g % 2, consumer), zero, warp, lane);
          if (step + 1 < num_steps) store_stats(buffer ^ 1);
          fence_proxy_async_smem();
          mbarrier_arrive(&smem.ds_full[2 * (g % 2) + consumer]);
          float dq[kDqRegs];
          issue_dq(g - 1, step > 0, dq);
          wgmma_wait<0>();
          mbarrier_arrive(&smem.do_empty[stage]);
          if (step > 0) finish_dq(g - 1, dq, step > 1);
          mbarrier_arrive(&smem.q_empty[stage]);
          continue;
        }
      }
      float s[kBlockM / 2], dp[kBlockM / 2];
      uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
      mbarrier_wait(&smem.q_full[stage], parity);
      issue_rows_times_block<T, Traits>(s, k_rows, smem.q_stage(stage));
      mbarrier_wait(&smem.do_full[stage], parity);
      issue_rows_times_block<T, Traits>(dp, v_rows, smem.dout_stage(stage));
      // dS^T = P^T (dP^T - delta) in dp, once dP^T has landed (softcap has its own, through the tanh).
      const auto ds_from_dp = [&] {
        wgmma_wait<0>();
        wgmma_fence_registers(dp);
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) dp[4 * j + i] = s[4 * j + i] * (dp[4 * j + i] - delta.at(j, i));
        }
      };

      if constexpr (kOptions) {
        // Masked: queries past Lq, keys past Lk, and outside the band (key > query + shift + right cuts the step's
        // columns from below, key < query + shift - left, Lq and Lk from above); only steps at an edge test them, each
        // entry against the bounds that cut the step (mask.h: fill_outside).
        const int left = Block::left(p), right = Block::right(p);
        const int len_q = block.len_q(p), len_k = block.len_k(p);
        const int edges =
            band_step_edges<kBlockM, 64>(m_start, n_start + 64 * consumer, causal_shift, left, right, len_q, len_k);
        const auto band_cols = [&](int (&first)[2], int (&last)[2]) {
          band_query_cols(key0, m_start + 2 * (lane % 4), left, right, len_q, len_k, first, last);
        };
        if constexpr (kSoftcap) {  // t and P^T while dP^T is still running, then dS^T
          wgmma_wait<1>();
          wgmma_fence_registers(s);
          const float cap_scale = p.scale / p.softcap, cap_log2 = p.softcap * 1.4426950408889634f;
          __half2 t_pairs[kSoftcapFactorEarly ? 1 : kBlockM / 4];
          // The mask inside the loop, in a copy of its own for edge steps: a separate pass after it keeps more
          // registers live, which spills at D64.
          const auto capped_probabilities = [&](auto masked) {
            int first[2], last[2];
            if constexpr (decltype(masked)::value) band_cols(first, last);
#pragma unroll
            for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                float t[2], prob[2];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                  const int i = 2 * h + c, col = 8 * j + c;
                  t[c] = fast_tanh(s[4 * j + i] * cap_scale);
                  prob[c] = fast_exp2(fmaf(t[c], cap_log2, -lse_log2.at(j, i)));
                  if constexpr (decltype(masked)::value) {
                    if (col < first[h] || col > last[h]) prob[c] = 0.f;
                  }
                  s[4 * j + i] = kSoftcapFactorEarly ? prob[c] * fmaf(-t[c], t[c], 1.f) : prob[c];
                }
                if constexpr (kSoftcapFactorEarly) {
                  p_frag[(2 * j + h) / 4][(2 * j + h) % 4] = pack2<T>(prob[0], prob[1]);  // pack_a's pair 2 j + h
                } else {
                  t_pairs[2 * j + h] = __floats2half2_rn(t[0], t[1]);
                }
              }
            }
          };
          if (edges != 0) {
            capped_probabilities(std::true_type{});
          } else {
            capped_probabilities(std::false_type{});
          }
          // delta after P^T: live across the tanh, it spilled (D64 1.2-1.34x; D128 with u 1.1x).
          delta.load(smem.delta + stats_offset, lane);
          wgmma_wait<0>();
          wgmma_fence_registers(dp);
          // dS^T: s holds u (D128) or P^T (D64, times 1 - t^2 from t's pairs). Each arm one expression: with the
          // product split in two statements ptxas spilled one more word at D64.
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float2 pair = kSoftcapFactorEarly ? float2{} : __half22float2(t_pairs[2 * j + h]);
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int i = 2 * h + c;
                const float x = c == 0 ? pair.x : pair.y;
                dp[4 * j + i] = kSoftcapFactorEarly ? s[4 * j + i] * (dp[4 * j + i] - delta.at(j, i))
                                                    : s[4 * j + i] * (dp[4 * j + i] - delta.at(j, i)) * (1.f - x * x);
              }
            }
          }
        } else {
          // P^T while dP^T is still running.
          wgmma_wait<1>();
          wgmma_fence_registers(s);
          delta.load(smem.delta + stats_offset, lane);
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[4 * j + i] = fast_exp2(fmaf(s[4 * j + i], p.scale_log2, -lse_log2.at(j, i)));
          }
          if (edges != 0) {
            int first[2], last[2];
            band_cols(first, last);
            fill_outside(s, first, last, edges, 0.f);
          }
          ds_from_dp();
        }
      } else {  // as the options branch without softcap, with the causal mask alone
        // P^T while dP^T is still running. Masked: queries past Lq, keys past Lk, and (causal) key > query + shift.
        wgmma_wait<1>();
        wgmma_fence_registers(s);
        delta.load(smem.delta + stats_offset, lane);
        masked_probabilities<kCausal, kBlockM, kBlockN>(s, lse_log2, p.scale_log2, block.len_q(p), block.len_k(p),
                                                        m_start, n_start, causal_shift, key0, lane);

        ds_from_dp();
      }

      // dS^T (or dS) to shared memory for dQ, before the dV/dK GEMMs so that the fp32 dS^T is dead while they run
      // (the wgmma async proxy reads what the threads wrote: fence, then ds_full below), once the other consumer's
      // dQ has read the buffer's last tile.
      if constexpr (!kSoftcapFactorEarly) pack_a<T, kBlockM>(p_frag, s);
      pack_a<T, kBlockM>(ds_frag, dp);
      if (g >= 2) mbarrier_wait(&smem.ds_empty[2 * (g % 2) + consumer], ((g / 2) - 1) & 1);
      if constexpr (Traits::kDqTransposed) {
        store_transposed_tile<T, kBlockM>(smem.ds_tile(g % 2, consumer), ds_frag, warp, lane);
      } else {
        store_swizzled_tile<T, kBlockM>(smem.ds_tile(g % 2, consumer), dp, warp, lane);
      }

      // dV += P^T dO now; dK += dS^T Q after dQ, so that dQ's trip to shared memory below runs under the dK GEMM.
      wgmma_fence_registers(dv);
      wgmma_fence_registers(dk);
      wgmma_fence_registers(p_frag);
      wgmma_fence_registers(ds_frag);
      wgmma_fence();
      issue_transposed_times_block<T, Traits>(dv, p_frag, smem.dout_stage(stage));
      wgmma_commit();

      // The next step's lse/delta go to the other buffer (its last readers, step n - 1, stored their dS before this
      // step's first wait); the arrival publishes them with the dS tile.
      if (step + 1 < num_steps) store_stats(buffer ^ 1);
      fence_proxy_async_smem();
      mbarrier_arrive(&smem.ds_full[2 * (g % 2) + consumer]);

      float dq[kDqRegs];
      issue_dq(g - 1, step > 0, dq);
      issue_transposed_times_block<T, Traits>(dk, ds_frag, smem.q_stage(stage));
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ done: dO of the stage is free
      wgmma_fence_registers(dv);
      wgmma_fence_registers(p_frag);
      mbarrier_arrive(&smem.do_empty[stage]);
      if (step > 0) finish_dq(g - 1, dq, step > 1);

      wgmma_wait<0>();  // dK done: Q of the stage is free
      wgmma_fence_registers(dk);
      wgmma_fence_registers(ds_frag);
      mbarrier_arrive(&smem.q_empty[stage]);
    }

    if (num_steps > 0) {  // the last step's dQ
      const int g = first_step + num_steps - 1;
      wait_for_ds(g);
      float dq[kDqRegs];
      issue_dq(g, true, dq);
      wgmma_wait<0>();
      finish_dq(g, dq, num_steps > 1);
    }
    mbarrier_arrive(smem.kv_empty);  // K and V may take the next block's

    // The next key block's first statistics load under this epilogue.
    index = scheduler.read(iter + 1);
    const bool more = index < num_blocks;
    if (more) load_first_stats(index);

    // Epilogue: this warpgroup's dK (times scale) and dV leave through its own dQ and dS^T tiles (K and V may hold
    // the next block's already), free once both consumers' GEMMs have ended and the writer has read the last dQ tile,
    // then in whole 128-byte lines (ncu: 4-byte stores straight from the accumulators took about 3.5 steps' time).
    named_barrier_sync(BwdBarrier::kBothConsumers, 256);
    if (num_steps > 0) named_barrier_sync(BwdBarrier::dq_empty(consumer), BwdBarrier::kWriterThreads);
    T* const dk_stage = reinterpret_cast<T*>(dq_tile);  // [kHeadDim / 64][64][64]
    T* const dv_stage = smem.ds_tile(0, consumer);       // sub-tiles in this consumer's dS^T tiles of both buffers
    constexpr int kDvStride = 2 * Traits::kTileDS;
    store_swizzled_tile<T, kHeadDim, 64 * 64>(dk_stage, dk, warp, lane, p.scale);
    store_swizzled_tile<T, kHeadDim, kDvStride>(dv_stage, dv, warp, lane);
    named_barrier_sync(BwdBarrier::epilogue(consumer), 128);
    store_key_rows<T, kHeadDim, 64, 128, 64 * 64>(p, block, dk_stage, false, 64 * consumer, thread);
    store_key_rows<T, kHeadDim, 64, 128, kDvStride>(p, block, dv_stage, true, 64 * consumer, thread);
    if (!more) break;
    first_step += num_steps;
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// Launches the Hopper backward on `stream` (delta computed, dq_accum and tile_counter zeroed by the caller): this
// file's kernel for head dims 64 and 128, bwd_split_kernel.h's for 256. Returns cudaErrorNotSupported, having launched
// nothing, when the driver cannot encode the tensor maps for these strides or grant the shared memory (the caller may
// then use another backward). kOptions: windows and softcap (softcap > 0 takes the softcap kernel).
// kSequences (with kOptions): packed sequences (params.cu_seqlens_*; params.seq_maps, which the preparation fills
// first).
template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_bwd_sm90(const BwdParams& params, cudaStream_t stream) {
  static_assert(!kSequences || kOptions, "packed sequences run in the options variants");
  using Traits = std::conditional_t<HeadDim == 256, BwdSplitTraits,
                                    BwdTraits<HeadDim == 256 ? 128 : HeadDim, kCausal || kOptions>>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  // Packed sequences: maps over all rows as one batch entry, which the preparation cuts into each sequence's.
  BwdParams shape = params;
  if constexpr (kSequences) shape.batch = 1;
  CUtensorMap q_map, k_map, v_map, do_map;
  const bool ok =
      make_qkv_maps(shape, kBf16, Traits::kBlockM, Traits::kBlockN, &q_map, &k_map, &v_map) &&
      make_bhld_map(&do_map, shape.dout, kBf16, shape.batch, shape.heads, shape.len_q, shape.head_dim,
                    shape.do_batch_stride, shape.do_head_stride, shape.do_row_stride, Traits::kBlockM);
  if (!ok) return cudaErrorNotSupported;
  constexpr int kSmemBytes = Traits::template smem_bytes<T>();
  static_assert(kSmemBytes <= 227 * 1024, "the backward's tiles exceed the 227 KB of shared memory per block");
  const int num_blocks = KeyBlock<Traits, kCausal, kOptions, kSequences>::num_blocks(params);
  // D256: a CTA per key block; else persistent, at most one CTA per SM (blocks from params.tile_counter).
  const dim3 grid(static_cast<unsigned>(HeadDim == 256 ? num_blocks : std::min(num_blocks, params.max_ctas)));
  CUtensorMap dq_map;
  if (!make_dq_accum_map(&dq_map, shape.dq_accum, shape.batch, shape.heads, shape.len_q, shape.head_dim,
                         Traits::kDqRows)) {
    return cudaErrorNotSupported;
  }
  const auto kernel = [&params] {
    if constexpr (HeadDim == 256 && kOptions) {
      return params.softcap > 0.f ? flash_bwd_split_sm90_kernel<T, Traits, kCausal, true, kSequences, true>
                                  : flash_bwd_split_sm90_kernel<T, Traits, kCausal, true, kSequences, false>;
    } else if constexpr (HeadDim == 256) {
      return flash_bwd_split_sm90_kernel<T, Traits, kCausal, false, kSequences, false>;
    } else if constexpr (kOptions) {
      return params.softcap > 0.f ? flash_bwd_sm90_kernel<T, Traits, kCausal, true, kSequences, true>
                                  : flash_bwd_sm90_kernel<T, Traits, kCausal, true, kSequences, false>;
    } else {
      return flash_bwd_sm90_kernel<T, Traits, kCausal, false, kSequences, false>;
    }
  }();
  if (allow_dynamic_smem(kernel, kSmemBytes) != cudaSuccess) return cudaErrorNotSupported;
  if constexpr (kSequences) {
    SequencesPrepParams prep = sequences_prep(params, kBwdSeqMaps);
    prep.sources[kBwdSeqMapQ] = {static_cast<const char*>(params.q), params.q_row_stride * 2, true};
    prep.sources[kBwdSeqMapK] = {static_cast<const char*>(params.k), params.k_row_stride * 2, false};
    prep.sources[kBwdSeqMapV] = {static_cast<const char*>(params.v), params.v_row_stride * 2, false};
    prep.sources[kBwdSeqMapDout] = {static_cast<const char*>(params.dout), params.do_row_stride * 2, true};
    prep.sources[kBwdSeqMapDq] = {reinterpret_cast<const char*>(params.dq_accum),
                                  static_cast<int64_t>(params.head_dim) * 4, true};
    prep.maps = static_cast<CUtensorMap*>(params.seq_maps);
    const SeqMapTemplates templates{{q_map, k_map, v_map, do_map, dq_map}};
    const cudaError_t err = prepare_sequences(prep, templates, stream);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(q_map, k_map, v_map, do_map, dq_map, params);
  return cudaGetLastError();
}

}  // namespace flashattn::sm90
