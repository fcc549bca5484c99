// The Hopper forward's compile-time shape and policies (FwdTraits) and its shared-memory layout (SharedStorage).
// A kernel variant is FwdTraits<head dim, causal, keys per block, consumers, options, sequences, cap> (tile_size.h
// picks them per call); every other choice below follows from those and from the 227 KB of shared memory. The options
// variants take a sliding window and sinks (FwdParams' score modifications) and softcap as Cap says; their Causal means
// a band with a right edge. The sequences variants (options too) take packed sequences, each tile's lengths and tensor
// maps its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sm90/ptx.h"
#include "cuda/sm90/sequences.h"
#include "cuda/sm90/tile_size.h"

namespace flashattn::sm90 {

// The order in which the producer requests K and V blocks.
enum class KvLoadOrder {
  kKThenV,             // K[n], V[n], K[n + 1], ...
  kKAheadInTile,       // within a tile K[n + 1] before V[n] (the tile's last V after its last K), same-length rings
  kKAheadAcrossTiles,  // K[n + 1] before V[n] across tiles too, K's ring a stage longer than V's
};

// Where each consumer stages its O rows for the TMA store (the stores read 128-byte lines from shared memory).
enum class OStaging {
  kBufferPerConsumer,  // a buffer of its own beside Q and the K/V rings
  kBufferThenLastV,    // the first consumer in the one buffer that fits, the last in its tile's last V stage
  kKThenLastV,         // the first in the K stage of its tile's last block, the last in that block's V stage
  kQThenLastV,         // the first in its own rows of Q, the last in that block's V stage
};

// How the key loop takes its exponentials (softmax.h).
enum class ExpPolicy {
  kOptimistic,   // after the first block, against each row's unmoved reference, S again where a sum grows too large
  kLazyRescale,  // against the block's max, the reference (and O's rescale) moved only past kLazyRescaleLog2
};

// Where S = Q K^T reads Q from.
enum class QOperand { kSharedMemory, kRegisters };

// Whether a kernel caps its scores (softcap's tanh): in no call, in every call (a softcap kernel), or as the call says.
enum class CapMode { kNever, kAlways, kPerCall };

template <int HeadDim, bool Causal, int BlockN, int Consumers, bool Options = false, bool Sequences = false,
          CapMode Cap = CapMode::kNever>
struct FwdTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kConsumers = Consumers;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = BlockN;
  static constexpr bool kOptions = Options;
  static constexpr bool kSequences = Sequences;

  static constexpr TileOrder kOrder = fwd_tile_order(HeadDim, Causal, Options, Sequences);
  // The producer's mailbox slot: a tile index, or (packed sequences) the decoded tile (tile_scheduler.h: SeqTile).
  static constexpr int kMailboxInts = Sequences ? static_cast<int>(sizeof(SeqTile) / sizeof(int)) : 1;
  // K/V stages: three at D64, where a tile's key blocks are shortest, and beside D128's 64-key blocks (whose consumers
  // skip up to two blocks past their rows); two at D128's 128-key blocks and at D256, which fill shared memory.
  static constexpr int kStages = HeadDim == 64 || (HeadDim == 128 && BlockN == 64) ? 3 : 2;
  // D128's 128-key blocks leave room for one more K stage (not a K/V pair) beside their O buffers: K runs a block
  // ahead of V across tiles, so the next tile's first K and Q wait less at a tile's start. Not under a causal mask with
  // options, where a window 1024 ran 1.3% slower, but with packed sequences (KV-cache chunks: paged B1 8k Lq128 -12%,
  // one tile a CTA). The 80-key D256 kernel without a mask does the same within a tile in equal rings (K[n + 2] then
  // waits for S[n] only, not behind V[n + 1]).
  static constexpr KvLoadOrder kLoadOrder =
      HeadDim == 128 && BlockN == 128 && (!Causal || !Options || Sequences) ? KvLoadOrder::kKAheadAcrossTiles
      : HeadDim == 256 && !Causal && BlockN == 80                           ? KvLoadOrder::kKAheadInTile
                                                                            : KvLoadOrder::kKThenV;
  static constexpr int kKStages = kStages + (kLoadOrder == KvLoadOrder::kKAheadAcrossTiles ? 1 : 0);  // V: kStages
  // Q buffers: two at D64 (the next tile's Q loads while this one runs); one elsewhere (no room at D256, no gain at
  // D128, whose Q comes from registers).
  static constexpr int kQStages = HeadDim == 64 ? 2 : 1;
  // Q from registers for S (RS wgmma), its shared memory released at once: a fifth less shared memory read per
  // 128-key block at D128. 32 registers a thread: room only beside 128-key blocks.
  static constexpr QOperand kQOperand =
      HeadDim == 128 && BlockN == 128 ? QOperand::kRegisters : QOperand::kSharedMemory;
  // The lazy rescale where the optimistic exponentials' recompute would spill (D256).
  static constexpr ExpPolicy kExp = HeadDim != 256 ? ExpPolicy::kOptimistic : ExpPolicy::kLazyRescale;
  static constexpr CapMode kCap = Cap;
  // Softcap's tanh inside the exponentials' pass where a block has no mask (fwd_mainloop.h), in the softcap kernels.
  static constexpr bool kCappedPass = kCap == CapMode::kAlways;

  // Under a causal mask a consumer stops after the last key block its 64 rows see (and only takes its turns and
  // releases the stages of the tile's later blocks). Where blocks are as tall as the tile every consumer sees part of
  // every block, and the code alone costs.
  static constexpr bool kSkipBlocksPastRows = Causal && kBlockN != kBlockM;
  // A consumer without rows in a head's part-empty tile computes nothing (three consumers: L_q mod 192 in 1..128).
  static constexpr bool kSkipRowlessConsumers = Consumers == 3;
  // Causal three-consumer tiles end at L_q, so a head's part-empty tile is its first (whose rows see the fewest keys),
  // starting at a negative row; TMA zero-fills those rows of Q and no O or lse is stored for them.
  static constexpr bool kTilesEndAtLq = Causal && Consumers == 3;
  // Pin the softmax of S[n] before the wait for P[n-1] V[n-1], which ptxas otherwise hoists above it (the softmax then
  // never overlaps the warpgroup's own P V). Not under a causal mask at D128 and D256, where it measured slower.
  static constexpr bool kSoftmaxUnderPV = !Causal || HeadDim == 64;

  static constexpr int kNThreads = (1 + kConsumers) * 128;
  static constexpr int kColumnBlocks = HeadDim / 64;  // 64-column sub-tiles (one TMA box / swizzle atom wide)
  static constexpr int kTileQ = kBlockM * HeadDim;    // elements
  static constexpr int kTileKV = kBlockN * HeadDim;
  static constexpr int kSubTileQ = kBlockM * 64;
  static constexpr int kSubTileKV = kBlockN * 64;
  static constexpr int kTileO = 64 * HeadDim;  // one consumer's rows of O
  static constexpr int kSubTileO = 64 * 64;

  static constexpr int kMaxSmemBytes = 227 * 1024;
  // Room for the mbarriers, the tile mailbox and the scratch word (checked below): three consumers with three K/V
  // stages need 268 bytes.
  static constexpr int kBarrierBytes = (kConsumers == 3 && kStages == 3) || Sequences ? 512 : 256;
  static constexpr int kPipelineBytes =
      (kQStages * kTileQ + (kKStages + kStages) * kTileKV) * 2 + 1024 /* alignment */ + kBarrierBytes;
  // O staging: a buffer per consumer where shared memory has room for them; else one (the first consumer's) and the
  // last V stage; else, without a mask, the last K stage (the producer reloads it once the O has left), and under a
  // causal mask the first consumer's Q rows (causal tiles are short: the next tile's K, which would wait for the
  // store, is needed sooner).
  static constexpr OStaging kOStaging = kPipelineBytes + kConsumers * kTileO * 2 <= kMaxSmemBytes
                                            ? OStaging::kBufferPerConsumer
                                        : kPipelineBytes + kTileO * 2 <= kMaxSmemBytes ? OStaging::kBufferThenLastV
                                        : Causal                                       ? OStaging::kQThenLastV
                                                                                       : OStaging::kKThenLastV;
  static constexpr int kOBuffers = kOStaging == OStaging::kBufferPerConsumer ? kConsumers
                                   : kOStaging == OStaging::kBufferThenLastV ? 1
                                                                             : 0;
  static constexpr bool kLastOInV = kOStaging != OStaging::kBufferPerConsumer;
  static constexpr bool kFirstOInK = kOStaging == OStaging::kKThenLastV;
  static constexpr bool kFirstOInQ = kOStaging == OStaging::kQThenLastV;
  static constexpr int kSmemBytes = kPipelineBytes + kOBuffers * kTileO * 2;  // 16-bit elements
  // Q in one part per consumer, each released once its consumer's last S GEMM has read it (the first consumer's before
  // the last's), where O is staged in Q or K: Q loads whole otherwise.
  static constexpr int kQParts = kFirstOInQ || kFirstOInK ? kConsumers : 1;
  // Each warp's 16 rows of O leave in one TMA store where D is a multiple of 64 (a 5-D map with the 64-column blocks
  // as a dimension), not one store per 64-column block. Not with O in Q, whose column blocks lie a Q sub-tile apart.
  static constexpr bool kOOneStorePerWarp = kColumnBlocks > 1 && !kFirstOInQ;
  __host__ __device__ static constexpr bool o_one_store(int head_dim) {
    return kOOneStorePerWarp && head_dim % 64 == 0;
  }

  // Producer keeps few registers, consumers get the rest: (24 + 2 * 240) * 128 or (24 + 3 * 160) * 128 <= 64K. The
  // sequences variants' producer (tile decode, a box per page) takes 40 and two consumers 232: at 24 it spilled in its
  // page loop (D128: 182 B of spill stores; 52 at 40, in the tile decode only; the consumers spill nothing at 232).
  static constexpr int kProducerRegs = kSequences && kConsumers == 2 ? 40 : 24;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : kSequences ? 232 : 240;

  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256, "the Hopper forward covers head dims 64, 128, 256");
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static_assert(kQStages == 1 || kQStages == 2, "one or two Q buffers");
  static_assert(!Sequences || (Options && !kTilesEndAtLq), "packed sequences: an options variant, tiles from row 0");
  static_assert(Options || Cap == CapMode::kNever, "softcap is an option");
  static_assert(kSmemBytes <= kMaxSmemBytes, "Q, the K/V stages and O exceed the 227 KB of shared memory per block");
  static_assert(!(kQOperand == QOperand::kRegisters) || !kFirstOInQ,
                "with Q in registers its shared memory is released before the epilogue");
  static_assert(kOStaging == OStaging::kBufferPerConsumer || kOStaging == OStaging::kBufferThenLastV ||
                    kQStages == 1,
                "O staged in Q or K needs a single Q buffer");
  static_assert(!kLastOInV || (kConsumers == 2 && kTileKV >= kTileO),
                "O in the last V stage: two consumers, the second's O within one V stage");
  // The last consumer's rows are the tile's last, so it computes up to the tile's last key block unless it skips the
  // tile for want of rows.
  static_assert(!kLastOInV || !kSkipRowlessConsumers, "O in the last V stage: the last consumer computes every block");
  // A consumer's rows end kBlockM - 64 keys before its tile's, so it skips at most this many blocks, and it passes
  // them before it releases its last V stage: were that many to reach its last stage again, that load would wait.
  static_assert(!kSkipBlocksPastRows || (kBlockM - 64 + kBlockN - 1) / kBlockN < kStages,
                "a consumer would skip as many key blocks as there are stages");
  static_assert((2 * kQStages * kQParts + 2 * kKStages + 2 * kStages + 4 * kOBuffers + (kLastOInV ? kStages : 0) +
                 (kFirstOInK ? kKStages : 0) + 4) * 8 + (2 * kMailboxInts + 1) * 4 <= kBarrierBytes,
                "the mbarriers, the tile mailbox and the scratch word exceed kBarrierBytes");
  // K ahead of V across tiles counts K and V stages apart, which O staged in the rings and skipped blocks do not.
  static_assert(kLoadOrder != KvLoadOrder::kKAheadAcrossTiles ||
                    (!kLastOInV && !kSkipBlocksPastRows && !kSkipRowlessConsumers),
                "K ahead of V across tiles: not with O staged in the rings or with consumers that skip key blocks");
  // K ahead within a tile goes with O staged in K: the tile's last V leaves after its last K, before the stage holding
  // the O is marked.
  static_assert((kLoadOrder == KvLoadOrder::kKAheadInTile) == kFirstOInK &&
                    (!kFirstOInK || kOrder == TileOrder::kStride),
                "K ahead within a tile: exactly where O is staged in the K ring, in the stride order");
  // setmaxnreg.inc blocks until registers are free: the rebalanced total must fit what the launch granted
  // (65536 / kNThreads per thread at entry, rounded down to a multiple of 8).
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
  uint64_t* o_in_v_free;  // [kStages] with O in V: the TMA stores have read the O staged in V stage s
  uint64_t* o_in_k_free;  // [kKStages] with O in K: the same for K stage s
  uint64_t* tile_full;    // [2]: the producer published the next tile index in tile_index[slot]
  uint64_t* tile_empty;   // [2]: every consumer has read it
  int* tile_index;        // [2][kMailboxInts]
  uint32_t* scratch;      // target of keep_before_wgmma_wait's never-taken store

  __device__ explicit SharedStorage(unsigned char* raw) {
    // Swizzled tiles need 1024-byte alignment; dynamic shared memory only promises 16.
    // Kept as measured: of the thread-side accesses only the scheduler's tile index (twice per tile) goes through
    // these pointers in C++ and so is generic after this integer round trip; the rest is PTX on shared addresses.
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
    scratch = reinterpret_cast<uint32_t*>(tile_index + 2 * Traits::kMailboxInts);
  }
  __device__ T* q_stage(int stage) const { return q + stage * Traits::kTileQ; }
  __device__ T* k_stage(int stage) const { return k + stage * Traits::kTileKV; }
  __device__ T* v_stage(int stage) const { return v + stage * Traits::kTileKV; }
  __device__ T* o_buffer(int buffer) const { return o + buffer * Traits::kTileO; }

  // Thread 0: every mbarrier with its arrival count.
  __device__ void init_barriers() const {
    constexpr int kConsumerThreads = Traits::kConsumers * 128;
    for (int s = 0; s < Traits::kQStages * Traits::kQParts; ++s) {
      mbarrier_init(&q_full[s], 1);
      // Every thread of the part's consumers arrives after its last S GEMM (one without rows, once Q has landed); with
      // O in Q lane 0 of each warp of the part's consumer: the first consumer's once its staged O has been stored, the
      // last's after its last S GEMM (its O goes to a V stage).
      mbarrier_init(&q_empty[s], Traits::kFirstOInQ ? 4 : kConsumerThreads / Traits::kQParts);
    }
    for (int s = 0; s < Traits::kStages; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], kConsumerThreads);  // every consumer thread arrives once it has read the stage
      mbarrier_init(&v_empty[s], kConsumerThreads);
    }
    for (int s = Traits::kStages; s < Traits::kKStages; ++s) {  // K's extra stage
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&k_empty[s], kConsumerThreads);
    }
    for (int b = 0; b < 4 * Traits::kOBuffers; ++b) mbarrier_init(&o_free[b], 1);  // the warp's lane 0
    if constexpr (Traits::kLastOInV) {
      for (int s = 0; s < Traits::kStages; ++s) mbarrier_init(&o_in_v_free[s], 4);  // lane 0 of each warp
    }
    if constexpr (Traits::kFirstOInK) {
      for (int s = 0; s < Traits::kKStages; ++s) mbarrier_init(&o_in_k_free[s], 4);
    }
    for (int slot = 0; slot < 2; ++slot) {
      mbarrier_init(&tile_full[slot], 1);
      mbarrier_init(&tile_empty[slot], kConsumerThreads);
    }
    fence_barrier_init();
  }
};

}  // namespace flashattn::sm90
