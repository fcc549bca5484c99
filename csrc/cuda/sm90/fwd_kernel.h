// Hopper forward (issue 4): warp-specialised, TMA + wgmma, built for head dims 64, 128 and 256 (every bucket runs in
// the smallest that holds it); the default on sm_90 (FLASHATTN_FWD_SM90=0 selects the sm80 kernel).
// tests/test_sm90_primitives.py checks its parts one by one; benchmarks/NOTES.md logs each version's figures.
//
// Persistent grid: one CTA per SM (a few fewer for the causal zigzag and for the stride without a mask, launch.h) walks
// the output tiles (kBlockM query rows of one batch and head). CTA = 1 + kConsumers warpgroups. Warpgroup 0 is the
// producer: one thread loads each tile's Q and its K/V blocks into 2- or 3-stage rings with TMA (128-byte swizzle;
// rows outside 0 .. L - 1 and columns past D are zero-filled by TMA), running ahead into the next tile (into a second Q
// buffer where kQStages = 2). Each Q buffer (each consumer's part of it with kQParts) and each K and V stage have a
// "full" mbarrier (TMA bytes landed) and an "empty" one (every consumer done with it; with kOInQ, the first consumer's
// part once it has stored its O from it). The consumer warpgroups (2, or 3 at D64: sm90_fwd_consumers, and under a
// causal mask launch.h's sm90_causal_block_m) each own 64 query rows and run, per key block n (FlashAttention-3's
// intra-warpgroup overlap):
//
//     issue S = Q K[n]^T          (SS wgmma: both operands in shared memory; RS, Q from registers, with
//                                  kQInRegisters)
//     issue O += P[n-1] V[n-1]    (RS wgmma: P from registers, V read transposed)
//     wait for S; softmax(S) -> P[n] while the P V wgmma still runs (where kSoftmaxUnderPV keeps ptxas from
//                                                                   hoisting the next wait above it); with
//                                                                   kOptimisticExp against the row's unmoved
//                                                                   reference, no max, unless the block's sums
//                                                                   grow too large (then S again and the max)
//     wait for P V; rescale O (only where a row's reference moved); pack P[n]
//
// With kPingPong the consumers also take turns issuing their GEMMs (one named barrier each, round robin), so one
// warpgroup's softmax runs while another's GEMMs keep the tensor cores busy. Under a causal mask a consumer computes
// only the key blocks its own rows see (kSkipUnseenBlocks); with three consumers one without rows computes nothing
// (kSkipRowlessConsumers); both take empty turns for the blocks they skip.
//
// Epilogue: O normalised, written by each warp into a swizzled staging buffer with stmatrix and stored with TMA (one
// store of the warp's 16 rows where D is a multiple of 64: kOOneStorePerWarp); lse from registers. The staging buffer:
// a buffer per consumer where shared memory has room (kOBuffers); else the last consumer's is the V stage of its tile's
// last key block (kLastOInV) and the first's a buffer where one fits, else the K stage of that block (kFirstOInK) or
// its own rows of Q (kOInQ). A warp's staged rows are released (o_free, o_in_v_free, o_in_k_free) once the store has
// read them, which it waits for after issuing the next tile's first S GEMM (the first consumer's Q rows with kOInQ, and
// its K stage with kOInKLeavesAtStore, at once).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/launch.h"  // sm90_causal_block_m, sm90_static_grid
#include "cuda/params.h"
#include "cuda/row_epilogue.h"
#include "cuda/sm80/ptx.h"  // pack2, fast_exp2
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/tma.h"
#include "cuda/sm90/wgmma_ops.h"

namespace flashattn::sm90 {

// Consumer warpgroups of 64 rows each. At D64 the GEMMs per key block are short next to the softmax, so a third
// warpgroup keeps the tensor cores busy while two others do exp2: +5-17% without a mask (NOTES.md, v6). Under a
// causal mask the host takes three only for long rows (launch.h, sm90_causal_block_m). At D128/D256 the registers
// (O is 64/128 per thread) allow only two.
constexpr int sm90_fwd_consumers(int head_dim, bool causal) { return head_dim == 64 && !causal ? 3 : 2; }

// BlockN: keys per block (launch.h, sm90_fwd_block_n).
template <int HeadDim, bool Causal, int BlockN, int Consumers = sm90_fwd_consumers(HeadDim, Causal)>
struct FwdTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kConsumers = Consumers;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = BlockN;
  // Causal tiles differ in length: the CTAs take them from a global counter (longest first) or in zigzag rounds
  // (launch.h) instead of a fixed stride. Only then does the producer hand tile indices to the consumers (it costs
  // consumer registers).
  static constexpr bool kDynamicTiles = Causal;
  // Without a mask the last tiles' key blocks are shared out over the CTAs, and a tile split between two CTAs is
  // merged by whichever finishes second (launch.h, sm90_stream_k_tiles; StaticSchedule, merge_split_tile). At D128
  // only. At D256 the schedule's state and the merge cost registers (v17: 156-168 bytes spilled, some in the key loop;
  // v31, in a second kernel for tiles of 96 or more key blocks: 8 bytes), and with the benchmark's method the split
  // read 2.4% / 3.2% below whole tiles at L 8k / 16k (NOTES.md, (34)). The three-consumer D64 kernel's grid spreads its
  // short tiles instead.
  static constexpr bool kStreamKTail = sm90_fwd_stream_k(HeadDim, Causal);
  static_assert(!kStreamKTail || kBlockM == kSm90StreamKBlockM, "flash_api sizes the split with kSm90StreamKBlockM");
  // K/V stages: three at D64, where a tile's key blocks are shortest; two at D128 and D256, where they fill shared
  // memory or a third measured no better (6-13% slower at D128 causal up to L1k, there with O staged in the Q rows to
  // make room). Measured at D64 (NOTES.md, v25, against two stages): three consumers under a causal mask +2.8% / +2.0%
  // / +0.7% at L 1k / 1.5k / 2k and -0.2-0.3% at 4k-16k; without a mask +1.5% / +1.7% at 1k / 2k and -0.6% to +0.6% at
  // 4k-16k. The two-consumer causal kernel (L_q or L_k below 1024) had it since v13: +2-4% at L 512-1k.
  static constexpr int kStages = HeadDim == 64 ? 3 : 2;
  // D128 without a mask: a third K stage (shared memory has room for one more 32 KB block beside its two O buffers, not
  // for a K/V pair), and the producer requests each block's K before the previous block's V, across tiles. The next
  // tile's first K then waits for the softmax of this tile's third-to-last block (its K's release), and the next tile's
  // Q, requested just before it, for that block's V's predecessor: a block sooner than with one two-stage ring. Their
  // waits at the tile's start were 0.16 key-loop passes a tile (NOTES.md, (10)); measured (v30, locked clocks) +0.9% /
  // +2.2% / +2.0% / +1.6% at L 1k / 2k / 4k / 16k, the key loop's K-full waits shrinking too.
  static constexpr bool kKAheadOfV = HeadDim == 128 && !Causal;
  static constexpr int kKStages = kStages + (kKAheadOfV ? 1 : 0);  // V has kStages
  // Under a causal mask a consumer stops after the last key block its 64 rows see; for the tile's later blocks it
  // only takes its turns and releases their stages. Where the blocks are as tall as the tile (128 keys, 128 rows)
  // every consumer sees part of every block when L_q = L_k, so they do without it (the code alone cost the
  // two-consumer D64 kernel 2-4% at L1k). Measured (NOTES.md, v14): +1.5-2.7% in the three-consumer D64 kernel
  // (L 2k-8k), +4% / +2% / +1% at D256 L 1k / 2k / 4k.
  static constexpr bool kSkipUnseenBlocks = Causal && kBlockN != kBlockM;
  // A consumer without rows (in a head's part-empty tile, where L_q is not a multiple of kBlockM: its first where the
  // tiles end at L_q, kTilesEndAtLq, its last otherwise) computes nothing and only takes its turns and releases the
  // buffers. With three consumers that happens at L mod 192 in 1..128, e.g. L = 1k, 2k, 4k. Measured (NOTES.md, v14):
  // with kSkipUnseenBlocks +5-6% at L 2k-4k and +3% at 8k in the three-consumer causal D64 kernel (the skip alone:
  // +1.5-2.7%). Without a mask it pays only on a grid that spreads the short tiles over the CTAs (launch.h,
  // sm90_static_grid; v15: +6.1% at L1k, +0.6% / +1.8% at 2k / 4k; v14 measured -1.5% to +0.5% on 132 CTAs, where each
  // CTA got the same query block of every head). Not with kLastOInV, whose last consumer computes every block.
  static constexpr bool kSkipRowlessConsumers = Consumers == 3;
  // Under a causal mask the three-consumer kernel's tiles end at L_q (rounded up to 16 rows: see Tile), so a head's
  // part-empty tile is its first, whose rows see the fewest keys, and starts at a negative row (where L_q mod 192 is in
  // 1..176). Measured (NOTES.md, v16), D64 causal: +5.8-5.9% at L1k, +1.1-1.7% at 2k, -1.0 to +2.3% at 4k-16k. Not in
  // the 128-row kernels: at an L_q that is not a multiple of 128 the diagonal then crosses a key block in every tile
  // (-0.9% to -2.5% at L 1000 and 3000: D64 at 1000, D128, D256; only D256 at 1300 gained, +5%); at a multiple of 128
  // nothing would change.
  static constexpr bool kTilesEndAtLq = Causal && Consumers == 3;
  // Turn-taking of the consumers' GEMMs: measured +10-15% at D64, +2-8% at D256, neutral at D128.
  static constexpr bool kPingPong = true;
  // Pin the softmax of S[n] before the wait for P[n-1] V[n-1]: ptxas otherwise hoists that wait above the softmax,
  // and the softmax never overlaps the warpgroup's own P V wgmma. Measured (NOTES.md, v7 and v11): +1-5% without a
  // mask (most at D256 and long L) and +2-5% at D64 causal; under a causal mask at D128 and D256 up to 2-4% slower.
  static constexpr bool kSoftmaxUnderPV = !Causal || HeadDim == 64;
  // Q buffers: with two the producer loads the next tile's Q while this tile runs. Pays only at D64 (+1-5% with the
  // turns running across tiles: a consumer that starts the next tile early would otherwise wait for its Q); neutral at
  // D128 (where Q now comes from registers, its buffer free at once); no room at D256 (NOTES.md, v7).
  static constexpr int kQStages = HeadDim == 64 ? 2 : 1;
  // Q as the A operand of S = Q K^T from registers (RS wgmma), loaded once per tile with ldmatrix and its shared
  // memory released at once: a fifth less shared memory read per 128-key block (Q 16 KB beside K and V, 32 KB each),
  // and the producer loads the next tile's Q early. 32 registers a thread at D128: room only beside 128-key blocks
  // (S 64, P 32, O 64).
  static constexpr bool kQInRegisters = HeadDim == 128 && kBlockN == 128;
  // After a tile's first key block, take each block's exponentials against the row's reference without the block's
  // max (RowSoftmax::exp_against_reference): no max chain and no shuffles before the exp2s, no O rescale. A block
  // whose exponentials grow too large for that (rare: a row's scores rising far above every earlier block's) has its
  // S computed again and takes the max-based update. Measured (NOTES.md, v22), L 1k-16k: +2-10% at D128 without a
  // mask, +1.5-7% causal, +5-7% at D64; at D256 -1.7% to +1.5%, where the recompute's wgmmas also spill, so not there.
  static constexpr bool kOptimisticExp = HeadDim != 256;
  // Without kOptimisticExp (D256): rescale O only on blocks where a row's reference max moved (RowSoftmax::update,
  // kLazy). Measured (NOTES.md, v12): +2-6% at D256 (+0-3% at D64 with three consumers; neutral at D128 causal, 4%
  // slower in the two-consumer causal D64 kernel, before kOptimisticExp).
  static constexpr bool kLazyRescale = !kOptimisticExp;
  static constexpr int kNThreads = (1 + kConsumers) * 128;
  static constexpr int kColumnBlocks = HeadDim / 64;  // 64-column sub-tiles (one TMA box / swizzle atom wide)
  static constexpr int kTileQ = kBlockM * HeadDim;    // elements
  static constexpr int kTileKV = kBlockN * HeadDim;
  static constexpr int kSubTileQ = kBlockM * 64;
  static constexpr int kSubTileKV = kBlockN * 64;
  static constexpr int kTileO = 64 * HeadDim;  // one consumer's rows of O
  static constexpr int kSubTileO = 64 * 64;
  // O leaves through shared memory and TMA stores (whole 128-byte lines, no scattered 4-byte stores; the tensor map
  // clips rows past Lq and columns past D): through a staging buffer per consumer beside Q and the K/V ring, or, where
  // shared memory is short, the V stage a tile's last P V has read and one buffer or the Q rows (kLastOInV, kOInQ,
  // below). Measured against direct 4-byte stores (NOTES.md, v10, v11 and v23): +5-11% at D128 L1k, +0-6% at 2k-4k;
  // at D64 without a mask +3% / +2% at L 1k / 2k and neutral above since kOptimisticExp (before it 0-6% slower there).
  static constexpr int kMaxSmemBytes = 227 * 1024;
  // Room for the mbarriers, the tile mailbox and the scratch word (SharedStorage; checked below): three consumers with
  // three K/V stages need 268 bytes.
  static constexpr int kBarrierBytes = kConsumers == 3 && kStages == 3 ? 512 : 256;
  static constexpr int kPipelineBytes =
      (kQStages * kTileQ + (kKStages + kStages) * kTileKV) * 2 + 1024 /* alignment */ + kBarrierBytes;
  static constexpr int kOBuffers = kPipelineBytes + kConsumers * kTileO * 2 <= kMaxSmemBytes ? kConsumers
                                   : kPipelineBytes + kTileO * 2 <= kMaxSmemBytes             ? 1
                                                                                               : 0;
  static constexpr int kSmemBytes = kPipelineBytes + kOBuffers * kTileO * 2;  // 16-bit elements
  // Where no staging buffer fits (D256 with 80-key blocks), the first consumer stages its O
  // - without a mask, in the K stage of its tile's last key block, which every consumer's last S GEMM has read
  //   (kFirstOInK); the producer loads that stage's next K (the next tile's second block) once the O has left
  //   (kOInKLeavesAtStore). Q then loads in one part per consumer, each free after its consumer's last S GEMM
  //   (kQPerConsumer). Measured at locked clocks against kOInQ (NOTES.md, v20): +4.1% / +1.9% / +2.0% at L 2k / 4k /
  //   8k;
  // - under a causal mask, in its own rows of the Q buffer (kOInQ), which its last S GEMM has read. Q then loads in one
  //   part per consumer (64-row boxes), the first consumer's once its O has left. Measured against direct stores
  //   (v13): +2-7% at L 2k-16k. There kFirstOInK measured -2.2% at 4k, +1.1% at 8k (v20): causal tiles are shorter,
  //   so the next tile's second K, which waits for the O store, is needed sooner.
  static constexpr bool kFirstOInK = kOBuffers == 0 && kQStages == 1 && !Causal;
  static constexpr bool kOInQ = kOBuffers == 0 && kQStages == 1 && Causal;
  static_assert(!kQInRegisters || !kOInQ, "with Q in registers its shared memory is released before the epilogue");
  static_assert(kOBuffers > 0 || kFirstOInK || kOInQ, "every consumer needs somewhere to stage its O");
  // Where shared memory has no buffer per consumer (D256 with 64-key blocks: one buffer, for the first consumer; with
  // 80-key blocks: kFirstOInK or kOInQ), the last consumer stages its O in the V stage of its tile's last key block,
  // once every consumer's last P V has read it; the producer loads that stage's next V (a later tile's, the next one's
  // second block where it has two) once the O has left. The first consumer finishes first, so it is the one that does
  // not wait for the other. Before, the two took turns on the one buffer, or both staged in their Q rows and waited for
  // their reload. Measured at locked clocks (NOTES.md, v19): D256 causal 80-key blocks +7.3% / +7.7% at L 4k / 8k,
  // 64-key +3.0-3.4% at 512; D128 without a mask (then 176-key blocks) +1.3-1.5% at 1k; the others within -0.9% to
  // +0.6%.
  static constexpr bool kLastOInV = kOBuffers == 1 || kOInQ || kFirstOInK;
  // With kFirstOInK the next tile's second K block loads into the K stage that holds the first consumer's O, so that O
  // is released as soon as its TMA store has read it, not after the next tile's first S GEMM is issued.
  static constexpr bool kOInKLeavesAtStore = kFirstOInK;
  // Within a tile the producer requests each block's K before the previous block's V (the tile's last V after its last
  // K), in the same two-stage rings. K[n + 2] then waits only for S[n] (its stage's release), not behind V[n + 1],
  // which waits for P[n - 1] V[n - 1], a GEMM later, and for its own TMA issue. At short L the K/V blocks come from
  // DRAM (each head's are shared by only L / 128 CTAs), and a clock64 timeline of this kernel at L 1k showed every
  // second key block waiting about 330 cycles for its K (2.9k cycles against 2.59k); with the order changed every block
  // took 2.59k. Across tiles the order stays: the next tile's first K follows this tile's last V. Measured in one
  // process with cuDNN, three calls on three cards (NOTES.md, (43)-(44)): +1.0 / +1.1 / +1.0 / +0.8 / +0.9% (8 rounds)
  // at L 1k / 2k / 4k / 8k / 16k, and +1.4 / +1.8 / +1.0 / +1.3 / -1.2% and -0.2 / +2.1 / +0.3 / +1.4 / -1.5% (6
  // rounds). Written for the 80-key kernel without a mask (kFirstOInK) only, the one measured.
  static constexpr bool kKAheadInTile = kFirstOInK;
  // Q in one part per consumer, each reloaded once its consumer's last S GEMM has read it (the first consumer's
  // before the last's): with kOInQ, and with kFirstOInK, where Q loads whole otherwise. Measured with
  // kOInKLeavesAtStore against neither (NOTES.md, v27; D256 without a mask): +1.2% / +1.0% / +0.8% / +0.4% / +0.1% at
  // L 1k / 2k / 4k / 8k / 16k; each alone -0.7% to +1.1%, no steady gain.
  static constexpr bool kQPerConsumer = kFirstOInK;
  static constexpr int kQParts = kOInQ || kQPerConsumer ? kConsumers : 1;
  // Each warp's 16 rows of O leave in one TMA store where D is a multiple of 64 (a 5-D map with the 64-column blocks
  // as a dimension; the warp stages its rows block after block), not in one store per 64-column block, whose issues
  // stall the warp in turn (ncu, NOTES.md v27). Not with kOInQ: its staging is the Q rows, whose blocks lie a whole Q
  // sub-tile apart. Measured at locked clocks (NOTES.md, v28): +0.3% to +0.5% at D256 without a mask (L 1k-4k), +0.9%
  // at D128 without a mask (1k), +1.2% / +1.0% causal at D256 L1k / D128 L2k.
  static constexpr bool kOOneStorePerWarp = kColumnBlocks > 1 && !kOInQ;
  __host__ __device__ static constexpr bool o_one_store(int head_dim) {
    return kOOneStorePerWarp && head_dim % 64 == 0;
  }
  // Producer keeps few registers, consumers get the rest: (24 + 2 * 240) * 128 or (24 + 3 * 160) * 128 <= 64K.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : 240;
  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256, "the Hopper forward covers head dims 64, 128, 256");
  // setmaxnreg.inc blocks until registers are free: the rebalanced total must fit what the launch granted
  // (65536 / kNThreads per thread at entry, rounded down to a multiple of 8).
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static_assert(kQStages == 1 || kQStages == 2, "one or two Q buffers");
  static_assert(!kLastOInV || (kConsumers == 2 && kTileKV >= kTileO),
                "O in the last V stage: two consumers, the second's O within one V stage");
  // The last consumer's rows are the tile's last, so it computes up to the tile's last key block (kSkipUnseenBlocks
  // skips only blocks past a consumer's rows) unless it skips the tile for want of rows.
  static_assert(!kLastOInV || !kSkipRowlessConsumers, "O in the last V stage: the last consumer computes every block");
  // A consumer's rows end kBlockM - 64 keys before its tile's, so it skips at most this many blocks. It passes them
  // before it releases its last V stage: were that many to reach its last stage again, that load would wait for it.
  static_assert(!kSkipUnseenBlocks || (kBlockM - 64 + kBlockN - 1) / kBlockN < kStages,
                "a consumer would skip as many key blocks as there are stages");
  static_assert((2 * kQStages * kQParts + 2 * kKStages + 2 * kStages + 4 * kOBuffers + (kLastOInV ? kStages : 0) +
                 (kFirstOInK ? kKStages : 0) + 4) * 8 + 3 * 4 <= kBarrierBytes,
                "the mbarriers, the tile mailbox and the scratch word exceed kBarrierBytes");
  // K ahead of V is written and tested for the D128 kernel without a mask only: the code that stages O in a K or V
  // stage (kFirstOInK, kLastOInV) counts K and V stages alike, and pass_blocks (skipped blocks) has not run with it.
  static_assert(!kKAheadOfV || (!kLastOInV && !kFirstOInK && !kSkipUnseenBlocks && !kSkipRowlessConsumers),
                "K ahead of V: not with O staged in the rings or with consumers that skip key blocks");
  static_assert(!kKAheadInTile || (!kKAheadOfV && kKStages == kStages && !kStreamKTail && !kDynamicTiles),
                "K ahead within a tile: written for the static schedule, with K and V rings of equal length");
  static_assert((kProducerRegs + kConsumers * kConsumerRegs) * 128 <= (65536 / kNThreads / 8) * 8 * kNThreads,
                "producer + consumer registers exceed the register file");
};

// The shared-memory pipeline: Q buffers, K and V stages, each with its "full" and "empty" mbarriers, and the O
// staging buffers with their "free" mbarriers.
template <typename T, typename Traits>
struct SharedStorage {
  T* q;                   // [kQStages][kColumnBlocks][kBlockM][64]
  T* k;                   // [kKStages][kColumnBlocks][kBlockN][64]
  T* v;                   // [kStages][kColumnBlocks][kBlockN][64]
  T* o;                   // [kOBuffers][kColumnBlocks][64][64]
  uint64_t* q_full;       // [kQStages][kQParts]
  uint64_t* q_empty;      // [kQStages][kQParts]
  uint64_t* k_full;       // [kKStages], k_empty the same; v_full and v_empty [kStages]
  uint64_t* v_full;
  uint64_t* k_empty;
  uint64_t* v_empty;
  uint64_t* o_free;       // [kOBuffers][4]: the TMA stores have read warp w's staged rows (one buffer per consumer)
  uint64_t* o_in_v_free;  // [kStages] with kLastOInV: the TMA stores have read the O staged in V stage s
  uint64_t* o_in_k_free;  // [kKStages] with kFirstOInK: the same for K stage s
  uint64_t* tile_full;    // [2]: the producer published the next tile index in tile_index[slot]
  uint64_t* tile_empty;   // [2]: every consumer has read it
  int* tile_index;        // [2]
  uint32_t* scratch;      // target of keep_before_wgmma_wait's never-taken store

  __device__ explicit SharedStorage(unsigned char* raw) {
    // Swizzled tiles need 1024-byte alignment; dynamic shared memory only promises 16.
    q = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    k = q + Traits::kQStages * Traits::kTileQ;
    v = k + Traits::kKStages * Traits::kTileKV;
    o = v + Traits::kStages * Traits::kTileKV;
    q_full = reinterpret_cast<uint64_t*>(o + Traits::kOBuffers * Traits::kTileO);
    q_empty = q_full + Traits::kQStages * Traits::kQParts;
    k_full = q_empty + Traits::kQStages * Traits::kQParts;
    v_full = k_full + Traits::kKStages;
    k_empty = v_full + Traits::kStages;
    v_empty = k_empty + Traits::kKStages;
    o_free = v_empty + Traits::kStages;
    o_in_v_free = o_free + 4 * Traits::kOBuffers;
    o_in_k_free = o_in_v_free + (Traits::kLastOInV ? Traits::kStages : 0);
    tile_full = o_in_k_free + (Traits::kFirstOInK ? Traits::kKStages : 0);
    tile_empty = tile_full + 2;
    tile_index = reinterpret_cast<int*>(tile_empty + 2);
    scratch = reinterpret_cast<uint32_t*>(tile_index + 2);
  }
  __device__ T* q_stage(int stage) const { return q + stage * Traits::kTileQ; }
  __device__ T* k_stage(int stage) const { return k + stage * Traits::kTileKV; }
  __device__ T* v_stage(int stage) const { return v + stage * Traits::kTileKV; }
  __device__ T* o_buffer(int buffer) const { return o + buffer * Traits::kTileO; }
};

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

// The same with Q from registers (kQInRegisters: load_q_fragments).
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
    sm80::ldmatrix_x4(q[kk], q_rows + (kk / 4) * Traits::kSubTileQ + sw128_offset(row, chunk));
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

// Online softmax over one block of scores, in place: s becomes exp2(s * scale_log2 - row max) (masked entries 0),
// the running max and sum of the thread's two rows (h = 0, 1: rows r and r + 8) are updated, and the factor the
// old O rows must be multiplied by is returned in rescale. Rows live in 4-lane quads, as in the sm80 kernel.
// With kLazy the max a row's exponentials are taken against (the reference) moves only when the block's max exceeds
// it by more than kLazyRescaleLog2 in log2 units, so the exponentials stay below 2^8 (far from overflow in fp32 sums
// and in 16-bit P) and O needs rescaling only on blocks where some row moved; update returns whether one of the
// thread's rows did. After the first blocks of a row that is rare.
inline constexpr float kLazyRescaleLog2 = 8.f;
// The exponentials' base in log2 units for a row whose reference max is `reference`: 0 for a row that has seen no key
// (-inf), so its exponentials stay 0 rather than NaN.
__device__ __forceinline__ float softmax_base_log2(float reference, float scale_log2) {
  return reference == -INFINITY ? 0.f : reference * scale_log2;
}
// kOptimisticExp accepts a block's exponentials against the unmoved reference while each row's sum over the thread's
// columns stays below this (2^14): every exponential then fits in fp16 (65504) as well as bf16 and fp32.
inline constexpr float kOptimisticSumLimit = 16384.f;
template <int kBlockN>
struct RowSoftmax {
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  // last_col[h]: the last key column (relative to the block, already minus this lane's column offset) row h may
  // see; needs_mask false skips the comparisons on blocks that are fully inside the ragged and causal limits.
  __device__ __forceinline__ static void mask(float (&s)[kBlockN / 2], bool negate, bool needs_mask,
                                              const int (&last_col)[2]) {
    if (needs_mask || negate) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& x = s[4 * j + 2 * h + c];
            if (negate) x = -x;
            if (needs_mask && 8 * j + c > last_col[h]) x = -INFINITY;
          }
        }
      }
    }
  }

  // Row h's entries of s become exp2(s * scale_log2 - base); returns their sum.
  __device__ __forceinline__ static float exp_row(float (&s)[kBlockN / 2], int h, float scale_log2, float base) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& x = s[4 * j + 2 * h + c];
        x = sm80::fast_exp2(fmaf(x, scale_log2, -base));
        sum += x;
      }
    }
    return sum;
  }

  // kOptimisticExp: s becomes exp2(s * scale_log2 - reference) with the references unmoved, and block_sum the rows'
  // sums over this thread's columns. Returns whether they can stand: every row below the bound (NaN passes, as it
  // would through the max) and no row without a reference (-inf) saw a key. The caller votes over the warpgroup, then
  // either adds block_sum (accept) or recomputes S (s is spent) and takes update<false>.
  __device__ __forceinline__ bool exp_against_reference(float (&s)[kBlockN / 2], float scale_log2, bool negate,
                                                        bool needs_mask, const int (&last_col)[2],
                                                        float (&block_sum)[2]) const {
    mask(s, negate, needs_mask, last_col);
    bool fits = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      block_sum[h] = exp_row(s, h, scale_log2, softmax_base_log2(row_max[h], scale_log2));
      // Bitwise, not short-circuit: no branches in the key loop.
      fits &= !(block_sum[h] >= kOptimisticSumLimit) & (block_sum[h] == 0.f | row_max[h] != -INFINITY);
    }
    return fits;
  }

  template <bool kLazy>
  __device__ __forceinline__ bool update(float (&s)[kBlockN / 2], float scale_log2, bool negate, bool needs_mask,
                                         const int (&last_col)[2], float (&rescale)[2]) {
    bool moved = false;
    mask(s, negate, needs_mask, last_col);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_max = row_max[h];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) block_max = fmaxf(block_max, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 2));
      // From -inf any finite max moves it; -inf to -inf (a row with no key yet) does not (NaN compares false).
      const bool move = !kLazy || (block_max - row_max[h]) * scale_log2 > kLazyRescaleLog2;
      const float reference = move ? block_max : row_max[h];
      const float base = softmax_base_log2(reference, scale_log2);
      rescale[h] = move ? sm80::fast_exp2(row_max[h] * scale_log2 - base) : 1.f;
      row_max[h] = reference;
      moved |= move;
      row_sum[h] = row_sum[h] * rescale[h] + exp_row(s, h, scale_log2, base);
    }
    return moved;
  }
};

template <int kHeadDim>
__device__ __forceinline__ void rescale_o(float (&o)[kHeadDim / 2], const float (&rescale)[2]) {
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[4 * j + i] *= rescale[i / 2];
  }
}

// One output tile: a block of kBlockM query rows of one (batch, head), and the key blocks it sees. Only what the
// main loop needs is kept; the rest is derived where it is used (the consumers are short of registers).
// With kTilesEndAtLq a head's first tile starts at a negative row where the tiles overhang L_q by 16 rows or more
// (L_q mod 192 in 1..176): TMA zero-fills those rows of Q, the consumers without rows there compute nothing, and no
// O or lse is stored for them.
// Tiles that start at 0 would leave the part-empty tile at the end of the head, where its rows see every key.
template <typename Traits, bool kCausal>
struct Tile {
  int m_start, head, batch, num_n_blocks;

  // Tiles are numbered with the query block fastest, so the CTAs running at one time share K/V in L2; under a
  // causal mask each head's longest rows come first.
  __device__ Tile(int index, int num_m_blocks, const FwdParams& p) {
    const int m_index = index % num_m_blocks;
    const int m_block = kCausal ? num_m_blocks - 1 - m_index : m_index;
    head = (index / num_m_blocks) % p.heads;
    batch = index / num_m_blocks / p.heads;
    // kTilesEndAtLq: the rows before 0 in a head's first tile, rounded down to whole 16-row O store boxes, which are
    // skipped there (a TMA store at a negative row faults, where a load zero-fills: NOTES.md v16), so the last tile
    // ends at most 15 rows past L_q.
    const int rows_before_zero =
        Traits::kTilesEndAtLq ? (num_m_blocks * Traits::kBlockM - p.len_q) / 16 * 16 : 0;
    m_start = m_block * Traits::kBlockM - rows_before_zero;
    const int n_end = kCausal ? max(0, min(p.len_k, m_end(p) + p.len_k - p.len_q)) : p.len_k;
    num_n_blocks = (n_end + Traits::kBlockN - 1) / Traits::kBlockN;
  }
  // The tile's rows: m_first() .. m_end(p) - 1.
  __device__ int m_first() const { return Traits::kTilesEndAtLq ? max(m_start, 0) : m_start; }
  __device__ int m_end(const FwdParams& p) const { return min(m_start + Traits::kBlockM, p.len_q); }
  __device__ int key_start(int n_block) const { return n_block * Traits::kBlockN; }  // the key block's first key
  __device__ int kv_head(const FwdParams& p) const { return head / p.heads_per_kv; }
  template <typename T>
  __device__ T* out(const FwdParams& p) const {
    return static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride;
  }
  __device__ float* lse(const FwdParams& p) const {
    return p.lse + (static_cast<int64_t>(batch) * p.heads + head) * p.len_q;
  }
};

// The causal counter hands out tiles in this order: head by head (each head's longest rows first, so the CTAs at work
// share K/V in L2), except that the last tail_heads (batch, head) pairs' tiles go longest first across those heads.
// Head by head to the end, the last tiles handed out include long ones, and the CTAs that take them finish up to a
// long tile after the others: 4-5% above an even share at D64, 6-7% at D128, 11-15% at D256 on the benchmark's
// shapes (benchmarks/schedule_balance.py); ending on the shortest tiles brings that to 1-3%. The tail covers about
// kCounterTailRounds tiles per CTA (the model's best of 1-4).
inline constexpr int kCounterTailRounds = 3;
__device__ __forceinline__ int counter_order(int n, int num_m_blocks, int num_tiles, int tail_heads) {
  const int tail_start = num_tiles - tail_heads * num_m_blocks;
  if (n < tail_start || n >= num_tiles) return n;
  const int r = n - tail_start;
  return tail_start + (r % tail_heads) * num_m_blocks + r / tail_heads;  // query block r / tail_heads, longest first
}

// The schedule without a mask where kStreamKTail: CTA c takes the whole tiles c, c + grid, ... below num_tiles -
// p.sk_tiles, then its share of the key blocks of the last p.sk_tiles tiles (stream-K, launch.h: sm90_stream_k_tiles):
// blocks c * I / grid .. (c + 1) * I / grid - 1 of I = sk_tiles * num_n_blocks, counted from block 0 of the first of
// those tiles. Each share is at least one tile long, so a tile is split between at most two neighbouring CTAs: the part
// that ends CTA c's share (blocks 0 .. k - 1) and the part that starts CTA c + 1's (k ..); boundary c names both. The
// producer and the consumers each walk it.
struct StaticSchedule {
  int next_whole, whole_tiles, num_n_blocks;
  int position, share_end;  // in key blocks from block 0 of tile whole_tiles

  __device__ StaticSchedule(const FwdParams& p, int num_tiles, int n_blocks) {
    next_whole = blockIdx.x;
    whole_tiles = num_tiles - p.sk_tiles;
    num_n_blocks = n_blocks;
    const int64_t blocks = static_cast<int64_t>(p.sk_tiles) * n_blocks;
    position = static_cast<int>(blocks * blockIdx.x / gridDim.x);
    share_end = static_cast<int>(blocks * (blockIdx.x + 1) / gridDim.x);
  }
  // The next unit of work: tile `tile`, key blocks n_begin .. n_end - 1. False once the CTA is done.
  __device__ bool next(int& tile, int& n_begin, int& n_end) {
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
};

// A warp's 16 rows of a tile split between two CTAs (StaticSchedule): its part of O (unnormalised), row maxima and
// row sums in registers; `first_part`: it holds the tile's first key blocks. The warp that gets here first (a lock per
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

// Persistent: one CTA per SM or fewer (launch_fwd_sm90). Its first tile is blockIdx.x (with the counter,
// counter_order(blockIdx.x)); then a fixed stride of gridDim.x, or, with kDynamicTiles, the producer takes the next one
// from params.tile_counter (or from the zigzag rounds where the host passed none) and hands its index to the consumers
// through a 2-slot mailbox in shared memory. The producer runs ahead into the next tile (its Q as soon as the consumers
// are done with that Q buffer, its K/V through the same ring), so loads and the first GEMM of a tile overlap the
// epilogue of the previous one. With kOInQ the first consumer's part of the Q buffer is free only once that consumer
// has stored its O from it, and the producer loads the parts in order before the next tile's K/V.
template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap o_map,
                          const __grid_constant__ FwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kColumnBlocks = Traits::kColumnBlocks;
  using TileT = Tile<Traits, kCausal>;

  const int num_m_blocks = (p.len_q + kBlockM - 1) / kBlockM;
  const int num_tiles = num_m_blocks * p.heads * p.batch;  // flash_api bounds it well below 2^31

  extern __shared__ unsigned char smem_raw[];
  const SharedStorage<T, Traits> smem(smem_raw);
  if (threadIdx.x == 0) {
    constexpr int kConsumerThreads = Traits::kConsumers * 128;
    for (int s = 0; s < Traits::kQStages * Traits::kQParts; ++s) {
      mbarrier_init(&smem.q_full[s], 1);
      // Every thread of the part's consumers arrives after its last S GEMM (one without rows, once Q has landed); with
      // kOInQ lane 0 of each warp of the part's consumer: the first consumer's once its staged O has been stored, the
      // last's after its last S GEMM (its O goes to a V stage, kLastOInV).
      mbarrier_init(&smem.q_empty[s], Traits::kOInQ ? 4 : kConsumerThreads / Traits::kQParts);
    }
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&smem.k_full[s], 1);
      mbarrier_init(&smem.v_full[s], 1);
      mbarrier_init(&smem.k_empty[s], kConsumerThreads);  // every consumer thread arrives once it has read the stage
      mbarrier_init(&smem.v_empty[s], kConsumerThreads);
    }
    for (int s = kStages; s < Traits::kKStages; ++s) {  // K's extra stage (kKAheadOfV)
      mbarrier_init(&smem.k_full[s], 1);
      mbarrier_init(&smem.k_empty[s], kConsumerThreads);
    }
    for (int b = 0; b < 4 * Traits::kOBuffers; ++b) mbarrier_init(&smem.o_free[b], 1);  // the warp's lane 0
    if constexpr (Traits::kLastOInV) {
      for (int s = 0; s < kStages; ++s) mbarrier_init(&smem.o_in_v_free[s], 4);  // lane 0 of each warp
    }
    if constexpr (Traits::kFirstOInK) {
      for (int s = 0; s < Traits::kKStages; ++s) mbarrier_init(&smem.o_in_k_free[s], 4);
    }
    for (int slot = 0; slot < 2; ++slot) {
      mbarrier_init(&smem.tile_full[slot], 1);
      mbarrier_init(&smem.tile_empty[slot], kConsumerThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // Both sides count the same things in the same order: Q loads (tiles with at least one key block) and K/V
  // blocks; a count gives the ring stage and the mbarrier phase parity.
  // Values every lane of a warp shares are broadcast from lane 0 (here and for the tile index): ptxas then knows they
  // are warp-uniform, keeps the tile and pipeline arithmetic in uniform registers and needs no convergence barriers
  // in the key loop (NOTES.md, v11).
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  if (warpgroup == 0) {  // ---------------------------------------------------------------------------- producer
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    int q_loads = 0, kv_loads = 0;
    // kLastOInV, a bit per stage: the stage's V holds the last consumer's staged O, and the parity of its o_in_v_free.
    [[maybe_unused]] uint32_t o_in_v = 0, o_in_v_parity = 0;
    [[maybe_unused]] uint32_t o_in_k = 0, o_in_k_parity = 0;  // the same for K stages with kFirstOInK
    // Before a stage holding a staged O (its bit in `holds`) is reloaded, the O has to have left (`freed[stage]`).
    [[maybe_unused]] const auto wait_staged_o_left = [](uint32_t& holds, uint32_t& parity, uint64_t* freed, int stage) {
      if ((holds >> stage) & 1) {
        mbarrier_wait(&freed[stage], (parity >> stage) & 1);
        holds &= ~(1u << stage);
        parity ^= 1u << stage;
      }
    };
    // kKAheadOfV: a block's V load waits until the next block's K is issued (the next tile's first where this was the
    // tile's last); its first key row, kv head and batch are held until then. kKAheadInTile: until the tile's next K.
    [[maybe_unused]] int held_v_row = 0, held_v_head = 0, held_v_batch = 0;
    [[maybe_unused]] const auto load_v = [&](int count, int row, int kv_head, int batch) {  // count: its K's kv_loads
      const int stage = count % kStages;
      const int use = count / kStages;
      if (use > 0) mbarrier_wait(&smem.v_empty[stage], (use - 1) & 1);
      if constexpr (Traits::kLastOInV) wait_staged_o_left(o_in_v, o_in_v_parity, smem.o_in_v_free, stage);
      mbarrier_arrive_expect_tx(&smem.v_full[stage], Traits::kTileKV * sizeof(T));
      for (int c = 0; c < kColumnBlocks; ++c) {
        tma_load_4d(smem.v_stage(stage) + c * Traits::kSubTileKV, &v_map, &smem.v_full[stage], 64 * c, row, kv_head,
                    batch);
      }
    };
    int index = blockIdx.x;
    int n_begin = 0, n_end = 0;  // the key blocks of tile `index` this CTA computes (all but with stream-K)
    StaticSchedule schedule(p, num_tiles, (p.len_k + kBlockN - 1) / kBlockN);
    if (Traits::kStreamKTail && !schedule.next(index, n_begin, n_end)) index = num_tiles;
    int tail_heads = 0;  // with the counter: the (batch, head) pairs whose tiles go longest first (counter_order)
    if (Traits::kDynamicTiles && p.tile_counter != nullptr) {
      const int tail_tiles = kCounterTailRounds * static_cast<int>(gridDim.x);
      tail_heads = min(p.batch * p.heads, (tail_tiles + num_m_blocks - 1) / num_m_blocks);
      index = counter_order(index, num_m_blocks, num_tiles, tail_heads);
    }
    for (int j = 0;; ++j) {
      if constexpr (Traits::kDynamicTiles) {  // publish tile j's index (-1: done) to the consumers
        const int slot = j % 2;
        if (j >= 2) mbarrier_wait(&smem.tile_empty[slot], ((j / 2) - 1) & 1);
        smem.tile_index[slot] = index < num_tiles ? index : -1;
        mbarrier_arrive(&smem.tile_full[slot]);
      }
      if (index >= num_tiles) break;
      const TileT tile(index, num_m_blocks, p);
      if (!Traits::kStreamKTail) n_end = tile.num_n_blocks;
      if (n_end > n_begin) {
        const int q_stage = q_loads % Traits::kQStages;
        const int q_use = q_loads / Traits::kQStages;
        ++q_loads;
        for (int part = 0; part < Traits::kQParts; ++part) {
          constexpr int kPartRows = kBlockM / Traits::kQParts;
          uint64_t* const full = &smem.q_full[q_stage * Traits::kQParts + part];
          if (q_use > 0) mbarrier_wait(&smem.q_empty[q_stage * Traits::kQParts + part], (q_use - 1) & 1);
          mbarrier_arrive_expect_tx(full, Traits::kTileQ / Traits::kQParts * sizeof(T));
          for (int c = 0; c < kColumnBlocks; ++c) {
            tma_load_4d(smem.q_stage(q_stage) + c * Traits::kSubTileQ + part * kPartRows * 64, &q_map, full, 64 * c,
                        tile.m_start + part * kPartRows, tile.head, tile.batch);
          }
        }
      }
      // K and V of a block go into the same stage index; each waits only for its own "empty" barrier, K[n + 1] for
      // S[n - 1], V[n] for P[n - 2] V[n - 2]. One thread issues them in order, so in the plain order K[n + 1] also
      // waits behind V[n]. With kKAheadInTile V[n] is requested after K[n + 1] within a tile; with kKAheadOfV, K has a
      // ring of its own a stage longer and V[n] is requested after K[n + 1] across tiles too: K[n + 1] waits for the
      // release of K[n - 2] (its softmax), so K runs at most one block ahead of V. The plain order keeps its own copy
      // of the V load rather than calling load_v: one load_k / load_v pair for both (TMA loops rolled) measured -1.35%
      // at D256 L1k (NOTES.md, (22)), and load_v in its place changes the SASS of six other kernels (checked in session
      // 27, not measured).
      for (int n_block = n_begin; n_block < n_end; ++n_block, ++kv_loads) {
        if constexpr (Traits::kKAheadOfV) {
          const int stage = kv_loads % Traits::kKStages;
          const int use = kv_loads / Traits::kKStages;
          if (use > 0) mbarrier_wait(&smem.k_empty[stage], (use - 1) & 1);
          mbarrier_arrive_expect_tx(&smem.k_full[stage], Traits::kTileKV * sizeof(T));
          for (int c = 0; c < kColumnBlocks; ++c) {
            tma_load_4d(smem.k_stage(stage) + c * Traits::kSubTileKV, &k_map, &smem.k_full[stage], 64 * c,
                        tile.key_start(n_block), tile.kv_head(p), tile.batch);
          }
          if (kv_loads > 0) load_v(kv_loads - 1, held_v_row, held_v_head, held_v_batch);
          held_v_row = tile.key_start(n_block);
          held_v_head = tile.kv_head(p);
          held_v_batch = tile.batch;
          continue;
        }
        const int stage = kv_loads % kStages;
        const int use = kv_loads / kStages;
        const int row = tile.key_start(n_block);
        if (use > 0) mbarrier_wait(&smem.k_empty[stage], (use - 1) & 1);
        if constexpr (Traits::kFirstOInK) wait_staged_o_left(o_in_k, o_in_k_parity, smem.o_in_k_free, stage);
        mbarrier_arrive_expect_tx(&smem.k_full[stage], Traits::kTileKV * sizeof(T));
        for (int c = 0; c < kColumnBlocks; ++c) {
          tma_load_4d(smem.k_stage(stage) + c * Traits::kSubTileKV, &k_map, &smem.k_full[stage], 64 * c, row,
                      tile.kv_head(p), tile.batch);
        }
        if constexpr (Traits::kKAheadInTile) {  // the V of the block before
          if (n_block > n_begin) load_v(kv_loads - 1, row - kBlockN, tile.kv_head(p), tile.batch);
          continue;
        }
        if (use > 0) mbarrier_wait(&smem.v_empty[stage], (use - 1) & 1);
        if constexpr (Traits::kLastOInV) wait_staged_o_left(o_in_v, o_in_v_parity, smem.o_in_v_free, stage);
        mbarrier_arrive_expect_tx(&smem.v_full[stage], Traits::kTileKV * sizeof(T));
        for (int c = 0; c < kColumnBlocks; ++c) {
          tma_load_4d(smem.v_stage(stage) + c * Traits::kSubTileKV, &v_map, &smem.v_full[stage], 64 * c, row,
                      tile.kv_head(p), tile.batch);
        }
      }
      if (Traits::kKAheadInTile && n_end > n_begin) {  // the tile's last V, before its stage is marked as O's
        load_v(kv_loads - 1, tile.key_start(n_end - 1), tile.kv_head(p), tile.batch);
      }
      if (Traits::kLastOInV && n_end > n_begin) o_in_v |= 1u << ((kv_loads - 1) % kStages);  // the tile's last block
      if (Traits::kFirstOInK && n_end > n_begin) o_in_k |= 1u << ((kv_loads - 1) % kStages);
      // Next tile. Without a mask: a fixed stride, then a share of the last tiles' key blocks (StaticSchedule).
      // Causal with a counter: take the next tile once this one is issued (each head's longest rows come first, so
      // this is longest-first within a head, and the CTAs at work stay on neighbouring heads; the last tail_heads
      // heads longest first across them, counter_order). Causal without one: the next zigzag round (launch.h).
      if (Traits::kStreamKTail) {
        if (!schedule.next(index, n_begin, n_end)) index = num_tiles;
      } else if (!Traits::kDynamicTiles) {
        index += gridDim.x;
      } else if (p.tile_counter != nullptr) {
        index = counter_order(gridDim.x + atomicAdd(p.tile_counter, 1), num_m_blocks, num_tiles, tail_heads);
      } else {
        const int round = j + 1;
        index = round * gridDim.x + (round % 2 == 0 ? blockIdx.x : gridDim.x - 1 - blockIdx.x);
      }
    }
    if constexpr (Traits::kKAheadOfV) {
      if (kv_loads > 0) load_v(kv_loads - 1, held_v_row, held_v_head, held_v_batch);  // the last block's V
    }
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int consumer = warpgroup - 1;      // rows 64 * consumer .. of the block
  const int warp = __shfl_sync(0xffffffff, threadIdx.x / 32, 0) % 4;  // warp inside the warpgroup: 16 rows each
  const int lane = threadIdx.x % 32;
  const int row_in_block0 = 64 * consumer + 16 * warp + lane / 4;  // + 8 for the second row of the thread

  // Ping-pong: consumer c waits on barrier 1 + c before issuing its GEMMs and then lets the next one go (round robin).
  // Every consumer takes one turn per key block of the tile, including the blocks it skips (pass_blocks), so all take
  // the same number of turns. Consumer 0 goes first (the last consumer's arrival opens it). The turns run on from tile
  // to tile rather than restarting with consumer 0 in each, so a consumer that has finished its epilogue starts the
  // next tile while the others still store theirs (NOTES.md: +1-5% at D64/D128 in v7, +1-5% at D256 causal once the
  // indices were warp-uniform in v11). Consumer 0 takes up the last consumer's final hand-over after its last tile, so
  // no arrival is left over when the CTA ends.
  constexpr int kLastConsumer = Traits::kConsumers - 1;
  // kOptimisticExp's vote over a consumer's 128 threads: barriers 1 + kConsumers .. 2 kConsumers, past the turns'.
  constexpr int kVoteBarrier = 1 + Traits::kConsumers;
  const auto wait_turn = [&] {
    if constexpr (Traits::kPingPong) named_barrier_sync(1 + consumer, 256);
  };
  const auto pass_turn = [&] {
    if constexpr (Traits::kPingPong) named_barrier_arrive(1 + (consumer + 1) % Traits::kConsumers, 256);
  };
  if constexpr (Traits::kPingPong) {
    if (consumer == kLastConsumer) named_barrier_arrive(1, 256);  // consumer 0 takes the first turn
  }

  const bool negate = p.scale_log2 < 0.f;
  const float scale_log2 = fabsf(p.scale_log2);
  const int causal_shift = p.len_k - p.len_q;
  int q_loads = 0, kv_loads = 0;
  [[maybe_unused]] int o_stores = 0;  // tiles whose O this consumer has staged in its buffer
  // Its staging buffer: its own (kOBuffers); with kLastOInV the last consumer's is the V stage of its tile's last key
  // block, and the first consumer's the one buffer, the K stage of that block (kFirstOInK) or its Q rows (kOInQ).
  [[maybe_unused]] const bool my_o_in_v = Traits::kLastOInV && consumer == kLastConsumer;
  [[maybe_unused]] const bool my_o_in_k = Traits::kFirstOInK && consumer == 0;
  [[maybe_unused]] const int o_buffer = Traits::kOBuffers == 1 ? 0 : consumer;
  // The barrier that frees the warp's staged rows, o_free[o_release] (o_in_v_free[s] is o_free[4 * kOBuffers + s], and
  // o_in_k_free[s] follows them).
  [[maybe_unused]] int o_release = 0;

  // A warp's staged O rows are released (o_free, o_in_v_free or o_in_k_free) once the TMA stores have read them. That
  // read is waited for after the next tile's first S GEMM is issued (or after the last tile), not before the next tile
  // starts (the first consumer's Q rows with kOInQ and its K stage with kOInKLeavesAtStore: at once, since the next Q
  // or the next tile's second K loads into them). Measured at locked clocks (NOTES.md, v18): +3.1% / +1.3% at D128
  // causal L 1k / 2k, +1.3% / +0.5% at D64 causal; within +-0.6% where the two consumers then shared one buffer (the
  // other consumer waited longer for it).
  bool o_staged = false;
  const auto release_staged_o = [&] {
    if constexpr (Traits::kOBuffers > 0 || Traits::kLastOInV) {
      if (o_staged && lane == 0) {
        bulk_wait_group_read<0>();
        // (The kernels with a buffer per consumer keep the index they had before kLastOInV: the same SASS.)
        mbarrier_arrive(&smem.o_free[Traits::kLastOInV ? o_release : 4 * o_buffer + warp]);
      }
      o_staged = false;
    }
  };
  int index = blockIdx.x;
  StaticSchedule schedule(p, num_tiles, (p.len_k + kBlockN - 1) / kBlockN);  // with kStreamKTail
  for (int j = 0;; ++j) {
    int n_begin = 0, n_end = 0;  // the key blocks of the tile this CTA computes (all but with stream-K)
    if constexpr (Traits::kDynamicTiles) {
      const int slot = j % 2;
      mbarrier_wait(&smem.tile_full[slot], (j / 2) & 1);
      index = __shfl_sync(0xffffffff, smem.tile_index[slot], 0);
      mbarrier_arrive(&smem.tile_empty[slot]);
      if (index < 0) break;
    } else if constexpr (Traits::kStreamKTail) {
      if (!schedule.next(index, n_begin, n_end)) break;
      // Broadcast, so ptxas keeps them in uniform registers (the division in next() leaves the uniform datapath).
      index = __shfl_sync(0xffffffff, index, 0);
      n_begin = __shfl_sync(0xffffffff, n_begin, 0);
      n_end = __shfl_sync(0xffffffff, n_end, 0);
    } else {
      if (j > 0) index += gridDim.x;
      if (index >= num_tiles) break;
    }
    const TileT tile(index, num_m_blocks, p);
    if constexpr (!Traits::kStreamKTail) n_end = tile.num_n_blocks;
    if (tile.num_n_blocks == 0) {  // no row of this tile sees a key: out = 0, lse = -inf
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
      for (int row = m_first + thread; row < m_end; row += kConsumerThreads) lse_base[row] = -INFINITY;
      release_staged_o();
      continue;
    }
    const int num_n_blocks = tile.num_n_blocks;
    // A block's V stage and the parity of its barriers, and its K stage (kKStages; the same where K has no more).
    const auto stage_of = [&](int n_block) { return (kv_loads + n_block - n_begin) % kStages; };
    const auto parity_of = [&](int n_block) {
      return static_cast<uint32_t>(((kv_loads + n_block - n_begin) / kStages) & 1);
    };
    const auto k_stage_of = [&](int n_block) { return (kv_loads + n_block - n_begin) % Traits::kKStages; };
    const auto k_parity_of = [&](int n_block) {
      return static_cast<uint32_t>(((kv_loads + n_block - n_begin) / Traits::kKStages) & 1);
    };
    // The blocks n_first .. n_end - 1 without computing them: their turns, and their stages released once loaded (an
    // arrival before the load could count towards the stage's previous use, which another consumer may still be
    // reading).
    const auto pass_blocks = [&](int n_first) {
      for (int n_block = n_first; n_block < n_end; ++n_block) {
        const int stage = stage_of(n_block);
        wait_turn();
        pass_turn();
        mbarrier_wait(&smem.k_full[k_stage_of(n_block)], k_parity_of(n_block));
        mbarrier_arrive(&smem.k_empty[k_stage_of(n_block)]);
        mbarrier_wait(&smem.v_full[stage], parity_of(n_block));
        mbarrier_arrive(&smem.v_empty[stage]);
      }
    };
    // This tile's Q buffer, and this consumer's barrier pair for it (its own part's with kQParts).
    const int q_stage = q_loads % Traits::kQStages;
    const int q_barrier = q_stage * Traits::kQParts + (Traits::kQParts > 1 ? consumer : 0);
    if constexpr (Traits::kSkipRowlessConsumers) {
      const int first_row = tile.m_start + 64 * consumer;
      // No rows: Q released once loaded, no O.
      if (first_row >= p.len_q || (Traits::kTilesEndAtLq && first_row + 64 <= 0)) {
        mbarrier_wait(&smem.q_full[q_barrier], (q_loads / Traits::kQStages) & 1);
        ++q_loads;
        if (!Traits::kOInQ || lane == 0) mbarrier_arrive(&smem.q_empty[q_barrier]);
        pass_blocks(n_begin);
        kv_loads += n_end - n_begin;
        release_staged_o();
        continue;
      }
    }

    // Mask needed: the block reaches past L_k, or (causal) past the diagonal of the tile's first row (with
    // kTilesEndAtLq maybe a row before 0: more blocks masked than needed in that tile, never fewer).
    const auto needs_mask = [&](int n_start) {
      return n_start + kBlockN > p.len_k || (kCausal && n_start + kBlockN - 1 > tile.m_start + causal_shift);
    };
    const auto last_cols = [&](int n_start, int (&last_col)[2]) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int last = p.len_k - 1;
        if (kCausal) last = min(last, tile.m_start + row_in_block0 + 8 * h + causal_shift);
        last_col[h] = last - n_start - 2 * (lane % 4);
      }
    };
    // Blocks n_begin .. my_n_end - 1 are those this consumer computes: with kSkipUnseenBlocks (causal, n_begin = 0)
    // those its rows see (at least block 0, which masks rows that see no key).
    const int last_key_seen = tile.m_start + 64 * consumer + 63 + causal_shift;
    const int my_n_end = Traits::kSkipUnseenBlocks ? max(1, min(num_n_blocks, last_key_seen / kBlockN + 1)) : n_end;

    float o[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
    float s[kBlockN / 2];
    uint32_t p_frag[kBlockN / 16][4];
    RowSoftmax<kBlockN> softmax;
    float rescale[2];
    int last_col[2];

    // The first block: S only (there is no P yet).
    mbarrier_wait(&smem.q_full[q_barrier], (q_loads / Traits::kQStages) & 1);
    ++q_loads;
    const T* const q_rows = smem.q_stage(q_stage) + consumer * 64 * 64;  // this warpgroup's rows in each sub-tile
    [[maybe_unused]] uint32_t q_frag[Traits::kQInRegisters ? kHeadDim / 16 : 1][4];
    if constexpr (Traits::kQInRegisters) {
      load_q_fragments<T, Traits>(q_frag, q_rows, warp, lane);
      mbarrier_arrive(&smem.q_empty[q_barrier]);  // Q stays in registers for the tile
    }
    // S = Q K^T into s, Q from shared memory or (kQInRegisters) from registers.
    const auto issue_s = [&](const T* k_tile) {
      if constexpr (Traits::kQInRegisters) {
        issue_qk<T, Traits>(s, q_frag, k_tile);
      } else {
        issue_qk<T, Traits>(s, q_rows, k_tile);
      }
    };
    mbarrier_wait(&smem.k_full[k_stage_of(n_begin)], k_parity_of(n_begin));
    wait_turn();
    issue_s(smem.k_stage(k_stage_of(n_begin)));
    pass_turn();
    release_staged_o();
    wgmma_wait<0>();
    wgmma_fence_registers(s);
    mbarrier_arrive(&smem.k_empty[k_stage_of(n_begin)]);
    // Q free for reuse after the last S GEMM (with kOInQ the last consumer's part: the lane 0s of its warps), unless
    // it was at once (kQInRegisters).
    const bool q_free_after_s = !Traits::kQInRegisters && (!Traits::kOInQ || (my_o_in_v && lane == 0));
    if (q_free_after_s && my_n_end - n_begin == 1) mbarrier_arrive(&smem.q_empty[q_barrier]);
    const int first_start = tile.key_start(n_begin);
    // Masks the columns past the block's keys.
    last_cols(first_start, last_col);
    // The first block moves the reference of every row that sees a key off -inf (rows that see none stay at -inf
    // under either rule): no lazy test, which here only costs registers.
    softmax.template update<false>(s, scale_log2, negate, needs_mask(first_start), last_col, rescale);
    pack_a<T, kBlockN>(p_frag, s);  // P as the A operand of P V

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
      // With kOptimisticExp K[n] stays until the softmax is done, and Q (unless in registers) until the loop ends: a
      // turned-back block recomputes S from them.
      if constexpr (!Traits::kOptimisticExp) {
        mbarrier_arrive(&smem.k_empty[stage]);
        if (q_free_after_s && n_block == my_n_end - 1) mbarrier_arrive(&smem.q_empty[q_barrier]);
      }
      last_cols(n_start, last_col);
      // Then wait for P[n-1] V[n-1]: O and the P registers are free again.
      const auto wait_pv = [&] {
        wgmma_wait<0>();
        wgmma_fence_registers(o);
        wgmma_fence_registers(p_frag);
      };
      bool moved;
      if constexpr (Traits::kOptimisticExp) {
        float block_sum[2];
        const bool fits = softmax.exp_against_reference(s, scale_log2, negate, needs_mask(n_start),
                                                        last_col, block_sum);
        moved = !warpgroup_all(fits, kVoteBarrier + consumer);
        if (!moved) {
          softmax.row_sum[0] += block_sum[0];
          softmax.row_sum[1] += block_sum[1];
        } else {  // warpgroup-uniform, rare: S again, from the Q and K still at hand
          wait_pv();
          issue_s(smem.k_stage(stage));
          wgmma_wait<0>();
          wgmma_fence_registers(s);
          softmax.template update<false>(s, scale_log2, negate, needs_mask(n_start), last_col, rescale);
        }
        mbarrier_arrive(&smem.k_empty[stage]);
      } else {
        moved = softmax.template update<Traits::kLazyRescale>(s, scale_log2, negate, needs_mask(n_start),
                                                              last_col, rescale);
      }
      if constexpr (Traits::kSoftmaxUnderPV) {
        keep_before_wgmma_wait(softmax.row_sum[0] + softmax.row_sum[1], smem.scratch);
      }
      wait_pv();
      mbarrier_arrive(&smem.v_empty[prev]);
      if constexpr (Traits::kOptimisticExp) {
        if (moved) rescale_o<kHeadDim>(o, rescale);  // warp-uniform
      } else if (!Traits::kLazyRescale || __any_sync(0xffffffff, moved)) {
        rescale_o<kHeadDim>(o, rescale);  // warp-uniform
      }
      pack_a<T, kBlockN>(p_frag, s);  // P as the A operand of P V
    }

    // Q free after the loop with kOptimisticExp (its last block may compute S again): here, before the last P V, rather
    // than inside the loop, where ptxas serialised the wgmmas (C7511).
    if (Traits::kOptimisticExp && q_free_after_s && my_n_end - n_begin > 1) mbarrier_arrive(&smem.q_empty[q_barrier]);
    // The last P V.
    const int last = stage_of(my_n_end - 1);
    mbarrier_wait(&smem.v_full[last], parity_of(my_n_end - 1));
    issue_pv<T, Traits>(o, p_frag, smem.v_stage(last));
    if constexpr (Traits::kSkipUnseenBlocks) pass_blocks(my_n_end);  // the blocks past this consumer's rows

    // The rows' sums and lse while the last P V runs (it changes only O). A tile split between two CTAs (stream-K)
    // has them again after the merge, which only then knows the rows' totals and which CTA stores them.
    float* const lse_base = tile.lse(p);
    float inv[2];
    const auto row_totals = [&](bool store_lse) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = softmax.row_sum[h];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        const int row = tile.m_start + row_in_block0 + 8 * h;
        const bool sees_keys = row_sees_keys<kCausal>(row, causal_shift);
        inv[h] = sees_keys ? 1.f / sum : 0.f;  // a row without keys: out = 0
        if (store_lse && (!Traits::kTilesEndAtLq || row >= 0) && row < p.len_q && lane % 4 == 0) {
          lse_base[row] = row_lse(sees_keys, softmax.row_max[h] * scale_log2, sum);
        }
      }
    };
    const bool split_tile = Traits::kStreamKTail && (n_begin > 0 || n_end < num_n_blocks);
    row_totals(!split_tile);
    keep_before_wgmma_wait(inv[0] + inv[1], smem.scratch);
    wgmma_wait<0>();
    wgmma_fence_registers(o);
    mbarrier_arrive(&smem.v_empty[last]);
    kv_loads += n_end - n_begin;

    // A tile split between two CTAs (stream-K): one warp of the two holding these rows hands its part to the other.
    bool store_o = true;
    if constexpr (Traits::kStreamKTail) {
      if (split_tile) {
        const int boundary = static_cast<int>(blockIdx.x) - (n_begin > 0 ? 1 : 0);  // the CTA with blocks 0 ..
        const int slot = sm90_stream_k_slot(boundary, consumer, warp);
        const int slots = static_cast<int>(gridDim.x) * kSm90StreamKSlotsPerCta;
        float* const partial = p.sk_partial + slot * sm90_stream_k_partial_floats(kHeadDim);
        store_o = merge_split_tile<kHeadDim>(o, softmax.row_max, softmax.row_sum, scale_log2, n_begin == 0,
                                             p.sk_flags + slot, p.sk_flags + slots + slot, partial, lane);
        row_totals(store_o);
      }
    }

    // Epilogue: each warp writes its 16 rows of O, normalised, into the staging buffer with stmatrix, in the 128-byte
    // swizzle the tensor map reads, and its lane 0 stores them with TMA. With kOInQ the first consumer's buffer is its
    // rows of Q, handed back to the producer once stored.
    const int sub_tile = Traits::kOInQ && !my_o_in_v ? Traits::kSubTileQ : Traits::kSubTileO;  // 64 columns apart
    T* staging = smem.q_stage(q_stage) + consumer * 64 * 64;
    if (my_o_in_k) {
      // The K stage of the tile's last block (kv_loads counts it last), once every consumer's S GEMM has read it.
      const int tile_last = (kv_loads - 1) % kStages;
      mbarrier_wait(&smem.k_empty[tile_last], parity_of(n_begin - 1));
      staging = smem.k_stage(tile_last);
      o_release = 4 * Traits::kOBuffers + (Traits::kLastOInV ? kStages : 0) + tile_last;
    } else if (my_o_in_v) {
      // Every consumer's last P V has read this V stage (the producer reloads it only after o_in_v_free). kv_loads
      // already counts the tile's blocks, hence the shift by n_end - n_begin; spelt this way because other
      // spellings of the same parity made ptxas serialise the wgmmas at D128 (C7511).
      mbarrier_wait(&smem.v_empty[last], parity_of(my_n_end - 1 + n_begin - n_end));
      staging = smem.v_stage(last);
      o_release = 4 * Traits::kOBuffers + last;
    } else if (!Traits::kOInQ) {
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
    const int matrix = lane / 8;                                   // lanes 8m .. 8m + 7 address matrix m's rows
    const int row = lane % 8 + 8 * (matrix % 2);                   // matrices: rows 0-7, 8-15 of chunk j, then j + 1
    if (store_o) {  // else the rows are only released (the other CTA stores this stream-K tile)
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; j += 2) {  // 8-column chunks j and j + 1
        const int chunk = j + matrix / 2;
        T* const dst = warp_rows + (chunk / 8) * block_stride + sw128_offset(row, chunk % 8);
        stmatrix_x4(dst, sm80::pack2<T>(o[4 * j] * inv[0], o[4 * j + 1] * inv[0]),
                    sm80::pack2<T>(o[4 * j + 2] * inv[1], o[4 * j + 3] * inv[1]),
                    sm80::pack2<T>(o[4 * j + 4] * inv[0], o[4 * j + 5] * inv[0]),
                    sm80::pack2<T>(o[4 * j + 6] * inv[1], o[4 * j + 7] * inv[1]));
      }
      fence_proxy_async_smem();  // the TMA (async proxy) reads what the threads wrote
    }
    __syncwarp();
    if (lane == 0) {
      const int first_row = tile.m_start + 64 * consumer + 16 * warp;
      // No TMA store before row 0 (kTilesEndAtLq).
      if (store_o && first_row < p.len_q && (!Traits::kTilesEndAtLq || first_row >= 0)) {
        if (one_store) {
          tma_store_5d(&o_map, warp_rows, 0, first_row, 0, tile.head, tile.batch);
        } else {
#pragma unroll
          for (int c = 0; c < kColumnBlocks; ++c) {
            if (64 * c < p.head_dim) {
              tma_store_4d(&o_map, warp_rows + c * sub_tile, 64 * c, first_row, tile.head, tile.batch);
            }
          }
        }
      }
      bulk_commit_group();
      if (Traits::kOInQ && !my_o_in_v) {
        bulk_wait_group_read<0>();  // Q's rows may be loaded again
        mbarrier_arrive(&smem.q_empty[q_barrier]);
      }
      if (Traits::kOInKLeavesAtStore && my_o_in_k) {
        bulk_wait_group_read<0>();  // the K stage may be loaded again
        mbarrier_arrive(&smem.o_free[o_release]);
      }
    }
    // Released by release_staged_o.
    o_staged = (!Traits::kOInQ || my_o_in_v) && !(Traits::kOInKLeavesAtStore && my_o_in_k);
  }
  release_staged_o();
  if constexpr (Traits::kPingPong) {
    if (consumer == 0) named_barrier_sync(1, 256);  // the last consumer's final hand-over
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  CUtensorMap q_map, k_map, v_map, o_map{};
  if (!make_qkv_maps(params, kBf16, Traits::kBlockM / Traits::kQParts, Traits::kBlockN, &q_map, &k_map, &v_map)) {
    return cudaErrorNotSupported;
  }
  // O in boxes of one warp's 16 rows, all its columns in one where the kernel stores them so (the output is ours,
  // contiguous: the driver takes it).
  const bool o_mapped = Traits::o_one_store(params.head_dim)
                            ? make_bhld_column_block_map(&o_map, params.out, kBf16, params.batch, params.heads,
                                                         params.len_q, params.head_dim, params.o_batch_stride,
                                                         params.o_head_stride, params.o_row_stride, 16,
                                                         Traits::kColumnBlocks)
                            : make_bhld_map(&o_map, params.out, kBf16, params.batch, params.heads, params.len_q,
                                            params.head_dim, params.o_batch_stride, params.o_head_stride,
                                            params.o_row_stride, 16);
  if (!o_mapped) return cudaErrorNotSupported;
  auto kernel = flash_fwd_sm90_kernel<T, Traits, kCausal>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  static_assert(sizeof(T) == 2, "16-bit elements");
  static_assert(kSmemBytes <= Traits::kMaxSmemBytes,
                "Q, the K/V stages and O exceed the 227 KB of shared memory per block");
  if (!allow_dynamic_smem(kernel, kSmemBytes)) return cudaErrorNotSupported;
  int device = 0, num_sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return cudaGetLastError();
  }
  // The host sized the causal schedule (zigzag grid) for the tile height sm90_causal_block_m gives.
  if (kCausal && Traits::kBlockM != sm90_causal_block_m(Traits::kHeadDim, params.len_q, params.len_k)) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_m_blocks = (params.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t num_tiles = num_m_blocks * params.heads * params.batch;
  // Persistent: one CTA per SM, or under a causal mask without a counter the zigzag's grid (chosen by flash_api), or
  // without a mask the fixed stride's grid that spreads the heads' short last tiles over the CTAs (launch.h).
  const bool zigzag = kCausal && params.tile_counter == nullptr && params.zigzag_grid > 0;
  int grid_size = zigzag ? params.zigzag_grid : num_sms;
  if (Traits::kStreamKTail && params.sk_tiles > 0) {
    // The host sized the split for one CTA per SM (sm90_stream_k_tiles), each share at least one tile long.
    if (params.sk_tiles < num_sms || params.sk_tiles > num_tiles) return cudaErrorInvalidValue;
  } else if (!kCausal) {
    // The consumers that compute in a head's last tile (all of them where none skips for want of rows).
    const int64_t last_tile_rows = params.len_q - (num_m_blocks - 1) * Traits::kBlockM;
    const int short_tile_consumers =
        Traits::kSkipRowlessConsumers ? static_cast<int>((last_tile_rows + 63) / 64) : Traits::kConsumers;
    grid_size = sm90_static_grid(num_m_blocks, num_tiles, num_sms, Traits::kConsumers, short_tile_consumers);
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(num_tiles, grid_size)));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(q_map, k_map, v_map, o_map, params);
  return cudaGetLastError();
}

// Launches the Hopper forward on `stream`. Returns cudaErrorNotSupported, having launched nothing, when the
// driver cannot encode the tensor maps for these strides or grant the shared memory (the caller may then use the
// sm80 kernel).
template <typename T, int HeadDim, bool kCausal>
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  if constexpr (HeadDim == 64) {
    if (kCausal && sm90_causal_block_m(64, params.len_q, params.len_k) == 192) {
      return launch_fwd_sm90<T, FwdTraits<64, kCausal, 128, 3>, kCausal>(params, stream);
    }
    return launch_fwd_sm90<T, FwdTraits<64, kCausal, 128>, kCausal>(params, stream);
  } else if constexpr (HeadDim == 128) {
    return launch_fwd_sm90<T, FwdTraits<128, kCausal, 128>, kCausal>(params, stream);
  } else {
    if (sm90_fwd_block_n(256, kCausal, params.len_k) == 64) {
      return launch_fwd_sm90<T, FwdTraits<256, kCausal, 64>, kCausal>(params, stream);
    }
    return launch_fwd_sm90<T, FwdTraits<256, kCausal, 80>, kCausal>(params, stream);
  }
}

}  // namespace flashattn::sm90
