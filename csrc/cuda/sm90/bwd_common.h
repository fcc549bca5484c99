// Pieces shared by the Hopper backward kernels (bwd_kernel.h for head dims up to 128, bwd_split_kernel.h for 256).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/packed.h"
#include "cuda/params.h"
#include "cuda/ptx_common.h"
#include "cuda/sm90/named_barrier.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/sequences.h"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/wgmma_ops.h"

namespace flashattn::sm90 {

// The wgmma accumulator of 64 x kBlockM (rows = this thread's keys, columns = queries, or head-dim columns) into
// kBlockM / 64 sub-tiles of 64 columns, kSubTileStride elements apart, in the 128-byte swizzle (16-byte chunk c of row
// r at c ^ (r % 8)), times `scale`, 4-byte stores of column pairs.
template <typename T, int kBlockM, int kSubTileStride = 64 * 64>
__device__ __forceinline__ void store_swizzled_tile(T* tile, const float (&acc)[kBlockM / 2], int warp, int lane,
                                                    float scale = 1.f) {
  static_assert(kBlockM % 64 == 0, "whole 128-byte swizzle rows");
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * warp + lane / 4 + 8 * h;  // columns 8 j + 2 (lane % 4): chunk j % 8 of sub-tile j / 8
      T* const sub_tile = tile + (j / 8) * kSubTileStride;
      *reinterpret_cast<uint32_t*>(sub_tile + row * 64 + (((j % 8) ^ (row % 8)) * 8) + 2 * (lane % 4)) =
          pack2<T>(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
    }
  }
}

// dS^T (64 keys x kBlockM queries, packed as wgmma A registers by pack_a: register i of k16 step kk holds the 8x8
// fragment of queries 16 kk + 8 (i / 2) .. and keys 16 warp + 8 (i % 2) ..) to a [kBlockM queries][64 keys] tile in
// the 128-byte swizzle, dS as a K-major operand: one transposing stmatrix per k16 step, lane l giving the address of
// row l % 8 of fragment l / 8.
template <typename T, int kBlockM>
__device__ __forceinline__ void store_transposed_tile(T* tile, const uint32_t (&a)[kBlockM / 16][4], int warp,
                                                      int lane) {
  const int fragment = lane / 8;
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) {
    const int row = 16 * kk + 8 * (fragment / 2) + lane % 8;
    stmatrix_x4_trans(tile + sw128_offset(row, 2 * warp + fragment % 2), a[kk][0], a[kk][1], a[kk][2], a[kk][3]);
  }
}

// dQ^T (64 head-dim rows x kBlockM query columns, a wgmma accumulator) into two [kBlockM queries][32 columns] boxes
// of the 128-byte swizzle, as the TMA map of dq_accum reads them: 4-byte stores, each on 32 banks (a store's 8 columns
// span two 16-byte chunks, which its 4 rows' swizzle spreads over all 8).
template <int kBlockM>
__device__ __forceinline__ void store_transposed_fp32_tile(float* tile, const float (&acc)[kBlockM / 2], int warp,
                                                           int lane) {
  float* const box = tile + (warp / 2) * kBlockM * 32;
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 16 * (warp % 2) + lane / 4 + 8 * (i / 2);
      const int row = 8 * j + 2 * (lane % 4) + i % 2;
      box[row * 32 + ((col / 4) ^ (row % 8)) * 4 + col % 4] = acc[4 * j + i];
    }
  }
}

// A block of kBlockN keys of one (batch, kv head), and the query blocks that see it. Blocks start in index order (a
// CTA each, or taken in turn from BwdTileScheduler), key blocks numbered fastest, so under a causal mask (within a kv
// head) the blocks that see the most queries go first; with an ordered dQ (p.dq_semaphore) the causal order turns
// round (the shortest first), matching the order of the dQ additions. Without a mask, p.ordered_interleave pairs
// take turns, so that a block starts that many CTAs after the one whose additions it waits for (always an earlier one).
// kOptions: a sliding window's band (BwdParams::window_left / window_right, causal meaning a right edge) bounds the
// query blocks on both sides. kSequences: packed sequences, CTA = a slot of packed.h's grid over each kv head's keys;
// rows and keys count from the sequence's first, and TMA goes through the sequence's own maps (sequences.h) at batch
// coordinate 0. Ordered, a sequence's key blocks add in their start order (highest first under a right edge, as dense
// ones) into semaphores over packed.h's query slots, unless the host flagged cu_seqlens that break their rules (the
// int after the semaphores), where a turn could go unreached: dQ then adds in any order.
template <typename Traits, bool kCausal, bool kOptions = false, bool kSequences = false>
struct KeyBlock {
  static constexpr bool kPacked = kSequences;
  int n_block, n_start, kv_head, batch, m_begin, m_end, num_m_blocks;
  int q_offset = 0, k_offset = 0, seq_len_q = 0, seq_len_k = 0;  // packed sequences: first rows and lengths
  int q_slot0 = 0;  // packed, ordered: the sequence's first query block in packed.h's slots
  bool ordered;     // dQ added in a fixed order (p.dq_semaphore)

  // Key blocks are numbered 0 .. num_blocks(p) - 1 (a grid of one CTA each, or the tiles of BwdTileScheduler).
  __host__ __device__ static int num_blocks(const BwdParams& p) {
    if constexpr (kSequences) return packed_slots(p.len_k, p.batch, Traits::kBlockN) * p.heads_kv;
    return (p.len_k + Traits::kBlockN - 1) / Traits::kBlockN * p.heads_kv * p.batch;
  }
  __device__ KeyBlock(const BwdParams& p, int index) {
    if constexpr (kSequences) {
      const int slots = packed_slots(p.len_k, p.batch, Traits::kBlockN);
      const PackedBlock b = find_packed_block(p.cu_seqlens_k, p.len_k, p.cu_seqlens_q, p.len_q, p.batch,
                                              Traits::kBlockN, index % slots);
      kv_head = index / slots;
      batch = b.batch;
      k_offset = b.row, seq_len_k = b.len, q_offset = b.other_row, seq_len_q = b.other_len;
      q_slot0 = q_offset / Traits::kBlockM + b.batch;
      ordered = p.dq_semaphore != nullptr && __ldg(p.dq_semaphore + num_packed_semaphores(p)) == 0;
      // Ordered under a right edge: the sequence's blocks highest first, as dense causal ones (an idle slot stays).
      const int seq_blocks = (b.len + Traits::kBlockN - 1) / Traits::kBlockN;
      n_block = kCausal && ordered && b.block < seq_blocks ? seq_blocks - 1 - b.block : b.block;
    } else {
      ordered = p.dq_semaphore != nullptr;
      const int num_n_blocks = (p.len_k + Traits::kBlockN - 1) / Traits::kBlockN;
      n_block = index % num_n_blocks;
      int pair = index / num_n_blocks;  // (batch, kv head)
      if (kCausal && p.dq_semaphore != nullptr) n_block = num_n_blocks - 1 - n_block;
      if (!kCausal && ordered && p.ordered_interleave > 1) {  // groups of pairs (the last may be smaller), in turn
        const int group = index / (p.ordered_interleave * num_n_blocks);
        const int pairs = min(p.ordered_interleave, p.batch * p.heads_kv - group * p.ordered_interleave);
        const int within = index - group * p.ordered_interleave * num_n_blocks;
        n_block = within / pairs;
        pair = group * p.ordered_interleave + within % pairs;
      }
      kv_head = pair % p.heads_kv;
      batch = pair / p.heads_kv;
    }
    n_start = n_block * Traits::kBlockN;
    num_m_blocks = (len_q(p) + Traits::kBlockM - 1) / Traits::kBlockM;
    // Causal: query i sees key j iff j <= i + Lk - Lq + right, so the first query that sees key n_start is
    // n_start - (Lk - Lq) - right (without a left edge the last query sees every key, so some query block always
    // remains); under a left edge the last query that sees the block's last key is that key - (Lk - Lq) + left.
    const int shift = len_k(p) - len_q(p);
    m_begin = kCausal ? max(0, n_start - shift - right(p)) / Traits::kBlockM : 0;
    m_end = num_m_blocks;
    if (kOptions && left(p) >= 0) {
      const int row_end = max(0, min(len_q(p), n_start + Traits::kBlockN - shift + left(p)));
      m_end = max(m_begin, (row_end + Traits::kBlockM - 1) / Traits::kBlockM);
    }
    // An idle slot (or, from cu_seqlens that break their rules, one before its sequence's first key).
    if (kSequences && (n_start < 0 || n_start >= len_k(p))) m_begin = m_end = 0;
  }
  __device__ static int left(const BwdParams& p) { return kOptions ? p.window_left : -1; }
  __device__ static int right(const BwdParams& p) { return kCausal ? (kOptions ? p.window_right : 0) : -1; }
  // The queries and keys of its (batch, kv head) or sequence.
  __device__ int len_q(const BwdParams& p) const { return kSequences ? seq_len_q : p.len_q; }
  __device__ int len_k(const BwdParams& p) const { return kSequences ? seq_len_k : p.len_k; }
  // Whether the step's queries m_start .. + kBlockM - 1 see none of the 64 keys key_start .. + 63: all past L_k, or
  // beyond the band's right edge of its last query, or before the left edge of its first (a band's rows see one
  // contiguous range of keys). Terms as mask.h's band_step_edges.
  __device__ bool keys_unseen(int m_start, int key_start, int causal_shift, const BwdParams& p) const {
    const int last_query = min(m_start + Traits::kBlockM, len_q(p)) - 1;
    return key_start >= len_k(p) || (right(p) >= 0 && key_start > last_query + causal_shift + right(p)) ||
           (left(p) >= 0 && key_start + 63 < m_start + causal_shift - left(p));
  }
  // Row `key`'s element offset in dk or dv (its batch, head and row strides): in the batch entry, or packed
  // (total_k, Hk, D) in the sequence's rows from k_offset.
  __device__ int64_t kv_offset(int key, int64_t batch_stride, int64_t head_stride, int64_t row_stride) const {
    const int64_t row = kSequences ? static_cast<int64_t>(k_offset) + key : key;
    return (kSequences ? 0 : batch * batch_stride) + kv_head * head_stride + row * row_stride;
  }
  // The tensor map (BwdSeqMap) its TMA goes through, `dense` but for packed sequences, and the batch coordinate.
  __device__ const CUtensorMap* map(const CUtensorMap* dense, BwdSeqMap which, const BwdParams& p) const {
    if constexpr (kSequences) return static_cast<const CUtensorMap*>(p.seq_maps) + batch * kBwdSeqMaps + which;
    return dense;
  }
  __device__ int tma_batch() const { return kSequences ? 0 : batch; }

  // The consumers' steps: every query block that sees the keys, for every query head of the kv head's group.
  __device__ int steps_per_head() const { return m_end - m_begin; }
  __device__ int num_steps(const BwdParams& p) const { return p.heads_per_kv * steps_per_head(); }
  __device__ int head(int step, const BwdParams& p) const { return kv_head * p.heads_per_kv + step / steps_per_head(); }
  __device__ int m_start(int step) const { return (m_begin + step % steps_per_head()) * Traits::kBlockM; }
  // Offset of the step's head in the (B, H, Lq) row arrays, or (H, total_q) packed: lse, delta, (times D) dq_accum.
  __device__ int64_t row_base(int step, const BwdParams& p) const {
    if constexpr (kSequences) return static_cast<int64_t>(head(step, p)) * p.len_q + q_offset;
    return (static_cast<int64_t>(batch) * p.heads + head(step, p)) * p.len_q;
  }

  // Packed, ordered: the semaphores (H, packed_slots(total_q, B, kBlockM), kBwdDqSemaphores), then the host's flag.
  __device__ static int64_t num_packed_semaphores(const BwdParams& p) {
    return static_cast<int64_t>(p.heads) * packed_slots(p.len_q, p.batch, Traits::kBlockM) * kBwdDqSemaphores;
  }

  // Ordered dQ: how many key blocks add into query block m before this one. The blocks that see m are consecutive
  // (its rows' band is): from the first whose last key reaches the left edge of m's first row (the m_end rule), to
  // the last that the right edge of m's last row reaches, key block n seeing m iff n * kBlockN - (Lk - Lq) - right <
  // (m + 1) * kBlockM (the m_begin rule). Under a right edge (causal) they add highest first, as KeyBlock starts them
  // (the shortest first); without one ascending (the CTAs' launch order). Packed: within the sequence.
  __device__ int dq_turn(int m_block, const BwdParams& p) const {
    if (!kCausal) {
      return n_block - first_key_block(m_block * Traits::kBlockM, len_k(p) - len_q(p), left(p), Traits::kBlockN);
    }
    const int64_t reach = static_cast<int64_t>(m_block + 1) * Traits::kBlockM + (len_k(p) - len_q(p)) + right(p);
    const int num_n_blocks = (len_k(p) + Traits::kBlockN - 1) / Traits::kBlockN;
    const int64_t seeing = (reach + Traits::kBlockN - 1) / Traits::kBlockN;  // reach > 0 where this block sees m
    return static_cast<int>(seeing < num_n_blocks ? seeing : num_n_blocks) - 1 - n_block;
  }
  // The semaphore of dQ writer `writer` (0, 1) in the step's query block.
  __device__ int* dq_semaphore(int step, int writer, const BwdParams& p) const {
    const int64_t m_block = m_start(step) / Traits::kBlockM;
    if constexpr (kSequences) {
      const int64_t slot = static_cast<int64_t>(head(step, p)) * packed_slots(p.len_q, p.batch, Traits::kBlockM) +
                           q_slot0 + m_block;
      return p.dq_semaphore + slot * kBwdDqSemaphores + writer;
    }
    const int64_t head_block = (static_cast<int64_t>(batch) * p.heads + head(step, p)) * num_m_blocks + m_block;
    return p.dq_semaphore + head_block * kBwdDqSemaphores + writer;
  }
};

// A step's per-query statistic (lse or delta, in shared memory by query) at this thread's accumulator columns
// 8 j + 2 (lane % 4) + {0, 1}: kBlockM / 8 pairs in registers, one 8-byte load each.
template <int kBlockM>
struct ColumnPairs {
  float2 pairs[kBlockM / 8];

  __device__ void load(const float* values, int lane) {
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) pairs[j] = reinterpret_cast<const float2*>(values)[4 * j + lane % 4];
  }
  // The value of accumulator entry 4 j + i (column 8 j + 2 (lane % 4) + i % 2).
  __device__ float at(int j, int i) const { return i % 2 ? pairs[j].y : pairs[j].x; }
};

// P^T = exp2(S^T * scale_log2 - lse_log2) for this thread's two keys (key0, key0 + 8) and the step's kBlockM queries,
// then 0 for queries past Lq, keys past Lk and (causal) key > query + causal_shift; only blocks at an edge test them,
// in a branch that interior blocks skip.
template <bool kCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ void masked_probabilities(float (&s)[kBlockM / 2], const ColumnPairs<kBlockM>& lse_log2,
                                                     float scale_log2, int len_q, int len_k, int m_start, int n_start,
                                                     int causal_shift, int key0, int lane) {
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[4 * j + i] = fast_exp2(fmaf(s[4 * j + i], scale_log2, -lse_log2.at(j, i)));
  }
  if (m_start + kBlockM > len_q || n_start + kBlockN > len_k ||
      (kCausal && n_start + kBlockN - 1 > m_start + causal_shift)) {
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = key0 + 8 * (i / 2);
        const int query = m_start + 8 * j + 2 * (lane % 4) + i % 2;
        if (query >= len_q || key >= len_k || (kCausal && key > query + causal_shift)) s[4 * j + i] = 0.f;
      }
    }
  }
}

// lse and delta of one query row, loaded a step ahead of their use, with the sm80 kernel's rule for rows that
// contribute nothing (past Lq, or lse = -inf: they see no key): +inf in the exponent, so exp2(x - inf) = 0, and
// delta 0, so that a non-finite dlse there cannot turn 0 * inf into NaN.
struct RowStats {
  static constexpr float kLog2e = 1.4426950408889634f;
  float lse = -INFINITY, delta = 0.f;

  __device__ void load(const BwdParams& p, int64_t row_base, int row, int len_q, bool with_delta) {
    lse = row < len_q ? p.lse[row_base + row] : -INFINITY;
    delta = with_delta && row < len_q ? p.delta[row_base + row] : 0.f;
  }
  __device__ float lse_log2() const { return lse != -INFINITY ? lse * kLog2e : INFINITY; }
  __device__ float delta_or_zero() const { return lse != -INFINITY ? delta : 0.f; }
};

// kRows key rows (the block's keys first_row ..) of kHeadDim columns, staged in shared memory as 64-column sub-tiles
// kSubTileStride elements apart ([kRows][64] each, 128-byte swizzle), to dk or dv (`value_grads`; rows at
// KeyBlock::kv_offset): 16 bytes a thread, consecutive threads along a row, so that each store instruction writes whole
// 128-byte lines; rows past Lk and columns past the head dim are skipped. Thread `thread` of kThreads.
template <typename T, int kHeadDim, int kRows, int kThreads, int kSubTileStride, typename Block>
__device__ __forceinline__ void store_key_rows(const BwdParams& p, const Block& block, const T* tile, bool value_grads,
                                               int first_row, int thread) {
  T* const dst = static_cast<T*>(value_grads ? p.dv : p.dk);
  const int64_t batch_stride = value_grads ? p.dv_batch_stride : p.dk_batch_stride;
  const int64_t head_stride = value_grads ? p.dv_head_stride : p.dk_head_stride;
  const int64_t row_stride = value_grads ? p.dv_row_stride : p.dk_row_stride;
  constexpr int kChunks = kHeadDim / 8;  // per row
  static_assert(kRows * kChunks % kThreads == 0, "whole rounds of chunks");
#pragma unroll
  for (int round = 0; round < kRows * kChunks / kThreads; ++round) {
    const int index = thread + round * kThreads;
    const int row = index / kChunks, chunk = index % kChunks;
    const int key = block.n_start + first_row + row;
    if (key < block.len_k(p) && chunk * 8 < p.head_dim) {
      const uint4 value = *reinterpret_cast<const uint4*>(tile + (chunk / 8) * kSubTileStride + row * 64 +
                                                          ((chunk % 8) ^ (row % 8)) * 8);
      *reinterpret_cast<uint4*>(dst + block.kv_offset(key, batch_stride, head_stride, row_stride) + chunk * 8) = value;
    }
  }
}

// The first 64 columns of a 64-row fp32 accumulator (kRegs registers, 32 of them) into two [64 rows][32 columns]
// boxes in the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), as the TMA map of dq_accum reads them:
// 8-byte stores. A half-warp's rows have r % 8 in 0..3 or 4..7; were every lane to store the same columns at once,
// rows r and r ^ 1 would hit the same two chunks (4 wavefronts a store instead of 2), so lanes of odd rows store
// column group j ^ 2 while the others store j.
template <int kRegs>
__device__ __forceinline__ void store_swizzled_fp32_tile(float* tile, const float (&acc)[kRegs], int warp, int lane) {
  static_assert(kRegs >= 32, "a 64-column accumulator at least");
  const int odd = (lane / 4) % 2;
  // The chunk this lane writes at step j: 2 (j % 4) ^ chunk_xor (the swap flips bit 2, the row's swizzle bits 0-2).
  const int chunk_xor = ((lane % 4) / 2) ^ (4 * odd) ^ (lane / 4);
  float* const row_base = tile + (16 * warp + lane / 4) * 32 + 2 * (lane % 2);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int jj = j ^ 2;  // odd rows' column group at step j
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float x = odd ? acc[4 * jj + 2 * h] : acc[4 * j + 2 * h];
      const float y = odd ? acc[4 * jj + 2 * h + 1] : acc[4 * j + 2 * h + 1];
      float* const dst = row_base + (j / 4) * 64 * 32 + 8 * h * 32 + ((2 * (j % 4)) ^ chunk_xor) * 4;
      *reinterpret_cast<float2*>(dst) = make_float2(x, y);
    }
  }
}

// A dQ writer warp (warp 1 + c of the producer warpgroup, for consumer c), for one key block: per step and part
// (Traits::kDqParts), the consumer's fp32 dQ tile of kDqRows x 64 from shared memory into dq_accum (one TMA
// reduce-add of two [kDqRows rows][32 columns] boxes, one bulk group), then the tile back to the consumer once read
// (dq_empty after every tile: the consumer waits for it before writing any tile but a key block's first, and before
// its epilogue). Ordered (a semaphore per writer and query block), lane 0 first waits until the key blocks before this
// one have added the step's tiles, and counts its own additions once all are written (one turn for the step's parts:
// a turn per part ran the D256 kernel 4-12% slower); the consumer has its tiles back before that, so only the writer
// waits for its turn, and neither consumer's turn holds up the other's tiles (one warp for both ran the deterministic
// D256 kernel at 0.68x of a warp each). The caller waits for the last reductions (bulk_wait_group) before the CTA's
// shared memory goes.
template <typename Traits, typename Storage, typename Block>
__device__ __forceinline__ void run_dq_writer(const Storage& smem, const CUtensorMap& dq_map, const BwdParams& p,
                                              const Block& block, int c, int lane) {
  const int num_steps = block.num_steps(p);
  const bool ordered = block.ordered;
  const float* const tile = smem.dq + c * Traits::kTileDQ;
  const CUtensorMap* const map = block.map(&dq_map, kBwdSeqMapDq, p);
  if (Block::kPacked && lane == 0 && num_steps > 0) fence_tensormap_acquire(map);  // written on the device
  for (int step = 0; step < num_steps; ++step) {
    const int head = block.head(step, p);
    const int row = block.m_start(step) + 64 * Traits::dq_query_block(c);
    const int turn = ordered ? block.dq_turn(block.m_start(step) / Traits::kBlockM, p) : 0;
    int* const semaphore = ordered ? block.dq_semaphore(step, c, p) : nullptr;
    for (int part = 0; part < Traits::kDqParts; ++part) {
      named_barrier_sync(BwdBarrier::dq_full(c), BwdBarrier::kWriterThreads);
      if (lane == 0) {
        if (ordered && part == 0) {
          while (ld_acquire_gpu(semaphore) != turn) __nanosleep(100);  // the spin's loads off the line being released
          fence_proxy_async_global();  // the earlier blocks' additions before this one's
        }
        for (int box = 0; box < 2; ++box) {
          tma_reduce_add_4d(map, tile + box * Traits::kDqRows * 32, 64 * Traits::dq_column_block(c, part) + 32 * box,
                            row, head, block.tma_batch());
        }
        bulk_commit_group();
        bulk_wait_group_read<0>();
      }
      __syncwarp();
      named_barrier_arrive(BwdBarrier::dq_empty(c), BwdBarrier::kWriterThreads);
    }
    if (ordered && lane == 0) {
      bulk_wait_group<0>();
      fence_proxy_async_global();
      red_release_gpu_add(semaphore, 1);
    }
  }
}

// Thread 0 initialises the pipeline's mbarriers: per K/V tile, and per Q and per dO buffer, "full" (TMA bytes landed)
// and "empty" (every consumer thread arrives once its GEMMs on the buffer ended).
template <typename Traits, typename Storage>
__device__ __forceinline__ void init_bwd_barriers(const Storage& smem) {
  if (threadIdx.x != 0) return;
  mbarrier_init(smem.kv_full, 1);
  mbarrier_init(smem.kv_empty, 2 * 128);
  for (int s = 0; s < Traits::kStages; ++s) {
    mbarrier_init(&smem.q_full[s], 1);
    mbarrier_init(&smem.q_empty[s], 2 * 128);
  }
  for (int s = 0; s < Traits::kStagesDo; ++s) {
    mbarrier_init(&smem.do_full[s], 1);
    mbarrier_init(&smem.do_empty[s], 2 * 128);
  }
  fence_barrier_init();
}

// The producer thread, for the CTA's key block number `iter` (0 ..), whose steps follow `first_step` earlier ones
// through the rings: Q and dO of every query head of the kv head's group and every query block that sees the keys,
// through rings of kStages (Q) and kStagesDo (dO) buffers, and K and V after the first step's (once the consumers are
// done with the last block's, kv_empty; always, even for a block without steps: the consumers always wait for them,
// so no copy is in flight when the CTA exits). The consumers walk the same sequence.
template <typename T, typename Traits, typename Block, typename Storage>
__device__ __forceinline__ void run_bwd_producer(const Storage& smem, const CUtensorMap& q_map,
                                                 const CUtensorMap& k_map, const CUtensorMap& v_map,
                                                 const CUtensorMap& do_map, const BwdParams& p, const Block& block,
                                                 int first_step, int iter) {
  const CUtensorMap* const q_tile_map = block.map(&q_map, kBwdSeqMapQ, p);
  const CUtensorMap* const k_tile_map = block.map(&k_map, kBwdSeqMapK, p);
  const CUtensorMap* const v_tile_map = block.map(&v_map, kBwdSeqMapV, p);
  const CUtensorMap* const do_tile_map = block.map(&do_map, kBwdSeqMapDout, p);
  const int batch = block.tma_batch();
  if constexpr (Block::kPacked) {  // maps written on the device before the launch
    fence_tensormap_acquire(q_tile_map);
    fence_tensormap_acquire(k_tile_map);
    fence_tensormap_acquire(v_tile_map);
    fence_tensormap_acquire(do_tile_map);
  }
  const auto load_kv = [&] {
    if (iter > 0) mbarrier_wait(smem.kv_empty, (iter - 1) & 1);
    mbarrier_arrive_expect_tx(smem.kv_full, 2 * Traits::kTileKV * sizeof(T));
    for (int c = 0; c < Traits::kColumnBlocks; ++c) {
      tma_load_4d(smem.k + c * Traits::kSubTileKV, k_tile_map, smem.kv_full, 64 * c, block.n_start, block.kv_head,
                  batch);
      tma_load_4d(smem.v + c * Traits::kSubTileKV, v_tile_map, smem.kv_full, 64 * c, block.n_start, block.kv_head,
                  batch);
    }
  };
  if (block.num_steps(p) == 0) load_kv();
  int step = first_step;
  for (int g = 0; g < p.heads_per_kv; ++g) {
    const int head = block.kv_head * p.heads_per_kv + g;
#pragma unroll 1  // unrolled, the loop's precomputed addresses spill the producer's 24 registers
    for (int m_block = block.m_begin; m_block < block.m_end; ++m_block, ++step) {
      const int m_start = m_block * Traits::kBlockM;
      const int stage = step % Traits::kStages, use = step / Traits::kStages;
      if (use > 0) mbarrier_wait(&smem.q_empty[stage], (use - 1) & 1);
      mbarrier_arrive_expect_tx(&smem.q_full[stage], Traits::kTileQ * sizeof(T));
      for (int c = 0; c < Traits::kColumnBlocks; ++c) {
        tma_load_4d(smem.q_stage(stage) + c * Traits::kSubTileQ, q_tile_map, &smem.q_full[stage], 64 * c, m_start,
                    head, batch);
      }
      const int do_stage = step % Traits::kStagesDo, do_use = step / Traits::kStagesDo;
      if (do_use > 0) mbarrier_wait(&smem.do_empty[do_stage], (do_use - 1) & 1);
      mbarrier_arrive_expect_tx(&smem.do_full[do_stage], Traits::kTileQ * sizeof(T));
      for (int c = 0; c < Traits::kColumnBlocks; ++c) {
        tma_load_4d(smem.dout_stage(do_stage) + c * Traits::kSubTileQ, do_tile_map, &smem.do_full[do_stage], 64 * c,
                    m_start, head, batch);
      }
      if (step == first_step) load_kv();  // the first step's Q and dO may load while the last block ends
    }
  }
}

// The Hopper backward's persistent schedule: a grid of at most one CTA per SM takes key blocks (KeyBlock's numbering)
// one at a time from p.tile_counter (zeroed by the preprocess pass), so that blocks start in index order as a grid of
// a CTA per block would start them: an ordered dQ's turns wait only for blocks that have started. The producer thread
// takes the next block once it has issued this one's loads and publishes it in a two-slot mailbox (num_blocks: done),
// which the consumers and the dQ writers read.
struct BwdTileScheduler {
  static constexpr int kReaders = 2 * 128 + 2 * 32;  // the consumer warpgroups and the dQ writer warps
  int* slots;       // [2]
  uint64_t* full;   // [2]
  uint64_t* empty;  // [2]

  template <typename Storage>
  __device__ explicit BwdTileScheduler(const Storage& smem)
      : slots(smem.block_slots), full(smem.block_full), empty(smem.block_empty) {}
  __device__ void init() const {  // thread 0, before the CTA's first barrier
    for (int slot = 0; slot < 2; ++slot) {
      mbarrier_init(&full[slot], 1);
      mbarrier_init(&empty[slot], kReaders);
    }
  }
  __device__ static int take(const BwdParams& p) { return atomicAdd(p.tile_counter, 1); }
  // The producer: the CTA's key block number `iter` (0 ..).
  __device__ void publish(int iter, int index) const {
    const int slot = iter % 2;
    if (iter >= 2) mbarrier_wait(&empty[slot], ((iter - 2) / 2) & 1);
    slots[slot] = index;
    mbarrier_arrive(&full[slot]);
  }
  // Every reader thread, for each iter in turn until it reads num_blocks or more.
  __device__ int read(int iter) const {
    const int slot = iter % 2;
    mbarrier_wait(&full[slot], (iter / 2) & 1);
    const int index = __shfl_sync(0xffffffffu, slots[slot], 0);
    mbarrier_arrive(&empty[slot]);
    return index;
  }
};

// acc (64 rows x kBlockM columns) = A B^T over the head dim, A = 64 rows of a key tile (K or V), B = a query-block tile
// (Q or dO); both K-major, walked like the forward's S = Q K^T (k16 steps of 32 bytes, then the next sub-tile).
template <typename T, typename Traits>
__device__ __forceinline__ void issue_rows_times_block(float (&acc)[Traits::kBlockM / 2], const T* key_rows,
                                                       const T* block) {
  wgmma_fence_registers(acc);
  wgmma_fence();
  const uint64_t a_desc = smem_desc_sw128(key_rows), b_desc = smem_desc_sw128(block);
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    const int c = kk / 4, k_in_row = (kk % 4) * 16;
    Wgmma<T, Traits::kBlockM>::template ss<false>(
        acc, desc_advance(a_desc, (c * Traits::kSubTileKV + k_in_row) * sizeof(T)),
        desc_advance(b_desc, (c * Traits::kSubTileQ + k_in_row) * sizeof(T)), kk > 0);
  }
  wgmma_commit();
}

}  // namespace flashattn::sm90
