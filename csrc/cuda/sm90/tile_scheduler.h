// The Hopper forward's tile schedules, host and device halves together: which tiles (kBlockM query rows of one batch
// and head) a persistent CTA computes, in which order, and on how many CTAs. One device type per TileOrder:
//   StrideScheduler    no mask: CTA c takes tiles c, c + grid, ... (static_grid picks the grid);
//   StreamKScheduler   the same, then a share of the last tiles' key blocks (stream_k_tiles: how many tiles);
//   DynamicScheduler   causal: tiles from a counter in counter_order, or in zigzag rounds (causal_zigzag_grid);
//                      the producer takes them and passes each index to the consumers through a mailbox;
//   SequenceScheduler  packed sequences: tiles from a counter in the order sequences.h built, each decoded by the
//                      producer and passed on whole.
// Tiles are numbered with the query block fastest, so the CTAs at work at one time share K/V in L2.
// The host half compiles anywhere (flash_api.cpp plans with it); the device half only under nvcc.
#pragma once

#include <climits>
#include <cstdint>
#include <numeric>  // std::gcd

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/decode.h"
#include "cuda/packed.h"
#include "cuda/params.h"
#include "cuda/sm90/fwd_traits.h"
#include "cuda/sm90/mask.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/sequences.h"
#endif

namespace flashattn::sm90 {

// ---- host: grids and splits ---------------------------------------------------------------------------------------

// The causal zigzag: round r gives CTA c the tile r * grid + c, odd rounds counted from the other end, which pairs each
// long tile with a short one when the rounds pair up: a grid that is a multiple of the query blocks per head with an
// even number of full rounds, or one that divides a head's query blocks an even number of times. Returns the largest
// such grid within 1/32 below the SM count, or 0 (then the CTAs take tiles from a counter). A grid below the SM count
// leaves SMs idle, which pays only while tiles are short (up to 64 query blocks per head).
constexpr int causal_zigzag_grid(int64_t num_m_blocks, int64_t num_tiles, int num_sms) {
  for (int size = num_sms; size > 0 && size * 32 >= num_sms * 31; --size) {
    if (size < num_sms && num_m_blocks > 64) return 0;
    if (num_tiles <= size) return size;  // one tile per CTA
    const bool whole_heads = size % num_m_blocks == 0 && num_tiles % (2 * size) == 0;
    const bool split_heads = num_m_blocks % (2 * size) == 0;
    if (whole_heads || split_heads) return size;
  }
  return 0;
}

// The stride order's grid. A head's last tile is short where only some consumers have rows (three consumers at
// L_q mod 192 in 1..128). On a grid that shares a factor with the query blocks per head those tiles stay on a few
// CTAs, which idle while the rest carry full tiles; a grid coprime to them walks every CTA through all of them. This
// returns the grid within 1/32 below the SM count that gives no CTA more tiles than the SM count does and whose
// busiest CTA has the least work (tiles times `consumers`, less the short tiles it surely gets times the consumers
// that skip in them: `short_tile_consumers` compute there). On a tie: the SM count where there are short tiles to
// spread; where there are none, the fewest CTAs (under the 700 W power cap, SMs that sit out every round leave their
// power to the rest for the whole launch).
constexpr int static_grid(int64_t num_m_blocks, int64_t num_tiles, int num_sms, int consumers,
                          int short_tile_consumers) {
  if (num_m_blocks <= 0 || num_tiles <= 0) return num_sms;
  const int64_t most_tiles = (num_tiles + num_sms - 1) / num_sms;  // the busiest CTA's on num_sms CTAs
  const bool spreads_short_tiles = short_tile_consumers < consumers;
  int best = num_sms;
  int64_t least_work = -1;
  for (int size = num_sms; size > 0 && size * 32 >= num_sms * 31; --size) {
    const int64_t tiles = (num_tiles + size - 1) / size;  // the busiest CTA's
    if (tiles > most_tiles) break;                         // fewer CTAs only add tiles from here on
    const bool walks_all_blocks = std::gcd(static_cast<int64_t>(size), num_m_blocks) == 1;
    const int64_t short_tiles = walks_all_blocks ? tiles / num_m_blocks : 0;  // at least
    const int64_t work = tiles * consumers - short_tiles * (consumers - short_tile_consumers);
    if (least_work < 0 || work < least_work || (!spreads_short_tiles && work == least_work)) {
      least_work = work;
      best = size;
    }
  }
  return best;
}
// The benchmark grid's D64 shapes (tokens 16k, 32 heads, 192-row tiles) on 132 SMs:
static_assert(static_grid(6, 3072, 132, 3, 1) == 131, "L1k: 6 query blocks, the last with one consumer's rows");
static_assert(static_grid(11, 2816, 132, 3, 2) == 131, "L2k: 11 query blocks, the last with two");
static_assert(static_grid(22, 2816, 132, 3, 1) == 131, "L4k: 22 query blocks, the last with one");
static_assert(static_grid(43, 2752, 132, 3, 2) == 132, "L8k: 131 CTAs would give one 22 tiles");
static_assert(static_grid(8, 2048, 132, 2, 2) == 128, "D128 L1k: every tile full, 16 rounds on 128 CTAs");
static_assert(static_grid(8, 1024, 132, 2, 2) == 128, "D256 L1k: 8 rounds on 128 CTAs");
static_assert(static_grid(8, 1000, 132, 2, 2) == 128, "8 rounds: the fewest within 1/32 (125 take 8 too)");
static_assert(static_grid(8, 100, 132, 2, 2) == 128, "one round");

// Stream-K (TileOrder::kStrideThenStreamK): where the tiles are not a multiple of the grid, the last round runs on part
// of it. The tiles past all but the last full round, between one and two rounds of them, have their key blocks shared
// out evenly over the CTAs, each share at least one tile long, so a tile is split between at most two CTAs, which
// merge their parts (fwd_epilogue.h). Returns how many tiles, or 0 where the last round is more than 7/8 full, there
// is no earlier round to fold in, or a tile has fewer key blocks than min_blocks. With a split the grid is the SM
// count. It makes a sequence's result depend on the batch, so the host asks for it only where invariance is given up.
inline constexpr int64_t kStreamKMinBlocks = 12;  // shorter tiles measured no gain
constexpr int64_t stream_k_tiles(int64_t num_tiles, int grid, int64_t num_n_blocks, int64_t min_blocks) {
  const int64_t rounds = num_tiles / grid, rest = num_tiles % grid;
  if (num_n_blocks < min_blocks || rounds < 2 || rest == 0 || rest * 8 > static_cast<int64_t>(grid) * 7) return 0;
  return num_tiles - (rounds - 1) * grid;
}
static_assert(stream_k_tiles(2048, 132, 16, 12) == 200, "D128 L2k: 15 full rounds; the last 68 tiles, one round");
static_assert(stream_k_tiles(2048, 132, 8, 12) == 0, "D128 L1k: 8 key blocks");
static_assert(stream_k_tiles(2048, 132, 8, 1) == 200, "D128 L1k forced");
static_assert(stream_k_tiles(2048, 128, 12, 12) == 0, "whole rounds");
static_assert(stream_k_tiles(200, 132, 12, 12) == 0, "no earlier round");
// Its workspace (FwdParams::sk_flags, sk_partial): a slot per CTA boundary, consumer (two) and warp (four); a slot's
// partial holds 32 lanes x (D / 2 O values, 2 row bases, 2 row sums) floats, and its flags a lock and a ready word.
inline constexpr int kStreamKSlotsPerCta = 2 * 4;
constexpr int stream_k_slot(int boundary, int consumer, int warp) { return (boundary * 2 + consumer) * 4 + warp; }
constexpr int64_t stream_k_partial_floats(int head_dim) { return 32 * (head_dim / 2 + 4); }

#if defined(__CUDACC__)
// ---- device ---------------------------------------------------------------------------------------------------------

// One output tile: a block of kBlockM query rows of one (batch, head), and the key blocks it sees. Only what the main
// loop needs is kept; the rest is derived where it is used (the consumers are short of registers). Where tiles end at
// L_q (kTilesEndAtLq) a head's first tile starts at a negative row (L_q mod 192 in 1..176): TMA zero-fills those rows
// of Q, the consumers without rows there compute nothing, and no O or lse is stored for them. With packed sequences
// (Traits::kSequences) rows and keys count from the sequence's first, batch is the sequence (or a KV cache's entry),
// and TMA goes through the sequence's own maps (sequences.h) at batch coordinate 0.
template <typename Traits, bool kCausal>
struct Tile {
  using Mask = FwdMask<Traits, kCausal>;
  static constexpr bool kSequences = Traits::kSequences;
  int m_start, head, batch, num_n_blocks;
  int n_first = 0;  // the first key block its rows see (a band's left edge); none seen: num_n_blocks = 0
  int q_offset = 0, seq_len_q = 0, seq_len_k = 0;  // packed sequences: the sequence's first row in q, and lengths
  int split = 0;  // a KV cache's key split (FwdPlan::splits > 1): its key blocks only, its part to the workspace

  // Under a causal mask each head's longest rows come first.
  __device__ Tile(int index, int num_m_blocks, const FwdParams& p) {
    const int m_index = index % num_m_blocks;
    const int m_block = kCausal ? num_m_blocks - 1 - m_index : m_index;
    head = (index / num_m_blocks) % p.heads;
    batch = index / num_m_blocks / p.heads;
    // The rows before 0 in a head's first tile, rounded down to whole 16-row O store boxes, which are skipped there (a
    // TMA store at a negative row faults, where a load zero-fills), so the last tile ends at most 15 rows past L_q.
    const int rows_before_zero =
        Traits::kTilesEndAtLq ? (num_m_blocks * Traits::kBlockM - p.len_q) / 16 * 16 : 0;
    m_start = m_block * Traits::kBlockM - rows_before_zero;
    set_key_blocks(p);
  }
  // Packed sequences: the tile the producer decoded.
  __device__ Tile(const SeqTile& t, const FwdParams& p)
      : m_start(t.m_block * Traits::kBlockM), head(t.head), batch(t.batch), q_offset(t.q_offset), seq_len_q(t.len_q),
        seq_len_k(t.len_k), split(t.split) {
    set_key_blocks(p);
  }
  __device__ void set_key_blocks(const FwdParams& p) {
    num_n_blocks = Mask::num_n_blocks(m_end(p), len_q(p), len_k(p), p);
    if constexpr (Traits::kOptions) {
      n_first = Mask::n_first(m_first(), len_q(p), len_k(p), p);
      if (split_part(p)) {
        const int blocks = split_key_blocks(p.len_k, Traits::kBlockN, p.plan.splits);
        n_first = max(n_first, split * blocks);
        num_n_blocks = min(num_n_blocks, (split + 1) * blocks);
      }
      if (n_first >= num_n_blocks) num_n_blocks = n_first = 0;
    }
  }
  // Whether the tile is a key split's: its rows' parts go to the workspace, the combine writes out and lse.
  __device__ static bool split_part(const FwdParams& p) { return kSequences && p.plan.splits > 1; }
  // The rows and keys of its (batch, head) or sequence.
  __device__ int len_q(const FwdParams& p) const { return Traits::kSequences ? seq_len_q : p.len_q; }
  __device__ int len_k(const FwdParams& p) const { return Traits::kSequences ? seq_len_k : p.len_k; }
  __device__ int causal_shift(const FwdParams& p) const { return len_k(p) - len_q(p); }
  // The tile's rows: m_first() .. m_end(p) - 1.
  __device__ int m_first() const { return Traits::kTilesEndAtLq ? max(m_start, 0) : m_start; }
  __device__ int m_end(const FwdParams& p) const { return min(m_start + Traits::kBlockM, len_q(p)); }
  __device__ int key_start(int n_block) const { return n_block * Traits::kBlockN; }  // the key block's first key
  __device__ int kv_head(const FwdParams& p) const { return head / p.heads_per_kv; }
  // Its out rows, and its lse rows: (B, H, Lq), or (H, total_q) packed (a KV cache's entries are not).
  template <typename T>
  __device__ T* out(const FwdParams& p) const {
    if (Traits::kSequences && p.cu_seqlens_q != nullptr) {
      return static_cast<T*>(p.out) + static_cast<int64_t>(q_offset) * p.o_row_stride + head * p.o_head_stride;
    }
    return static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride;
  }
  __device__ float* lse(const FwdParams& p) const {
    if (Traits::kSequences && p.cu_seqlens_q != nullptr) return p.lse + static_cast<int64_t>(head) * p.len_q + q_offset;
    return p.lse + (static_cast<int64_t>(batch) * p.heads + head) * p.len_q;
  }
  // The tensor map of q, k, v or out (SeqMap) its TMA goes through, `dense` but for packed sequences, and the batch
  // coordinate there.
  __device__ const CUtensorMap* map(const CUtensorMap* dense, SeqMap which, const FwdParams& p) const {
    if constexpr (Traits::kSequences) return static_cast<const CUtensorMap*>(p.seq_maps) + batch * kSeqMaps + which;
    return dense;
  }
  __device__ int tma_batch() const { return Traits::kSequences ? 0 : batch; }
};

// A unit of a CTA's work: tile `index` (num_tiles or more, or -1 for the consumers of DynamicScheduler: done) and its
// key blocks n_begin .. n_end - 1 (the whole tile but for stream-K shares; the caller sets n_end from the tile then).
struct FwdWork {
  int index, n_begin, n_end;
};

struct StrideScheduler {
  int num_tiles;

  __device__ StrideScheduler(const FwdParams&, int tiles, int, int) : num_tiles(tiles) {}
  __device__ FwdWork first() const { return {static_cast<int>(blockIdx.x), 0, 0}; }
  // The producer, once tile j is issued.
  __device__ void advance(FwdWork& work, int) const { work.index += gridDim.x; }
  // The consumers: false once the CTA is done.
  template <typename Storage>
  __device__ bool next(FwdWork& work, int j, const Storage&) const {
    work.n_begin = 0;
    work.n_end = 0;
    if (j > 0) work.index += gridDim.x;
    return work.index < num_tiles;
  }
};

// Whole tiles c, c + grid, ... below num_tiles - sk_tiles (p.plan), then blocks c * I / grid .. (c + 1) * I / grid - 1
// of the I = sk_tiles * num_n_blocks key blocks of the last sk_tiles tiles, counted from block 0 of the first. A
// tile is split between at most two neighbouring CTAs: the part that ends CTA c's share (blocks 0 .. k - 1) and the
// part that starts CTA c + 1's (k ..); boundary c names both. The producer and the consumers each walk it.
struct StreamKScheduler {
  int num_tiles;
  int next_whole, whole_tiles, num_n_blocks;
  int position, share_end;  // in key blocks from block 0 of tile whole_tiles

  __device__ StreamKScheduler(const FwdParams& p, int tiles, int, int n_blocks) {
    num_tiles = tiles;
    next_whole = blockIdx.x;
    whole_tiles = tiles - p.plan.sk_tiles;
    num_n_blocks = n_blocks;
    const int64_t blocks = static_cast<int64_t>(p.plan.sk_tiles) * n_blocks;
    position = static_cast<int>(blocks * blockIdx.x / gridDim.x);
    share_end = static_cast<int>(blocks * (blockIdx.x + 1) / gridDim.x);
  }
  // The next unit of work into tile, n_begin, n_end. False once the CTA is done.
  __device__ bool take(int& tile, int& n_begin, int& n_end) {
    if (next_whole < whole_tiles) {
      tile = next_whole;
      next_whole += gridDim.x;
      n_begin = 0;
      n_end = num_n_blocks;
      return true;
    }
    if (position >= share_end) return false;
    tile = whole_tiles + position / num_n_blocks;
    n_begin = position % num_n_blocks;
    n_end = min(num_n_blocks, n_begin + (share_end - position));
    position += n_end - n_begin;
    return true;
  }
  __device__ FwdWork first() {
    FwdWork work{static_cast<int>(blockIdx.x), 0, 0};
    if (!take(work.index, work.n_begin, work.n_end)) work.index = num_tiles;
    return work;
  }
  __device__ void advance(FwdWork& work, int) {
    if (!take(work.index, work.n_begin, work.n_end)) work.index = num_tiles;
  }
  template <typename Storage>
  __device__ bool next(FwdWork& work, int, const Storage&) {
    work.n_begin = 0;
    work.n_end = 0;
    if (!take(work.index, work.n_begin, work.n_end)) return false;
    // Broadcast, so ptxas keeps them in uniform registers (the division in take() leaves the uniform datapath).
    work.index = __shfl_sync(0xffffffff, work.index, 0);
    work.n_begin = __shfl_sync(0xffffffff, work.n_begin, 0);
    work.n_end = __shfl_sync(0xffffffff, work.n_end, 0);
    return true;
  }
};

// The counter hands out tiles head by head (each head's longest rows first, so the CTAs at work share K/V in L2),
// except that the last tail_heads (batch, head) pairs' tiles go longest first across those heads: ending head by head,
// the CTAs that take the last long tiles would finish up to a tile after the others. The tail covers about
// kCounterTailRounds tiles per CTA.
inline constexpr int kCounterTailRounds = 3;
__device__ __forceinline__ int counter_order(int n, int num_m_blocks, int num_tiles, int tail_heads) {
  const int tail_start = num_tiles - tail_heads * num_m_blocks;
  if (n < tail_start || n >= num_tiles) return n;
  const int r = n - tail_start;
  return tail_start + (r % tail_heads) * num_m_blocks + r / tail_heads;  // query block r / tail_heads, longest first
}

// Causal: the producer takes the next tile once this one is issued, from p.tile_counter (a zeroed int32) where the
// host passed one, else the next zigzag round; it publishes each index (-1: done) in a two-slot mailbox.
struct DynamicScheduler {
  const FwdParams& p;
  int num_tiles, num_m_blocks;
  int tail_heads = 0;  // with the counter: the (batch, head) pairs whose tiles go longest first (counter_order)

  __device__ DynamicScheduler(const FwdParams& params, int tiles, int m_blocks, int)
      : p(params), num_tiles(tiles), num_m_blocks(m_blocks) {}
  __device__ FwdWork first() {
    int index = blockIdx.x;
    if (p.tile_counter != nullptr) {
      const int tail_tiles = kCounterTailRounds * static_cast<int>(gridDim.x);
      tail_heads = min(p.batch * p.heads, (tail_tiles + num_m_blocks - 1) / num_m_blocks);
      index = counter_order(index, num_m_blocks, num_tiles, tail_heads);
    }
    return {index, 0, 0};
  }
  // The producer: tile j's index to the consumers.
  template <typename Storage>
  __device__ void publish(const FwdWork& work, int j, const Storage& smem) const {
    const int slot = j % 2;
    if (j >= 2) mbarrier_wait(&smem.tile_empty[slot], ((j / 2) - 1) & 1);
    smem.tile_index[slot] = work.index < num_tiles ? work.index : -1;
    mbarrier_arrive(&smem.tile_full[slot]);
  }
  __device__ void advance(FwdWork& work, int j) const {
    if (p.tile_counter != nullptr) {
      work.index = counter_order(gridDim.x + atomicAdd(p.tile_counter, 1), num_m_blocks, num_tiles, tail_heads);
    } else {
      const int round = j + 1;
      work.index = round * gridDim.x + (round % 2 == 0 ? blockIdx.x : gridDim.x - 1 - blockIdx.x);
    }
  }
  template <typename Storage>
  __device__ bool next(FwdWork& work, int j, const Storage& smem) const {
    work.n_begin = 0;
    work.n_end = 0;
    const int slot = j % 2;
    mbarrier_wait(&smem.tile_full[slot], (j / 2) & 1);
    work.index = __shfl_sync(0xffffffff, smem.tile_index[slot], 0);
    mbarrier_arrive(&smem.tile_empty[slot]);
    return work.index >= 0;
  }
};

// Packed sequences (or a KV cache's entries): the producer takes tile indices from p.tile_counter, as DynamicScheduler
// does, and decodes each (its rank by binary search over p.seq_tile_start, the rank's sequence, head and query block:
// longest rows first under a causal mask) before it publishes it; a CTA's indices only grow, so each search starts at
// the last rank.
template <int kBlockM, bool kCausal>
struct SequenceScheduler {
  static constexpr int kSlotInts = sizeof(SeqTile) / sizeof(int);
  const FwdParams& p;
  int num_tiles = 0;  // the producer's: every sequence's tiles (the last tile start)
  int rank = 0;
  SeqTile tile;       // the producer's next, or the consumers' current

  __device__ SequenceScheduler(const FwdParams& params, int, int, int) : p(params) {}
  __device__ void decode(int index) {
    tile.index = -1;
    if (index >= num_tiles) return;
    int hi = p.batch - 1;  // the last rank whose first tile is <= index (ranks without tiles share the next's start)
    while (rank < hi) {
      const int mid = (rank + hi + 1) / 2;
      if (__ldg(p.seq_tile_start + mid) <= index) {
        rank = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int b = __ldg(p.seq_order + rank);
    int local = index - __ldg(p.seq_tile_start + rank);
    if (p.cu_seqlens_q != nullptr) {
      tile.q_offset = clamped_offset(p.cu_seqlens_q, b, p.len_q);
      tile.len_q = max(0, clamped_offset(p.cu_seqlens_q, b + 1, p.len_q) - tile.q_offset);
      tile.len_k = max(0, clamped_offset(p.cu_seqlens_k, b + 1, p.len_k) - clamped_offset(p.cu_seqlens_k, b, p.len_k));
    } else {  // a KV cache's entry
      tile.q_offset = 0;
      tile.len_q = p.len_q;
      tile.len_k = entry_keys(p, b).len;
    }
    // Split by split (the tiles at work together read the same keys), then head by head.
    const int m_blocks = sequence_m_blocks(tile.len_q, kBlockM);
    const int split_tiles = m_blocks * p.heads;
    tile.split = decode_split_ctas(p.plan) > 1 ? local / split_tiles : 0;
    local -= tile.split * split_tiles;
    tile.head = local / m_blocks;
    const int m_index = local - tile.head * m_blocks;
    tile.m_block = kCausal ? m_blocks - 1 - m_index : m_index;
    tile.batch = b;
    tile.index = index;
  }
  // The producer's work.index: the tile's place, or INT_MAX once done.
  __device__ FwdWork work() const { return {tile.index >= 0 ? tile.index : INT_MAX, 0, 0}; }
  __device__ FwdWork first() {
    num_tiles = __ldg(p.seq_tile_start + p.batch);
    decode(blockIdx.x);
    return work();
  }
  template <typename Storage>
  __device__ void publish(const FwdWork&, int j, const Storage& smem) const {
    const int slot = j % 2;
    if (j >= 2) mbarrier_wait(&smem.tile_empty[slot], ((j / 2) - 1) & 1);
    *reinterpret_cast<SeqTile*>(smem.tile_index + slot * kSlotInts) = tile;
    mbarrier_arrive(&smem.tile_full[slot]);
  }
  // The next tile from the counter, or where a CTA runs a tile's key splits in turn, its next split first.
  __device__ void advance(FwdWork& work_, int) {
    if (p.plan.splits_in_turn && tile.index >= 0 && tile.split + 1 < p.plan.splits) {
      ++tile.split;
    } else {
      decode(gridDim.x + atomicAdd(p.tile_counter, 1));
    }
    work_ = work();
  }
  template <typename Storage>
  __device__ bool next(FwdWork& work_, int j, const Storage& smem) {
    const int slot = j % 2;
    mbarrier_wait(&smem.tile_full[slot], (j / 2) & 1);
    const int* const box = smem.tile_index + slot * kSlotInts;
    tile.index = __shfl_sync(0xffffffff, box[0], 0);
    tile.batch = __shfl_sync(0xffffffff, box[1], 0);
    tile.m_block = __shfl_sync(0xffffffff, box[2], 0);
    tile.head = __shfl_sync(0xffffffff, box[3], 0);
    tile.q_offset = __shfl_sync(0xffffffff, box[4], 0);
    tile.len_q = __shfl_sync(0xffffffff, box[5], 0);
    tile.len_k = __shfl_sync(0xffffffff, box[6], 0);
    tile.split = __shfl_sync(0xffffffff, box[7], 0);
    mbarrier_arrive(&smem.tile_empty[slot]);
    work_ = {tile.index, 0, 0};
    return tile.index >= 0;
  }
};

template <typename Traits, bool kCausal>
using FwdScheduler = std::conditional_t<
    Traits::kOrder == TileOrder::kSequences, SequenceScheduler<Traits::kBlockM, kCausal>,
    std::conditional_t<Traits::kOrder == TileOrder::kDynamic, DynamicScheduler,
                       std::conditional_t<Traits::kOrder == TileOrder::kStrideThenStreamK, StreamKScheduler,
                                          StrideScheduler>>>;

// The tile of a unit of work: from its index, or (packed sequences) as the scheduler decoded it.
template <typename TileT, typename Scheduler>
__device__ __forceinline__ TileT tile_of(const FwdWork& work, const Scheduler& scheduler, int num_m_blocks,
                                         const FwdParams& p) {
  if constexpr (TileT::kSequences) {
    return TileT(scheduler.tile, p);
  } else {
    return TileT(work.index, num_m_blocks, p);
  }
}
#endif  // __CUDACC__

}  // namespace flashattn::sm90
