// The Hopper forward's epilogue, per consumer warpgroup: the rows' sums and lse, the merge of a stream-K tile's two
// parts, and O: normalised, written by each warp into a swizzled staging buffer with stmatrix and stored with TMA (one
// store of the warp's 16 rows where D is a multiple of 64). Where O is staged (Traits::kOStaging): a buffer of the
// consumer's own, or the first consumer's one buffer / the K stage of its tile's last block / its own rows of Q and
// the last consumer's V stage of that block. A warp's staged rows are released (o_free, o_in_v_free, o_in_k_free) once
// the store has read them, which it waits for after issuing the next tile's first S GEMM (the first consumer's Q rows
// and K stage at once: the next Q or the next tile's second K loads into them).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "cuda/decode.h"
#include "cuda/params.h"
#include "cuda/ptx_common.h"
#include "cuda/row_epilogue.h"
#include "cuda/sm90/fwd_mainloop.h"
#include "cuda/sm90/fwd_traits.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/softmax.h"
#include "cuda/sm90/tile_scheduler.h"

namespace flashattn::sm90 {

// A warp's 16 rows of a tile split between two CTAs (stream-K): its part of O (unnormalised), row maxima and row sums
// in registers; `first_part`: it holds the tile's first key blocks. The warp that gets here first (a lock per
// boundary, consumer and warp) leaves them in `partial` and returns false; the other waits for them (the first is
// already writing: no wait on a CTA that may not be running), merges them into its own and returns true, and then
// stores the tile's rows as usual. The merge adds the parts in key order whichever CTA does it, so the result does
// not depend on which finished first.
template <int kHeadDim>
__device__ bool merge_split_tile(float (&o)[kHeadDim / 2], float (&row_max)[2], float (&row_sum)[2],
                                 float scale_log2, bool first_part, int* lock, int* ready, float* partial, int lane) {
  constexpr int kSums = kHeadDim / 2;  // partial: o[i] at [i][lane], then the 2 row bases and 2 row sums
  int first = 0;
  if (lane == 0) first = atomicCAS(lock, 0, 1) == 0;
  first = __shfl_sync(0xffffffff, first, 0);
  float base[2];  // log2 units: the reference each part's O and sums are relative to (RowSoftmax)
#pragma unroll
  for (int h = 0; h < 2; ++h) base[h] = softmax_base_log2(row_max[h], scale_log2);
  if (first) {
#pragma unroll
    for (int i = 0; i < kSums; ++i) __stcg(partial + i * 32 + lane, o[i]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      __stcg(partial + (kSums + h) * 32 + lane, base[h]);
      __stcg(partial + (kSums + 2 + h) * 32 + lane, row_sum[h]);
    }
    __threadfence();
    __syncwarp();
    if (lane == 0) {  // the flag after every lane's part (fence and flag in one thread: a release)
      __threadfence();
      atomicExch(ready, 1);
    }
    return false;
  }
  if (lane == 0) {
    while (*static_cast<volatile int*>(ready) == 0) __nanosleep(64);
    __threadfence();
  }
  __syncwarp();
  // first * first_scale + second * second_scale, each part rescaled to the larger of the two bases.
  const auto add_in_key_order = [&](float own, float other, float own_scale, float other_scale) {
    return first_part ? fmaf(own, own_scale, other * other_scale) : fmaf(other, other_scale, own * own_scale);
  };
  float own_scale[2], other_scale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float other_base = __ldcg(partial + (kSums + h) * 32 + lane);
    const float top = fmaxf(base[h], other_base);
    own_scale[h] = exp2f(base[h] - top);
    other_scale[h] = exp2f(other_base - top);
    row_sum[h] = add_in_key_order(row_sum[h], __ldcg(partial + (kSums + 2 + h) * 32 + lane), own_scale[h],
                                  other_scale[h]);
    row_max[h] = scale_log2 > 0.f ? top / scale_log2 : 0.f;  // the epilogue's lse takes row_max * scale_log2
  }
#pragma unroll
  for (int i = 0; i < kSums; ++i) {
    const int h = (i / 2) % 2;  // the accumulator's row (rescale_o)
    o[i] = add_in_key_order(o[i], __ldcg(partial + i * 32 + lane), own_scale[h], other_scale[h]);
  }
  return true;
}

template <typename T, typename Traits, bool kCausal>
struct FwdEpilogue {
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  using TileT = Tile<Traits, kCausal>;

  const SharedStorage<T, Traits>& smem;
  const CUtensorMap& o_map;
  const FwdParams& p;
  const int consumer, warp, lane;
  // This consumer's staging buffer: the V stage of its tile's last key block (the last consumer, where O is staged in
  // V), that block's K stage (the first consumer, O in K), its Q rows (the first, O in Q) or a buffer.
  const bool my_o_in_v, my_o_in_k;
  const int o_buffer;
  int o_stores = 0;     // tiles whose O this consumer has staged in its buffer
  int o_release = 0;    // the barrier that frees the warp's staged rows: o_free[o_release] (o_in_v_free and
                        // o_in_k_free follow o_free)
  bool o_staged = false;  // staged rows not yet released
  float part_lse[2];      // a key split's: the lse of the thread's two rows' part (row_totals)

  __device__ FwdEpilogue(const SharedStorage<T, Traits>& storage, const CUtensorMap& map, const FwdParams& params,
                         int consumer_index, int warp_index, int lane_index)
      : smem(storage), o_map(map), p(params), consumer(consumer_index), warp(warp_index), lane(lane_index),
        my_o_in_v(Traits::kLastOInV && consumer_index == Traits::kConsumers - 1),
        my_o_in_k(Traits::kFirstOInK && consumer_index == 0), o_buffer(Traits::kOBuffers == 1 ? 0 : consumer_index) {}

  // The warp's staged O rows are released once the TMA stores have read them.
  __device__ void release_staged_o() {
    if constexpr (Traits::kOBuffers > 0 || Traits::kLastOInV) {
      if (o_staged && lane == 0) {
        bulk_wait_group_read<0>();
        mbarrier_arrive(&smem.o_free[Traits::kLastOInV ? o_release : 4 * o_buffer + warp]);
      }
      o_staged = false;
    }
  }

  // Row `row` of the tile's (batch, head) in a key split's parts (decode.h: the combine's rows).
  __device__ int64_t part_row(const TileT& tile, int split, int row) const {
    return decode_split_part(p, split, (static_cast<int64_t>(tile.batch) * p.heads + tile.head) * p.len_q + row);
  }

  // A tile no row of which sees a key: out = 0, lse = -inf or the head's sink (every consumer thread takes its share);
  // a key split's part: zeros, lse -inf.
  __device__ void store_keyless(const TileT& tile) {
    if constexpr (TileT::kSequences) {  // sequences variants only: the dead branch still moved the plain kernels' code
      if (TileT::split_part(p)) {
        store_keyless_part(tile);
        return;
      }
    }
    T* const o_base = tile.template out<T>(p);
    float* const lse_base = tile.lse(p);
    const int m_end = tile.m_end(p);
    const int pairs_per_row = p.head_dim / 2;
    const int thread = threadIdx.x - 128;
    constexpr int kConsumerThreads = Traits::kConsumers * 128;
    const int m_first = tile.m_first();
    for (int i = thread; i < (m_end - m_first) * pairs_per_row; i += kConsumerThreads) {
      const int row = m_first + i / pairs_per_row;
      *reinterpret_cast<uint32_t*>(o_base + static_cast<int64_t>(row) * p.o_row_stride + 2 * (i % pairs_per_row)) = 0;
    }
    const float keyless_lse = Traits::kOptions && p.sinks != nullptr ? p.sinks[tile.head] : -INFINITY;
    for (int row = m_first + thread; row < m_end; row += kConsumerThreads) lse_base[row] = keyless_lse;
    release_staged_o();
  }
  __device__ void store_keyless_part(const TileT& tile) {
    if (p.plan.splits_in_turn) {
      fold_keyless_in_turn(tile);
      release_staged_o();
      return;
    }
    const int thread = threadIdx.x - 128;
    constexpr int kConsumerThreads = Traits::kConsumers * 128;
    constexpr int kChunks = kHeadDim / 4;  // float4 chunks of a part's row
    const int m_first = tile.m_first(), rows = tile.m_end(p) - m_first;
    for (int i = thread; i < rows * kChunks; i += kConsumerThreads) {
      float4* const row = reinterpret_cast<float4*>(p.split_out + part_row(tile, tile.split, m_first + i / kChunks) *
                                                                      kHeadDim);
      row[i % kChunks] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int i = thread; i < rows; i += kConsumerThreads) {
      p.split_lse[part_row(tile, tile.split, m_first + i)] = -INFINITY;
    }
    release_staged_o();
  }

  // The rows' totals: inv (1 / sum, 0 for a row without keys) and, with store_lse, their lse; with sinks (options
  // variants, never split) the sink joins the sum, and a row whose keys weigh nothing has the sink as its lse. Taken
  // while the last P V runs (it changes only O); a stream-K tile has them again after the merge.
  __device__ void row_totals(const RowSoftmax<Traits::kBlockN>& softmax, const TileT& tile, int row_in_block0,
                             int causal_shift, float scale_log2, bool store_lse, float (&inv)[2]) {
    float* const lse_base = tile.lse(p);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = softmax.row_sum[h];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const int row = tile.m_start + row_in_block0 + 8 * h;
      if constexpr (TileT::kSequences) {
        if (TileT::split_part(p)) {
          // A key split's part: a row without keys in the split (sum 0) has zeros and lse -inf, whatever it sees
          // elsewhere; the combine adds the sink and tells a row whose scores were all -inf (NaN) from one without
          // keys.
          const float base = softmax.row_max[h] * scale_log2;
          inv[h] = sum == 0.f ? 0.f : 1.f / sum;
          part_lse[h] = sum == 0.f ? -INFINITY : row_lse(true, base, sum);
          if (!p.plan.splits_in_turn && row < tile.len_q(p) && lane % 4 == 0) {
            p.split_lse[part_row(tile, tile.split, row)] = part_lse[h];
          }
          continue;
        }
      }
      using Mask = FwdMask<Traits, kCausal>;
      const bool sees_keys = Traits::kOptions
                                 ? row_sees_band(row, causal_shift, Mask::left(p), Mask::right(p), tile.len_k(p))
                                 : row_sees_keys<kCausal>(row, causal_shift);
      float base = softmax.row_max[h] * scale_log2;
      float keep = 1.f;
      const bool sinks = Traits::kOptions && p.sinks != nullptr;
      if (sinks) keep = add_sink(p.sinks[tile.head], base, sum);
      inv[h] = sees_keys ? (Traits::kOptions ? keep / sum : 1.f / sum) : 0.f;  // a row without keys: out = 0
      if (store_lse && (!Traits::kTilesEndAtLq || row >= 0) && row < tile.len_q(p) && lane % 4 == 0) {
        lse_base[row] = sinks && lse_is_sink(sees_keys, keep, sum) ? p.sinks[tile.head] : row_lse(sees_keys, base, sum);
      }
    }
  }

  // A stream-K tile: one warp of the two holding these rows hands its part to the other. Returns whether this one
  // stores the rows (the merged O, softmax's references and sums updated).
  __device__ bool merge_split(float (&o)[kHeadDim / 2], RowSoftmax<Traits::kBlockN>& softmax, const FwdWork& work,
                              float scale_log2) const {
    const int boundary = static_cast<int>(blockIdx.x) - (work.n_begin > 0 ? 1 : 0);  // the CTA with blocks 0 ..
    const int slot = stream_k_slot(boundary, consumer, warp);
    const int slots = static_cast<int>(gridDim.x) * kStreamKSlotsPerCta;
    float* const partial = p.sk_partial + slot * stream_k_partial_floats(kHeadDim);
    return merge_split_tile<kHeadDim>(o, softmax.row_max, softmax.row_sum, scale_log2, work.n_begin == 0,
                                      p.sk_flags + slot, p.sk_flags + slots + slot, partial, lane);
  }

  // Each warp writes its 16 rows of O, normalised, into its staging buffer with stmatrix, in the 128-byte swizzle the
  // tensor map reads, and its lane 0 stores them with TMA. store_o false: only the buffer's bookkeeping (the other CTA
  // stores this stream-K tile).
  template <typename Mainloop>
  __device__ void store(const float (&o)[kHeadDim / 2], const float (&inv)[2], const TileT& tile,
                        const ConsumerTile& done, const Mainloop& mainloop, bool store_o) {
    const int sub_tile = Traits::kFirstOInQ && !my_o_in_v ? Traits::kSubTileQ : Traits::kSubTileO;  // 64 columns apart
    T* staging = smem.q_stage(done.q_stage) + consumer * 64 * 64;
    if (my_o_in_k) {
      // The K stage of the tile's last block (kv_loads counts it last), once every consumer's S GEMM has read it.
      const int tile_last = (mainloop.kv_loads - 1) % kStages;
      mbarrier_wait(&smem.k_empty[tile_last], mainloop.parity_of(done.n_begin - 1));
      staging = smem.k_stage(tile_last);
      o_release = 4 * Traits::kOBuffers + (Traits::kLastOInV ? kStages : 0) + tile_last;
    } else if (my_o_in_v) {
      // Every consumer's last P V has read this V stage (the producer reloads it only after o_in_v_free). kv_loads
      // already counts the tile's blocks, hence the shift by n_end - n_begin; spelt this way because other
      // spellings of the same parity made ptxas serialise the wgmmas at D128 (C7511).
      mbarrier_wait(&smem.v_empty[done.last], mainloop.parity_of(done.my_n_end - 1 + done.n_begin - done.n_end));
      staging = smem.v_stage(done.last);
      o_release = 4 * Traits::kOBuffers + done.last;
    } else if (!Traits::kFirstOInQ) {
      // The previous use of this warp's rows released (a fresh barrier's phase before its first counts as done).
      mbarrier_wait(&smem.o_free[4 * o_buffer + warp], (o_stores & 1) ^ 1);
      ++o_stores;
      staging = smem.o_buffer(o_buffer);
      o_release = 4 * o_buffer + warp;
    }
    // The warp's rows: in each 64-column sub-tile, or (one store) its own 16 rows of every 64-column block in turn.
    const bool one_store = Traits::o_one_store(p.head_dim);
    T* const warp_rows = staging + warp * 16 * (one_store ? kHeadDim : 64);
    const int block_stride = one_store ? 16 * 64 : sub_tile;
    const int matrix = lane / 8;                  // lanes 8m .. 8m + 7 address matrix m's rows
    const int row = lane % 8 + 8 * (matrix % 2);  // matrices: rows 0-7, 8-15 of chunk j, then j + 1
    if (store_o) {
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; j += 2) {  // 8-column chunks j and j + 1
        const int chunk = j + matrix / 2;
        T* const dst = warp_rows + (chunk / 8) * block_stride + sw128_offset(row, chunk % 8);
        stmatrix_x4(dst, pack2<T>(o[4 * j] * inv[0], o[4 * j + 1] * inv[0]),
                    pack2<T>(o[4 * j + 2] * inv[1], o[4 * j + 3] * inv[1]),
                    pack2<T>(o[4 * j + 4] * inv[0], o[4 * j + 5] * inv[0]),
                    pack2<T>(o[4 * j + 6] * inv[1], o[4 * j + 7] * inv[1]));
      }
      fence_proxy_async_smem();  // the TMA (async proxy) reads what the threads wrote
    }
    __syncwarp();
    if (lane == 0) {
      const int first_row = tile.m_start + 64 * consumer + 16 * warp;
      // No TMA store before row 0 (tiles that end at L_q).
      if (store_o && first_row < tile.len_q(p) && (!Traits::kTilesEndAtLq || first_row >= 0)) {
        const CUtensorMap* const map = tile.map(&o_map, kSeqMapO, p);
        if constexpr (Traits::kSequences) fence_tensormap_acquire(map);
        if (one_store) {
          tma_store_5d(map, warp_rows, 0, first_row, 0, tile.head, tile.tma_batch());
        } else {
#pragma unroll
          for (int c = 0; c < Traits::kColumnBlocks; ++c) {
            if (64 * c < p.head_dim) {
              tma_store_4d(map, warp_rows + c * sub_tile, 64 * c, first_row, tile.head, tile.tma_batch());
            }
          }
        }
      }
      bulk_commit_group();
      if (Traits::kFirstOInQ && !my_o_in_v) {
        bulk_wait_group_read<0>();  // Q's rows may be loaded again
        mbarrier_arrive(&smem.q_empty[done.q_barrier]);
      }
      if (my_o_in_k) {
        bulk_wait_group_read<0>();  // the K stage may be loaded again
        mbarrier_arrive(&smem.o_free[o_release]);
      }
    }
    // Released by release_staged_o.
    o_staged = (!Traits::kFirstOInQ || my_o_in_v) && !my_o_in_k;
  }

  // ---- key splits of a KV cache's tiles (Tile::split_part) ----

  __device__ int row_in_block0() const { return accumulator_row0(consumer, warp, lane); }

  // A split's rows, once the last P V is done: its part to the workspace (a CTA per split, for the combine), or
  // folded into this thread's state (splits in turn), whose last split leaves the folded rows in o and their factor
  // in inv. Returns whether o is then stored as any tile's rows.
  __device__ bool finish_split(float (&o)[kHeadDim / 2], float (&inv)[2], const TileT& tile) const {
    if (!TileT::split_part(p)) return true;
    if (!p.plan.splits_in_turn) {
      store_part(o, inv, tile);
      return false;
    }
    return fold_in_turn(o, inv, part_lse, tile);
  }

  // The part of the thread's two rows, normalised: 8-byte stores, a quad of lanes 32 bytes of a row.
  __device__ void store_part(const float (&o)[kHeadDim / 2], const float (&inv)[2], const TileT& tile) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = tile.m_start + row_in_block0() + 8 * h;
      if (row >= tile.len_q(p)) continue;
      float* const dst = p.split_out + part_row(tile, tile.split, row) * kHeadDim + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        __stcg(reinterpret_cast<float2*>(dst + 8 * j),
               make_float2(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]));
      }
    }
  }

  // Splits in turn: the thread's fold of its rows' parts so far (row_epilogue.h: SplitFold, the combine's arithmetic,
  // so that a row has the same bits either way), kept in the workspace between a tile's splits: its accumulator's
  // kHeadDim / 2 values, then each row's running maximum and sum, 128 threads apart (a slot per CTA and consumer).
  __device__ float* fold_state() const {
    constexpr int kFloats = kHeadDim / 2 + 4;
    return p.split_out + (static_cast<int64_t>(blockIdx.x) * Traits::kConsumers + consumer) * kFloats * 128 +
           threadIdx.x % 128;
  }
  // Folds the split's part (o * inv, lse part_lse[h]; -inf: no key of the row in the split) into the state; at the
  // tile's last split finishes the rows (the sink joins them), writes their lse and returns true with the folded rows
  // in o and their factor in inv.
  __device__ bool fold_in_turn(float (&o)[kHeadDim / 2], float (&inv)[2], const float (&lse_of_part)[2],
                               const TileT& tile) const {
    constexpr int kSums = kHeadDim / 2;
    float* const state = fold_state();
    const bool first = tile.split == 0, last = tile.split == p.plan.splits - 1;
    SplitFold fold[2];
    float alpha[2], beta[2];
    bool taken[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      fold[h] = first ? SplitFold{-INFINITY, 0.f} : SplitFold{state[(kSums + h) * 128], state[(kSums + 2 + h) * 128]};
      taken[h] = fold_part(fold[h], lse_of_part[h], alpha[h], beta[h]);
    }
    // The state in chunks of loads issued together (one round trip each; loads behind a branch each went one by one).
    constexpr int kChunk = 16;
    static_assert(kSums % kChunk == 0, "whole chunks");
#pragma unroll
    for (int c = 0; c < kSums; c += kChunk) {
      float acc[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) acc[i] = 0.f;
      if (!first) {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) acc[i] = __ldcg(state + (c + i) * 128);
      }
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const int h = ((c + i) / 2) % 2;  // the accumulator's row (rescale_o)
        o[c + i] = taken[h] ? fold_add(acc[i], alpha[h], o[c + i] * inv[h], beta[h]) : acc[i];
      }
      if (!last) {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) __stcg(state + (c + i) * 128, o[c + i]);
      }
    }
    if (!last) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        state[(kSums + h) * 128] = fold[h].m;
        state[(kSums + 2 + h) * 128] = fold[h].sum;
      }
      return false;
    }
    using Mask = FwdMask<Traits, kCausal>;
    float* const lse_base = tile.lse(p);
    const float sink = p.sinks != nullptr ? p.sinks[tile.head] : -INFINITY;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = tile.m_start + row_in_block0() + 8 * h;
      const bool sees_keys = row_sees_band(row, tile.causal_shift(p), Mask::left(p), Mask::right(p), tile.len_k(p));
      float lse;
      inv[h] = fold_finish(fold[h], sink, sees_keys, lse);
      if (row < tile.len_q(p) && lane % 4 == 0) lse_base[row] = lse;
    }
    return true;
  }

  // A split without keys of the tile run in turn: an empty part folded in; at the last split the rows stored from the
  // registers (not staged: the tile has no pipeline stage of its own). A consumer without rows in the tile skipped its
  // other splits (kSkipRowlessConsumers) and has no state to fold.
  __device__ void fold_keyless_in_turn(const TileT& tile) const {
    if (tile.m_start + 64 * consumer >= tile.len_q(p)) return;
    float o[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
    float inv[2] = {0.f, 0.f};
    const float no_keys[2] = {-INFINITY, -INFINITY};
    if (!fold_in_turn(o, inv, no_keys, tile)) return;
    T* const out = tile.template out<T>(p);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = tile.m_start + row_in_block0() + 8 * h;
      if (row >= tile.len_q(p)) continue;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(row) * p.o_row_stride + col) =
              pack2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
        }
      }
    }
  }
};

}  // namespace flashattn::sm90
