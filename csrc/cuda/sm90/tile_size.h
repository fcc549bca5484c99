// The Hopper forward's tile shape and tile order for a call: decided here once, read by the host plan (which picks the
// kernel variant and sizes the schedule) and by the kernels' traits. Host and device code alike.
#pragma once

#include <cstdint>

namespace flashattn::sm90 {

// The order in which a persistent CTA takes its tiles (tile_scheduler.h).
enum class TileOrder {
  kStride,             // tiles c, c + grid, ... (no mask: every tile costs the same)
  kStrideThenStreamK,  // the same, then the last tiles' key blocks shared out over the CTAs where the host asks
  kDynamic,            // causal: tile indices from a counter or zigzag rounds, passed on by the producer
  kSequences,          // packed sequences: tiles from a counter in an order built on the device, decoded by the
                       // producer (tile_scheduler.h: SequenceScheduler)
};

// Causal tiles (and those of a band with a right edge) differ in length: dynamic order, longest first. Without a mask
// the D128 kernel may split its last round over keys (stream-K); at D256 the split's state spills registers, and
// D64's grid spreads its short tiles instead. The options variants (windows, softcap, sinks) do not split. Packed
// sequences' tiles are known only on the device.
constexpr TileOrder fwd_tile_order(int kernel_head_dim, bool causal, bool options = false, bool sequences = false) {
  return sequences                             ? TileOrder::kSequences
         : causal                              ? TileOrder::kDynamic
         : kernel_head_dim == 128 && !options ? TileOrder::kStrideThenStreamK
                                               : TileOrder::kStride;
}

struct FwdTileShape {
  int consumers;  // consumer warpgroups of 64 query rows each
  int block_m;    // query rows per tile: 64 * consumers
  int block_n;    // keys per block
};

// D256 takes 64-key blocks (with an O staging buffer) up to this many keys, 80-key blocks (two stages still beside Q,
// O staged in the rings) above: the shorter blocks win at short L_k, where a tile has few of them.
constexpr int64_t d256_short_max_keys(bool causal) { return causal ? 2048 : 512; }

// Three consumers at D64 where the GEMMs per key block are short next to the softmax (under a causal mask only once
// rows and keys reach 1024: shorter causal tiles leave the third idle), and at D128 under softcap, whose tanh and
// exponential per score keep the MUFU as long as the GEMMs keep the tensor cores: a third warpgroup's softmax runs
// while the other two take turns at the GEMMs (64-key blocks leave its 160 registers room). Two at D128 otherwise and
// at D256, whose O fills the registers. 128-key blocks up to D128 otherwise.
constexpr FwdTileShape fwd_tile_shape(int kernel_head_dim, bool causal, int64_t len_q, int64_t len_k,
                                      bool softcap = false) {
  if (kernel_head_dim == 128 && softcap) return {3, 192, 64};
  const int consumers = kernel_head_dim == 64 && (!causal || (len_q >= 1024 && len_k >= 1024)) ? 3 : 2;
  const int block_n = kernel_head_dim <= 128 ? 128 : len_k <= d256_short_max_keys(causal) ? 64 : 80;
  return {consumers, 64 * consumers, block_n};
}

// The Hopper backward's tile: block_n keys per CTA (two consumer warpgroups of 64 at D64 and D128; one at D256, whose
// consumers split the columns), block_m queries per step: 128 at D64, where dK and dV leave the registers room; at D128
// 80 for the plain kernel without a mask (a step's fixed costs spread over 25% more queries; its dQ is computed
// transposed, wgmma's M being the head dim) and 64 under a mask, window, softcap or packed sequences, whose steps need
// the registers. A step's dQ goes to dq_accum as fp32 tiles (64 query rows x 64 columns, or all 80 rows x 64 columns;
// two a step, four at D256) through two dQ writers; ordered, a writer adds its tiles of a step in one turn
// (kBwdDqSemaphores per query block: one per writer).
constexpr int kBwdDqSemaphores = 2;

struct BwdTileShape {
  int block_m;
  int block_n;
};

constexpr BwdTileShape bwd_tile_shape(int kernel_head_dim, bool masked) {
  const int block_m = kernel_head_dim == 64 ? 128 : kernel_head_dim == 128 && !masked ? 80 : 64;
  return {block_m, kernel_head_dim == 256 ? 64 : 128};
}

// Ordered dQ without a mask: how many (batch, kv head) pairs take turns in the key blocks' start order, so that a key
// block starts that many CTAs after the one whose additions it waits for (it otherwise waits at nearly every step); as
// many as keep their Q, dO and dq_accum (8 bytes per element) within a third of L2 (interleaving 8 at every length
// lost 25% at D256 L16k), at most 32.
constexpr int bwd_ordered_interleave(int kernel_head_dim, bool causal, int64_t len_q, int heads_per_kv,
                                     int64_t l2_bytes) {
  if (causal) return 1;
  const int64_t fit = l2_bytes / 3 / (8 * len_q * kernel_head_dim * heads_per_kv);
  return fit < 1 ? 1 : fit > 32 ? 32 : static_cast<int>(fit);
}

// Packed sequences: their lengths stay on the device, so the shape of short sequences (two consumers under a causal
// mask at D64, whose tiles then start at row 0; 64-key blocks at D256).
constexpr FwdTileShape fwd_sequences_tile_shape(int kernel_head_dim, bool causal) {
  return fwd_tile_shape(kernel_head_dim, causal, 0, 0);
}

static_assert(fwd_tile_shape(64, false, 100, 100).consumers == 3, "D64 without a mask: three consumers");
static_assert(fwd_tile_shape(64, true, 1024, 1024).block_m == 192, "long causal D64: three consumers");
static_assert(fwd_tile_shape(64, true, 1023, 4096).block_m == 128, "short causal D64: two");
static_assert(fwd_tile_shape(128, true, 100, 100, true).block_n == 64 &&
                  fwd_tile_shape(128, true, 100, 100).consumers == 2,
              "D128: three consumers over 64-key blocks under softcap only");
static_assert(bwd_ordered_interleave(256, false, 1024, 1, 50 << 20) == 8 &&
                  bwd_ordered_interleave(256, false, 4096, 1, 50 << 20) == 2 &&
                  bwd_ordered_interleave(256, false, 16384, 1, 50 << 20) == 1 &&
                  bwd_ordered_interleave(256, true, 1024, 1, 50 << 20) == 1 &&
                  bwd_ordered_interleave(64, false, 512, 1, 50 << 20) == 32,
              "ordered without a mask at D256: 8 pairs in turn at L1k, 2 at L4k, none from L8k; D64 L512: 32");
static_assert(bwd_tile_shape(128, false).block_m == 80 && bwd_tile_shape(128, true).block_m == 64 &&
                  bwd_tile_shape(64, false).block_m == 128 && bwd_tile_shape(256, true).block_n == 64,
              "backward tiles: 80 queries at D128 without a mask, 128 at D64, 64-key blocks at D256");
static_assert(fwd_tile_shape(256, false, 4096, 512).block_n == 64 && fwd_tile_shape(256, false, 1, 513).block_n == 80,
              "D256 without a mask: 64-key blocks up to 512 keys");

}  // namespace flashattn::sm90
