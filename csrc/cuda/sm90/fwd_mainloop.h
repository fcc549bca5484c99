// The Hopper forward's main loop, in its two roles:
//   FwdProducer (one thread of warpgroup 0): per tile, TMA loads of Q and of the K/V blocks into the rings;
//   FwdConsumer (each consumer warpgroup, 64 query rows): per tile, the GEMMs and the online softmax over the key
//   blocks, FlashAttention-3's intra-warpgroup overlap:
//
//     issue S = Q K[n]^T          (SS wgmma; RS with Q in registers)
//     issue O += P[n-1] V[n-1]    (RS wgmma: P from registers, V read transposed)
//     wait for S; softmax(S) -> P[n] while the P V wgmma still runs
//     wait for P V; rescale O (only where a row's reference moved); pack P[n]
//
// The consumers take turns issuing their GEMMs (the ping-pong, one named barrier each, round robin), so one
// warpgroup's softmax runs while another's GEMMs keep the tensor cores busy. Both sides count Q loads and K/V blocks
// in the same order; a count gives the ring stage and the mbarrier phase parity.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/params.h"
#include "cuda/ptx_common.h"
#include "cuda/sm90/fwd_traits.h"
#include "cuda/sm90/mask.h"
#include "cuda/sm90/named_barrier.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/softmax.h"
#include "cuda/sm90/tile_scheduler.h"
#include "cuda/sm90/wgmma_ops.h"

namespace flashattn::sm90 {

// The thread's first row in its CTA's tile (+ 8 for its second), as a consumer's wgmma accumulators hold them.
__device__ __forceinline__ int accumulator_row0(int consumer, int warp, int lane) {
  return 64 * consumer + 16 * warp + lane / 4;
}

// ---- GEMMs ----------------------------------------------------------------------------------------------------------

// S = Q K^T for this warpgroup's 64 rows: k16 steps walk 32 bytes inside a 128-byte swizzled row, then the next
// 64-column sub-tile. Issued and committed as one group; the caller waits.
template <typename T, typename Traits>
__device__ __forceinline__ void issue_qk(float (&s)[Traits::kBlockN / 2], const T* q_rows, const T* k_tile) {
  wgmma_fence_registers(s);
  wgmma_fence();
  const uint64_t q_desc = smem_desc_sw128(q_rows), k_desc = smem_desc_sw128(k_tile);
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    const int c = kk / 4, k_in_row = (kk % 4) * 16;
    Wgmma<T, Traits::kBlockN>::template ss<false>(
        s, desc_advance(q_desc, (c * Traits::kSubTileQ + k_in_row) * sizeof(T)),
        desc_advance(k_desc, (c * Traits::kSubTileKV + k_in_row) * sizeof(T)), kk > 0);
  }
  wgmma_commit();
}

// The same with Q from registers (QOperand::kRegisters: load_q_fragments).
template <typename T, typename Traits>
__device__ __forceinline__ void issue_qk(float (&s)[Traits::kBlockN / 2], const uint32_t (&q)[Traits::kHeadDim / 16][4],
                                         const T* k_tile) {
  wgmma_fence_registers(s);
  wgmma_fence();
  const uint64_t k_desc = smem_desc_sw128(k_tile);
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    const int c = kk / 4, k_in_row = (kk % 4) * 16;
    Wgmma<T, Traits::kBlockN>::template rs<false>(
        s, q[kk], desc_advance(k_desc, (c * Traits::kSubTileKV + k_in_row) * sizeof(T)), kk > 0);
  }
  wgmma_commit();
}

// A warpgroup's 64 rows of Q (q_rows: in each 64-column sub-tile, 128-byte swizzle) as the A registers of the RS
// wgmma, k16 step kk in q[kk]: warp w's rows 16 w .. 16 w + 15; ldmatrix matrices: rows 0-7 and 8-15 of the step's
// first 8 columns, then of its last 8.
template <typename T, typename Traits>
__device__ __forceinline__ void load_q_fragments(uint32_t (&q)[Traits::kHeadDim / 16][4], const T* q_rows, int warp,
                                                 int lane) {
  const int matrix = lane / 8;  // lanes 8m .. 8m + 7 address matrix m's rows
  const int row = 16 * warp + lane % 8 + 8 * (matrix % 2);
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    const int chunk = (kk % 4) * 2 + matrix / 2;  // 8-column chunk in the sub-tile
    ldmatrix_x4(q[kk], q_rows + (kk / 4) * Traits::kSubTileQ + sw128_offset(row, chunk));
  }
}

// O += P V: V (keys x D) is MN-major; a k16 step is 16 rows (2 KB) down the sub-tiles, and the leading byte offset
// is the distance between 64-column sub-tiles.
template <typename T, typename Traits>
__device__ __forceinline__ void issue_pv(float (&o)[Traits::kHeadDim / 2], uint32_t (&p)[Traits::kBlockN / 16][4],
                                         const T* v_tile) {
  wgmma_fence_registers(o);  // the rescale and the P packing must land before the wgmmas read them
  wgmma_fence_registers(p);
  wgmma_fence();
  const uint64_t v_desc = smem_desc_sw128(v_tile, Traits::kSubTileKV * sizeof(T));
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
    Wgmma<T, Traits::kHeadDim>::template rs<true>(o, p[kk], desc_advance(v_desc, kk * 16 * 64 * sizeof(T)), true);
  }
  wgmma_commit();
}

// ---- producer -------------------------------------------------------------------------------------------------------

// One thread: Q of each tile with at least one key block (kQParts boxes, each part waiting for its own release), then
// its K/V blocks in the order of Traits::kLoadOrder. K and V of a block go into the same stage index, except with K a
// block ahead across tiles, whose K ring has a stage more (kKStages); each waits only for its own "empty" barrier. With
// O staged in a V (or K) stage, that stage is reloaded only once the O has left.
template <typename T, typename Traits>
struct FwdProducer {
  static constexpr int kStages = Traits::kStages;
  const SharedStorage<T, Traits>& smem;
  const CUtensorMap& q_map;
  const CUtensorMap& k_map;
  const CUtensorMap& v_map;
  const FwdParams& p;
  int q_loads = 0, kv_loads = 0;
  // A bit per stage: the stage's V (K) holds the last (first) consumer's staged O, and the parity of its release.
  uint32_t o_in_v = 0, o_in_v_parity = 0;
  uint32_t o_in_k = 0, o_in_k_parity = 0;
  // K ahead of V: a block's V is requested after the next block's K; its first key row, kv head and batch (and map,
  // with packed sequences) wait here.
  bool v_held = false;
  int held_v_row = 0, held_v_head = 0, held_v_batch = 0;
  const CUtensorMap* held_v_map = nullptr;
  int held_v_entry = 0, held_v_len_k = 0;  // a paged KV cache's: the entry and its keys (kv_boxes)

  // Before a stage holding a staged O (its bit in `holds`) is reloaded, the O has to have left (`freed[stage]`).
  __device__ static void wait_staged_o_left(uint32_t& holds, uint32_t& parity, uint64_t* freed, int stage) {
    if ((holds >> stage) & 1) {
      mbarrier_wait(&freed[stage], (parity >> stage) & 1);
      holds &= ~(1u << stage);
      parity ^= 1u << stage;
    }
  }

  // The sequences variants' K or V block (kBlockN keys from `row` of its sequence) into `dst`, through the sequence's
  // map; from a paged KV cache (block_table) a box per page (a block's part of a page of kBlockN rows or more) through
  // the pages' map (`pages`), the page that holds the entry's last keys through the entry's map (its rows past them
  // zero-filled), and pages past them at an index past the cache (zero-filled too): no row past the entry's keys
  // reaches the block. The other kernels keep their own loops (one helper for all changed the D256 kernels' SASS).
  __device__ void kv_boxes(T* dst, const CUtensorMap* map, const CUtensorMap& pages, uint64_t* full, int row,
                           int kv_head, int batch, int entry, int len_k) {
    if (p.block_table == nullptr) {
      for (int c = 0; c < Traits::kColumnBlocks; ++c) {
        tma_load_4d(dst + c * Traits::kSubTileKV, map, full, 64 * c, row, kv_head, batch);
      }
      return;
    }
    const int* const table = p.block_table + static_cast<int64_t>(entry) * p.block_table_stride;
    const int box_rows = page_box_rows(p.page_size, Traits::kBlockN);
    for (int r = 0; r < Traits::kBlockN; r += box_rows) {
      const int key = row + r;
      const int slot = p.page_of.div(key);
      const int page_first = slot * p.page_size;
      const int page = key < len_k ? min(max(__ldg(table + slot), 0), p.num_pages - 1) : p.num_pages;
      const CUtensorMap* const box_map = key < len_k && page_first + p.page_size > len_k ? map : &pages;
      for (int c = 0; c < Traits::kColumnBlocks; ++c) {
        tma_load_4d(dst + c * Traits::kSubTileKV + r * 64, box_map, full, 64 * c, key - page_first, kv_head, page);
      }
    }
  }

  // V of the block whose K was load number `count` (the sequences variants: of entry `entry` with len_k keys).
  __device__ void load_v(int count, const CUtensorMap* map, int row, int kv_head, int batch, int entry = 0,
                         int len_k = 0) {
    const int stage = count % kStages;
    const int use = count / kStages;
    if (use > 0) mbarrier_wait(&smem.v_empty[stage], (use - 1) & 1);
    if constexpr (Traits::kLastOInV) wait_staged_o_left(o_in_v, o_in_v_parity, smem.o_in_v_free, stage);
    mbarrier_arrive_expect_tx(&smem.v_full[stage], Traits::kTileKV * sizeof(T));
    if constexpr (Traits::kSequences) {
      kv_boxes(smem.v_stage(stage), map, v_map, &smem.v_full[stage], row, kv_head, batch, entry, len_k);
    } else {
      for (int c = 0; c < Traits::kColumnBlocks; ++c) {
        tma_load_4d(smem.v_stage(stage) + c * Traits::kSubTileKV, map, &smem.v_full[stage], 64 * c, row, kv_head,
                    batch);
      }
    }
  }

  // Q and key blocks n_begin .. n_end - 1 of `tile`.
  template <typename TileT>
  __device__ void load(const TileT& tile, int n_begin, int n_end) {
    const CUtensorMap* const q_tile_map = tile.map(&q_map, kSeqMapQ, p);
    const CUtensorMap* const k_tile_map = tile.map(&k_map, kSeqMapK, p);
    const CUtensorMap* const v_tile_map = tile.map(&v_map, kSeqMapV, p);
    const int batch = tile.tma_batch();
    if constexpr (Traits::kSequences) {  // maps written on the device before the launch
      fence_tensormap_acquire(q_tile_map);
      fence_tensormap_acquire(k_tile_map);
      fence_tensormap_acquire(v_tile_map);
    }
    // A tile without key blocks loads nothing: the V held back goes now. The consumers still need it for the tile
    // before, and the producer could otherwise wait to publish a later tile for readers that wait for that V.
    if (n_end == n_begin) release_held_v();
    if (n_end > n_begin) {
      const int q_stage = q_loads % Traits::kQStages;
      const int q_use = q_loads / Traits::kQStages;
      ++q_loads;
      for (int part = 0; part < Traits::kQParts; ++part) {
        constexpr int kPartRows = Traits::kBlockM / Traits::kQParts;
        uint64_t* const full = &smem.q_full[q_stage * Traits::kQParts + part];
        if (q_use > 0) mbarrier_wait(&smem.q_empty[q_stage * Traits::kQParts + part], (q_use - 1) & 1);
        mbarrier_arrive_expect_tx(full, Traits::kTileQ / Traits::kQParts * sizeof(T));
        for (int c = 0; c < Traits::kColumnBlocks; ++c) {
          tma_load_4d(smem.q_stage(q_stage) + c * Traits::kSubTileQ + part * kPartRows * 64, q_tile_map, full, 64 * c,
                      tile.m_start + part * kPartRows, tile.head, batch);
        }
      }
    }
    // In the plain order one thread issues K[n + 1] behind V[n], which waits for P[n - 2] V[n - 2]. The plain order
    // keeps its own copy of the V load: calling load_v there changes the SASS of the other kernels.
    for (int n_block = n_begin; n_block < n_end; ++n_block, ++kv_loads) {
      if constexpr (Traits::kLoadOrder == KvLoadOrder::kKAheadAcrossTiles) {
        const int stage = kv_loads % Traits::kKStages;
        const int use = kv_loads / Traits::kKStages;
        if (use > 0) mbarrier_wait(&smem.k_empty[stage], (use - 1) & 1);
        mbarrier_arrive_expect_tx(&smem.k_full[stage], Traits::kTileKV * sizeof(T));
        if constexpr (Traits::kSequences) {
          kv_boxes(smem.k_stage(stage), k_tile_map, k_map, &smem.k_full[stage], tile.key_start(n_block),
                   tile.kv_head(p), batch, tile.batch, tile.len_k(p));
        } else {
          for (int c = 0; c < Traits::kColumnBlocks; ++c) {
            tma_load_4d(smem.k_stage(stage) + c * Traits::kSubTileKV, k_tile_map, &smem.k_full[stage], 64 * c,
                        tile.key_start(n_block), tile.kv_head(p), batch);
          }
        }
        release_held_v();
        v_held = true;
        held_v_row = tile.key_start(n_block);
        held_v_head = tile.kv_head(p);
        held_v_batch = batch;
        if constexpr (Traits::kSequences) {
          held_v_map = v_tile_map;
          held_v_entry = tile.batch;
          held_v_len_k = tile.len_k(p);
        }
        continue;
      }
      const int stage = kv_loads % kStages;
      const int use = kv_loads / kStages;
      const int row = tile.key_start(n_block);
      if (use > 0) mbarrier_wait(&smem.k_empty[stage], (use - 1) & 1);
      if constexpr (Traits::kFirstOInK) wait_staged_o_left(o_in_k, o_in_k_parity, smem.o_in_k_free, stage);
      mbarrier_arrive_expect_tx(&smem.k_full[stage], Traits::kTileKV * sizeof(T));
      if constexpr (Traits::kSequences) {
        kv_boxes(smem.k_stage(stage), k_tile_map, k_map, &smem.k_full[stage], row, tile.kv_head(p), batch, tile.batch,
                 tile.len_k(p));
      } else {
        for (int c = 0; c < Traits::kColumnBlocks; ++c) {
          tma_load_4d(smem.k_stage(stage) + c * Traits::kSubTileKV, k_tile_map, &smem.k_full[stage], 64 * c, row,
                      tile.kv_head(p), batch);
        }
      }
      if constexpr (Traits::kLoadOrder == KvLoadOrder::kKAheadInTile) {  // the V of the block before
        if (n_block > n_begin) {
          load_v(kv_loads - 1, v_tile_map, row - Traits::kBlockN, tile.kv_head(p), batch, tile.batch, tile.len_k(p));
        }
        continue;
      }
      if (use > 0) mbarrier_wait(&smem.v_empty[stage], (use - 1) & 1);
      if constexpr (Traits::kLastOInV) wait_staged_o_left(o_in_v, o_in_v_parity, smem.o_in_v_free, stage);
      mbarrier_arrive_expect_tx(&smem.v_full[stage], Traits::kTileKV * sizeof(T));
      if constexpr (Traits::kSequences) {
        kv_boxes(smem.v_stage(stage), v_tile_map, v_map, &smem.v_full[stage], row, tile.kv_head(p), batch, tile.batch,
                 tile.len_k(p));
      } else {
        for (int c = 0; c < Traits::kColumnBlocks; ++c) {
          tma_load_4d(smem.v_stage(stage) + c * Traits::kSubTileKV, v_tile_map, &smem.v_full[stage], 64 * c, row,
                      tile.kv_head(p), batch);
        }
      }
    }
    // The tile's last V, before its stage is marked as O's.
    if (Traits::kLoadOrder == KvLoadOrder::kKAheadInTile && n_end > n_begin) {
      load_v(kv_loads - 1, v_tile_map, tile.key_start(n_end - 1), tile.kv_head(p), batch, tile.batch, tile.len_k(p));
    }
    if (Traits::kLastOInV && n_end > n_begin) o_in_v |= 1u << ((kv_loads - 1) % kStages);  // the tile's last block
    if (Traits::kFirstOInK && n_end > n_begin) o_in_k |= 1u << ((kv_loads - 1) % kStages);
  }

  // K ahead of V: the V held back (that of load kv_loads - 1), if any.
  __device__ void release_held_v() {
    if constexpr (Traits::kLoadOrder == KvLoadOrder::kKAheadAcrossTiles) {
      if (v_held) load_v(kv_loads - 1, held_map(), held_v_row, held_v_head, held_v_batch, held_v_entry, held_v_len_k);
      v_held = false;
    }
  }
  // After the last tile: the V still held back.
  __device__ void finish() { release_held_v(); }
  __device__ const CUtensorMap* held_map() const { return Traits::kSequences ? held_v_map : &v_map; }
};

// ---- consumer -------------------------------------------------------------------------------------------------------

// A consumer's view of a tile in the pipeline: its key blocks, the blocks this consumer computes, its Q buffer and
// barrier, and (set by mma) the V stage of its last block.
struct ConsumerTile {
  int n_begin, n_end, my_n_end;
  int q_stage, q_barrier;
  int last;
};

template <typename T, typename Traits, bool kCausal>
struct FwdConsumer {
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kStages = Traits::kStages;
  using Barrier = FwdBarrier<Traits::kConsumers>;
  using Mask = FwdMask<Traits, kCausal>;
  static constexpr bool kBand = Traits::kOptions;  // masks take a left edge too

  const SharedStorage<T, Traits>& smem;
  const FwdParams& p;
  const int consumer, warp, lane;
  const int row_in_block0;  // the thread's first row in the tile (+ 8 for its second)
  const bool negate;        // a negative scale (no softcap): scores negated, scale_log2 made positive
  const float scale_log2;
  int causal_shift;         // L_k - L_q: the call's, or (packed sequences) the current tile's
  int q_loads = 0, kv_loads = 0;
  int n_begin = 0;  // the current tile's first key block: kv_loads counts from it

  __device__ FwdConsumer(const SharedStorage<T, Traits>& storage, const FwdParams& params, int consumer_index,
                         int warp_index, int lane_index)
      : smem(storage), p(params), consumer(consumer_index), warp(warp_index), lane(lane_index),
        row_in_block0(accumulator_row0(consumer_index, warp_index, lane_index)),
        negate(!softcapped(params) && params.scale_log2 < 0.f),
        scale_log2(softcapped(params) ? params.softcap * 1.4426950408889634f : fabsf(params.scale_log2)),
        causal_shift(params.len_k - params.len_q) {}

  // Softcap: the scores become tanh(scale * q.k / softcap), which the softmax takes times softcap (> 0).
  __device__ static bool softcapped(const FwdParams& params) {
    return Traits::kCap == CapMode::kAlways || (Traits::kCap == CapMode::kPerCall && params.softcap > 0.f);
  }
  // Softcap up to kFixedReferenceMaxSoftcap with bf16 P: every row's reference is 1 (softmax.h).
  __device__ bool fixed_reference() const {
    if constexpr (Traits::kCap != CapMode::kNever && std::is_same_v<T, __nv_bfloat16>) {
      return softcapped(p) && p.softcap <= kFixedReferenceMaxSoftcap;
    } else {
      return false;
    }
  }
  // tanh's argument per raw score: the one scale of cap and of the softmax's capped pass (the same bits).
  __device__ float cap_scale() const { return p.scale / p.softcap; }
  __device__ void cap(float (&s)[kBlockN / 2]) const {
    if constexpr (Traits::kCap != CapMode::kNever) {
      if (softcapped(p)) {
        const float scale = cap_scale();
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) s[i] = fast_tanh(s[i] * scale);
      }
    }
  }

  // A block's V stage and the parity of its barriers, and its K stage (kKStages; the same where K has no more).
  __device__ int stage_of(int n_block) const { return (kv_loads + n_block - n_begin) % kStages; }
  __device__ uint32_t parity_of(int n_block) const {
    return static_cast<uint32_t>(((kv_loads + n_block - n_begin) / kStages) & 1);
  }
  __device__ int k_stage_of(int n_block) const { return (kv_loads + n_block - n_begin) % Traits::kKStages; }
  __device__ uint32_t k_parity_of(int n_block) const {
    return static_cast<uint32_t>(((kv_loads + n_block - n_begin) / Traits::kKStages) & 1);
  }

  // The ping-pong: consumer c waits for its turn before issuing its GEMMs, then lets the next one go. Every consumer
  // takes one turn per key block of a tile, including the blocks it skips, and the turns run on from tile to tile.
  __device__ void wait_turn() const { named_barrier_sync(Barrier::turn(consumer), 256); }
  __device__ void pass_turn() const {
    named_barrier_arrive(Barrier::turn((consumer + 1) % Traits::kConsumers), 256);
  }
  // Before the first tile: consumer 0 takes the first turn (the last consumer's arrival opens it). After the last:
  // consumer 0 takes up the last consumer's final hand-over, so no arrival is left over when the CTA ends.
  __device__ static void start_turns(int consumer) {
    if (consumer == Traits::kConsumers - 1) named_barrier_arrive(Barrier::turn(0), 256);
  }
  __device__ void end_turns() const {
    if (consumer == 0) named_barrier_sync(Barrier::turn(0), 256);
  }

  // Blocks n_first .. n_end - 1 without computing them: their turns, and their stages released once loaded (an
  // arrival before the load could count towards the stage's previous use, which another consumer may still be
  // reading).
  __device__ void pass_blocks(int n_first, int n_end) const {
    for (int n_block = n_first; n_block < n_end; ++n_block) {
      const int stage = stage_of(n_block);
      wait_turn();
      pass_turn();
      mbarrier_wait(&smem.k_full[k_stage_of(n_block)], k_parity_of(n_block));
      mbarrier_arrive(&smem.k_empty[k_stage_of(n_block)]);
      mbarrier_wait(&smem.v_full[stage], parity_of(n_block));
      mbarrier_arrive(&smem.v_empty[stage]);
    }
  }

  // This tile's Q buffer, and this consumer's barrier pair for it (its own part's with kQParts).
  __device__ int q_barrier_of(int q_stage) const {
    return q_stage * Traits::kQParts + (Traits::kQParts > 1 ? consumer : 0);
  }

  // The tile's pipeline position for this consumer: its key blocks, the blocks it computes, its Q buffer and barrier.
  template <typename TileT>
  __device__ ConsumerTile begin_tile(const TileT& tile, const FwdWork& work) {
    n_begin = work.n_begin;
    if constexpr (Traits::kSequences) causal_shift = tile.causal_shift(p);
    const int q_stage = q_loads % Traits::kQStages;
    return {work.n_begin, work.n_end,
            Mask::consumer_n_end(tile.m_start, consumer, causal_shift, work.n_begin, tile.num_n_blocks, work.n_end, p),
            q_stage, q_barrier_of(q_stage), 0};
  }

  // A consumer without rows in the tile (kSkipRowlessConsumers): Q released once loaded, its turns and stages passed,
  // no O. Returns whether it skipped the tile.
  template <typename TileT, typename Epilogue>
  __device__ bool skip_rowless(const TileT& tile, const ConsumerTile& ct, Epilogue& epilogue) {
    if constexpr (Traits::kSkipRowlessConsumers) {
      const int first_row = tile.m_start + 64 * consumer;
      if (first_row >= tile.len_q(p) || (Traits::kTilesEndAtLq && first_row + 64 <= 0)) {
        mbarrier_wait(&smem.q_full[ct.q_barrier], (q_loads / Traits::kQStages) & 1);
        ++q_loads;
        if (!Traits::kFirstOInQ || lane == 0) mbarrier_arrive(&smem.q_empty[ct.q_barrier]);
        pass_blocks(ct.n_begin, ct.n_end);
        kv_loads += ct.n_end - ct.n_begin;
        epilogue.release_staged_o();
        return true;
      }
    }
    return false;
  }

  // The tile's key blocks into o (unnormalised, zero on entry) and softmax (the rows' references and sums, fresh on
  // entry). Returns with the last
  // P V in flight (wait_last_pv ends it). The epilogue's staged O of the previous tile is released as soon as this
  // tile's first S GEMM is issued.
  template <typename TileT, typename Epilogue>
  __device__ void mma(const TileT& tile, ConsumerTile& ct, float (&o)[kHeadDim / 2], RowSoftmax<kBlockN>& softmax,
                      Epilogue& epilogue) {
    const int n_end = ct.n_end, my_n_end = ct.my_n_end, q_stage = ct.q_stage, q_barrier = ct.q_barrier;
    const auto edges = [&](int n_start) { return Mask::edges(n_start, tile.m_start, causal_shift, tile.len_k(p), p); };

    // A fixed reference: the first block's max cannot pass it, the later blocks' exponentials always fit (no vote).
    const bool fixed_reference = this->fixed_reference();
    if (fixed_reference) softmax.row_max[0] = softmax.row_max[1] = 1.f;
    float s[kBlockN / 2];
    uint32_t p_frag[kBlockN / 16][4];
    float rescale[2];
    int first_col[2], last_col[2];

    // The first block: S only (there is no P yet).
    mbarrier_wait(&smem.q_full[q_barrier], (q_loads / Traits::kQStages) & 1);
    ++q_loads;
    const T* const q_rows = smem.q_stage(q_stage) + consumer * 64 * 64;  // this warpgroup's rows in each sub-tile
    constexpr bool kQInRegisters = Traits::kQOperand == QOperand::kRegisters;
    [[maybe_unused]] uint32_t q_frag[kQInRegisters ? kHeadDim / 16 : 1][4];
    if constexpr (kQInRegisters) {
      load_q_fragments<T, Traits>(q_frag, q_rows, warp, lane);
      mbarrier_arrive(&smem.q_empty[q_barrier]);  // Q stays in registers for the tile
    }
    const auto issue_s = [&](const T* k_tile) {
      if constexpr (kQInRegisters) {
        issue_qk<T, Traits>(s, q_frag, k_tile);
      } else {
        issue_qk<T, Traits>(s, q_rows, k_tile);
      }
    };
    mbarrier_wait(&smem.k_full[k_stage_of(n_begin)], k_parity_of(n_begin));
    wait_turn();
    issue_s(smem.k_stage(k_stage_of(n_begin)));
    pass_turn();
    epilogue.release_staged_o();
    wgmma_wait<0>();
    wgmma_fence_registers(s);
    mbarrier_arrive(&smem.k_empty[k_stage_of(n_begin)]);
    // Q free for reuse after the last S GEMM (with O in Q the last consumer's part: the lane 0s of its warps), unless
    // it was at once (Q in registers).
    const bool q_free_after_s = !kQInRegisters && (!Traits::kFirstOInQ || (epilogue.my_o_in_v && lane == 0));
    if (q_free_after_s && my_n_end - n_begin == 1) mbarrier_arrive(&smem.q_empty[q_barrier]);
    const int first_start = tile.key_start(n_begin);
    Mask::cols(first_start, tile.m_start, row_in_block0, causal_shift, tile.len_k(p), lane, p, first_col, last_col);
    cap(s);
    // The first block moves the reference of every row that sees a key off -inf (rows that see none stay at -inf
    // under either rule; a fixed reference stays): no lazy test, which here only costs registers.
    softmax.template update<false, kBand>(s, scale_log2, negate, edges(first_start), first_col, last_col,
                                          rescale);
    pack_a<T, kBlockN>(p_frag, s);  // P as the A operand of P V

    constexpr bool kOptimisticExp = Traits::kExp == ExpPolicy::kOptimistic;
    for (int n_block = n_begin + 1; n_block < my_n_end; ++n_block) {
      const int stage = k_stage_of(n_block);  // K[n]'s; prev: V[n - 1]'s
      const int prev = stage_of(n_block - 1);
      const int n_start = tile.key_start(n_block);
      mbarrier_wait(&smem.k_full[stage], k_parity_of(n_block));
      wait_turn();
      issue_s(smem.k_stage(stage));
      mbarrier_wait(&smem.v_full[prev], parity_of(n_block - 1));
      issue_pv<T, Traits>(o, p_frag, smem.v_stage(prev));
      pass_turn();

      wgmma_wait<1>();  // S is ready; P[n-1] V[n-1] may still run
      wgmma_fence_registers(s);
      // With optimistic exponentials K[n] stays until the softmax is done, and Q (unless in registers) until the loop
      // ends: a turned-back block recomputes S from them.
      if constexpr (!kOptimisticExp) {
        mbarrier_arrive(&smem.k_empty[stage]);
        if (q_free_after_s && n_block == my_n_end - 1) mbarrier_arrive(&smem.q_empty[q_barrier]);
      }
      Mask::cols(n_start, tile.m_start, row_in_block0, causal_shift, tile.len_k(p), lane, p, first_col, last_col);
      // Exponentials against the rows' references: the optimistic policy's, and the lazy one's too in a softcap
      // kernel under a fixed reference (no reference moves: no block maximum).
      const bool against_reference = kOptimisticExp || (Traits::kCappedPass && fixed_reference);
      // Softcap on a block without masks (Traits::kCappedPass): the tanh inside the exponentials' pass; else before
      // the mask. Locked, softcap 30 D128 causal L16k: +6%.
      const bool capped_pass = Traits::kCappedPass && against_reference && edges(n_start) == 0;
      if (!capped_pass) cap(s);
      // Then wait for P[n-1] V[n-1]: O and the P registers are free again.
      const auto wait_pv = [&] {
        wgmma_wait<0>();
        wgmma_fence_registers(o);
        wgmma_fence_registers(p_frag);
      };
      // s becomes the exponentials against the references, block_sum their row sums; returns whether they can stand.
      const auto exp_against_reference = [&](float (&block_sum)[2]) {
        return capped_pass ? softmax.capped_exp_against_reference(s, cap_scale(), scale_log2, block_sum)
                           : softmax.template exp_against_reference<kBand>(s, scale_log2, negate, edges(n_start),
                                                                           first_col, last_col, block_sum);
      };
      bool moved;
      if constexpr (kOptimisticExp) {
        float block_sum[2];
        const bool fits = exp_against_reference(block_sum);
        moved = !fixed_reference && !warpgroup_all(fits, Barrier::vote(consumer));
        if (!moved) {
          softmax.row_sum[0] += block_sum[0];
          softmax.row_sum[1] += block_sum[1];
        } else {  // warpgroup-uniform, rare: S again, from the Q and K still at hand
          wait_pv();
          issue_s(smem.k_stage(stage));
          wgmma_wait<0>();
          wgmma_fence_registers(s);
          cap(s);
          softmax.template update<false, kBand>(s, scale_log2, negate, edges(n_start), first_col, last_col,
                                                rescale);
        }
        mbarrier_arrive(&smem.k_empty[stage]);
      } else if (against_reference) {  // a fixed reference: they always stand
        float block_sum[2];
        exp_against_reference(block_sum);
        softmax.row_sum[0] += block_sum[0];
        softmax.row_sum[1] += block_sum[1];
        moved = false;
      } else {
        moved = softmax.template update<true, kBand>(s, scale_log2, negate, edges(n_start), first_col, last_col,
                                                     rescale);
      }
      if constexpr (Traits::kSoftmaxUnderPV) {
        keep_before_wgmma_wait(softmax.row_sum[0] + softmax.row_sum[1], smem.scratch);
      }
      wait_pv();
      mbarrier_arrive(&smem.v_empty[prev]);
      if constexpr (kOptimisticExp) {
        if (moved) rescale_o<kHeadDim>(o, rescale);  // warp-uniform
      } else if (__any_sync(0xffffffff, moved)) {
        rescale_o<kHeadDim>(o, rescale);  // warp-uniform
      }
      pack_a<T, kBlockN>(p_frag, s);  // P as the A operand of P V
    }

    // Q free after the loop with optimistic exponentials (its last block may compute S again): here, before the last
    // P V, rather than inside the loop, where ptxas serialised the wgmmas (C7511).
    if (kOptimisticExp && q_free_after_s && my_n_end - n_begin > 1) mbarrier_arrive(&smem.q_empty[q_barrier]);
    // The last P V.
    const int last = stage_of(my_n_end - 1);
    mbarrier_wait(&smem.v_full[last], parity_of(my_n_end - 1));
    issue_pv<T, Traits>(o, p_frag, smem.v_stage(last));
    if constexpr (Traits::kSkipBlocksPastRows) pass_blocks(my_n_end, n_end);  // the blocks past this consumer's rows
    ct.last = last;
  }

  // Ends the tile's last P V and releases its V stage; kv_loads moves past the tile.
  __device__ void wait_last_pv(float (&o)[kHeadDim / 2], const ConsumerTile& done) {
    wgmma_wait<0>();
    wgmma_fence_registers(o);
    mbarrier_arrive(&smem.v_empty[done.last]);
    kv_loads += done.n_end - done.n_begin;
  }
};

}  // namespace flashattn::sm90
