// Declarations of the kernel launchers. Each templated (dtype, head-dim bucket, causal) launcher is instantiated in
// its own generated file under csrc/cuda/instantiations/ so that the build compiles them in parallel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <numeric>  // std::gcd

#include "cuda/params.h"

namespace flashattn {

// Head-dim buckets: a head dim D runs in the smallest bucket >= D (columns past D are zero-filled).
inline constexpr int kHeadDimBuckets[] = {32, 64, 96, 128, 160, 192, 224, 256};

// The fused backward covers the buckets up to this one; larger head dims use the chunked backward.
inline constexpr int kMaxFusedBwdHeadDim = 128;

namespace sm80 {
template <typename T, int HeadDim, bool kCausal>
cudaError_t run_fwd_sm80(const FwdParams& params, cudaStream_t stream);

template <typename T, int HeadDim, bool kCausal>
cudaError_t run_bwd_sm80(const BwdParams& params, cudaStream_t stream);

cudaError_t run_bwd_delta(const BwdDeltaParams& params, bool is_bf16, cudaStream_t stream);
}  // namespace sm80

// The Hopper kernels are built for head dims 64, 128 and 256 (instantiated only when sm_90a is in the arch list;
// generate_instantiations.py lists the same, setup.py maps buckets to them the same way). A bucket runs in the
// smallest of them that holds it: TMA zero-fills the columns past D, as it does for any D below a bucket.
constexpr int sm90_kernel_head_dim(int bucket) { return bucket <= 64 ? 64 : bucket <= 128 ? 128 : 256; }
// The buckets that take the Hopper kernels on sm_90: all of them, as measured against the sm80 and chunked paths
// (benchmarks/NOTES.md); kept as the one place to take a bucket off them.
constexpr bool sm90_fwd_covers(int bucket) { return bucket >= 32 && bucket <= 256; }
constexpr bool sm90_bwd_covers(int bucket) { return bucket >= 32 && bucket <= 256; }

// The causal Hopper forward's schedule. Its tiles (sm90_causal_block_m query rows of one batch and head, numbered with
// the query block fastest, each head's longest rows first) differ in length. Static zigzag rounds (round r gives CTA
// c the tile r * grid + c, odd rounds counted from the other end) pair each long tile with a short one when the
// rounds pair up: a grid that is a multiple of the query blocks per head with an even number of full rounds, or a
// grid that divides a head's query blocks an even number of times. Then the work is even to a few percent
// (benchmarks/schedule_balance.py) with no counter, memset or atomics. This returns the largest such grid within
// 1/32 below the SM count, or 0 if there is none: then the CTAs take their tiles from a zeroed counter
// (FwdParams::tile_counter) instead. A grid below the SM count leaves SMs idle, which pays only while tiles are
// short: measured on 128 of 132 SMs (NOTES.md, v8), +1-5% at up to 64 query blocks per head (L <= 8k with 128-row
// tiles), -1-1.5% at 128 (L16k), where the counter's per-tile costs matter less than the idle SMs.
// Query rows per causal tile: 64 per consumer warpgroup. D64 takes three consumers (192 rows) once queries and keys
// reach 1024: measured +1% at L1k, +5% at 1280, +6% at 2k against two (NOTES.md, v14; a consumer skips the key blocks
// past its rows and one without rows computes nothing, so the taller tile's diagonal and a head's part-empty tile
// cost little; before that, in v12, it was -10% at 1k and equal at 2k). Otherwise two (128 rows). The host
// sizes the schedule with it and the Hopper forward picks its kernel with it (fwd_kernel.h, run_fwd_sm90).
constexpr int sm90_causal_block_m(int kernel_head_dim, int64_t len_q, int64_t len_k) {
  return kernel_head_dim == 64 && len_q >= 1024 && len_k >= 1024 ? 192 : 128;
}
constexpr int sm90_causal_zigzag_grid(int64_t num_m_blocks, int64_t num_tiles, int num_sms) {
  for (int size = num_sms; size > 0 && size * 32 >= num_sms * 31; --size) {
    if (size < num_sms && num_m_blocks > 64) return 0;
    if (num_tiles <= size) return size;  // one tile per CTA
    const bool whole_heads = size % num_m_blocks == 0 && num_tiles % (2 * size) == 0;
    const bool split_heads = num_m_blocks % (2 * size) == 0;
    if (whole_heads || split_heads) return size;
  }
  return 0;
}

// The Hopper forward's schedule without a mask: CTA c takes the tiles c, c + grid, c + 2 grid, ... (the query block
// fastest). A head's last tile is short where only some of its consumers have rows and the others compute nothing
// (three consumers at L_q mod 192 in 1..128: fwd_kernel.h, kSkipRowlessConsumers). On a grid that shares a factor
// with the query blocks per head, those tiles stay on a few CTAs: on 132 SMs at L 1k (6 blocks), 2k (11) and 4k (22)
// each CTA gets the same query block of every head, and the CTAs with the short ones idle while the rest carry full
// tiles to the end. A grid coprime to the query blocks walks every CTA through all of them, so one with n tiles has
// at least n / num_m_blocks short ones. This returns the grid within 1/32 below the SM count that gives no CTA more
// tiles than the SM count does and whose busiest CTA has the least work, as an upper bound: tiles times `consumers`,
// less the short tiles it surely gets times the consumers that skip in them (`short_tile_consumers` compute there).
// A lone consumer's tile costs more than its share (0.65 of a full one, NOTES.md v15), so a grid that adds a tile to
// the busiest CTA is not taken for short tiles it spreads. On a tie the SM count where there are short tiles to spread;
// where there are none (every consumer computes in a head's last tile), the fewest CTAs: the card runs at its power cap
// (700 W on the H200), and SMs that sit out every round rather than part of the last leave their power to the rest
// for the whole launch. Measured (NOTES.md, (39); 1024 tiles on 128 CTAs against 132, eight rounds either way): D256
// -0.1 / +2.3 / +2.2 / +2.1 / +1.0% at L 1k / 2k / 4k / 8k / 16k, D128 +2.4% at 1k (2048 tiles, sixteen rounds).
constexpr int sm90_static_grid(int64_t num_m_blocks, int64_t num_tiles, int num_sms, int consumers,
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
static_assert(sm90_static_grid(6, 3072, 132, 3, 1) == 131, "L1k: 6 query blocks, the last with one consumer's rows");
static_assert(sm90_static_grid(11, 2816, 132, 3, 2) == 131, "L2k: 11 query blocks, the last with two");
static_assert(sm90_static_grid(22, 2816, 132, 3, 1) == 131, "L4k: 22 query blocks, the last with one");
static_assert(sm90_static_grid(43, 2752, 132, 3, 2) == 132, "L8k: 131 CTAs would give one 22 tiles");
static_assert(sm90_static_grid(8, 2048, 132, 2, 2) == 128, "D128 L1k: every tile full, 16 rounds on 128 CTAs");
static_assert(sm90_static_grid(8, 1024, 132, 2, 2) == 128, "D256 L1k: 8 rounds on 128 CTAs");
static_assert(sm90_static_grid(8, 1000, 132, 2, 2) == 128, "8 rounds: the fewest within 1/32 (125 take 8 too)");
static_assert(sm90_static_grid(8, 100, 132, 2, 2) == 128, "one round");

// Keys per block of the Hopper forward, by head dim, mask and L_k (measured with benchmarks/tune_fwd.py; NOTES.md,
// v1-v3 unless named). D64: 128. D128: 128 keys, with Q from registers (fwd_kernel.h, kQInRegisters), at every L_k.
// Against 176-key blocks without Q in registers: without a mask +7.5% at L 1k, +1.2 / +0.8 / +3.1 / +0.5% at 3k / 4k /
// 8k / 16k (v24); under a causal mask +0.2 / -0.3 / -0.1% at 6k / 8k / 16k (v25), and at short L_k, where the
// diagonal's masked work weighs more in longer blocks, 176 keys were 12.8% / 3.8% slower at 1k / 2k (v20).
// D256: two K/V stages must still fit next to Q: 80 keys (225 KB in all, no O staging buffer: kFirstOInK or kOInQ,
// and kLastOInV), or 64 keys with an O buffer up to sm90_d256_short_max_keys. The 80-key kernel against the 64-key
// one: under a causal mask 1-2% slower at 1k keys, equal at 2k, 4-5% faster from 4k (v13); without a mask 9% slower at
// 512 keys (v13), and with kFirstOInK at locked clocks +3.3% / +4.9% at 768 / 1k keys (v20).
constexpr int64_t sm90_d256_short_max_keys(bool causal) { return causal ? 2048 : 512; }
constexpr int sm90_fwd_block_n(int kernel_head_dim, bool causal, int64_t len_k) {
  if (kernel_head_dim <= 128) return 128;  // D64 and D128
  return len_k <= sm90_d256_short_max_keys(causal) ? 64 : 80;
}

// The Hopper forward without a mask gives each CTA whole tiles at a fixed stride, so where the tiles are not a multiple
// of the grid the last round runs on part of it (2048 tiles on 132 SMs at D128: 15.5 rounds take 16). Stream-K over
// the last tiles: the tiles past all but the last full round, between one and two rounds of them, have their key
// blocks shared out evenly over the CTAs, each share at least one tile long, so a tile is split between at most two
// CTAs, which merge their parts (fwd_kernel.h, StaticSchedule). Returns how many tiles, or 0 where the last round is
// more than 7/8 full, there is no earlier round to fold in, or a tile has fewer key blocks than min_blocks
// (kSm90StreamKMinBlocks; FLASHATTN_FWD_SCHEDULE=stream-k passes 1). Only in the kernel with kStreamKTail, the D128 one
// without a mask (fwd_kernel.h says why); with a split the grid is the SM count (else sm90_static_grid's).
constexpr bool sm90_fwd_stream_k(int kernel_head_dim, bool causal) { return kernel_head_dim == 128 && !causal; }
// Measured against whole tiles (NOTES.md, v17, five rounds over two calls), L 1k / 2k / 4k / 8k / 16k: -1.6 / +0.9 /
// +0.8 / +1.4 / +1.9% (then with 176-key blocks: 6 at L1k).
constexpr int64_t kSm90StreamKMinBlocks = 12;
constexpr int kSm90StreamKBlockM = 128;  // that kernel's tile height (two consumers of 64 rows)
constexpr int64_t sm90_stream_k_tiles(int64_t num_tiles, int grid, int64_t num_n_blocks, int64_t min_blocks) {
  const int64_t rounds = num_tiles / grid, rest = num_tiles % grid;
  if (num_n_blocks < min_blocks || rounds < 2 || rest == 0 || rest * 8 > static_cast<int64_t>(grid) * 7) return 0;
  return num_tiles - (rounds - 1) * grid;
}
static_assert(sm90_stream_k_tiles(2048, 132, 16, 12) == 200, "D128 L2k: 15 full rounds; the last 68 tiles, one round");
static_assert(sm90_stream_k_tiles(2048, 132, 8, 12) == 0, "D128 L1k: 8 key blocks");
static_assert(sm90_stream_k_tiles(2048, 132, 8, 1) == 200, "D128 L1k forced");
static_assert(sm90_stream_k_tiles(2048, 128, 12, 12) == 0, "whole rounds");
static_assert(sm90_stream_k_tiles(200, 132, 12, 12) == 0, "no earlier round");
// Its workspace (FwdParams::sk_flags, sk_partial): a slot per CTA boundary, consumer (two) and warp (four); a slot's
// partial holds 32 lanes x (D / 2 O values, 2 row bases, 2 row sums) floats, and its flags a lock and a ready word.
constexpr int kSm90StreamKSlotsPerCta = 2 * 4;
constexpr int sm90_stream_k_slot(int boundary, int consumer, int warp) { return (boundary * 2 + consumer) * 4 + warp; }
constexpr int64_t sm90_stream_k_partial_floats(int head_dim) { return 32 * (head_dim / 2 + 4); }

namespace sm90 {
template <typename T, int HeadDim, bool kCausal>
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream);

template <typename T, int HeadDim, bool kCausal>
cudaError_t run_bwd_sm90(const BwdParams& params, cudaStream_t stream);
}  // namespace sm90

}  // namespace flashattn
