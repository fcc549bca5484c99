// The plan of a forward call on CUDA, decided once before anything is allocated or launched: the kernel, its tile
// shape, the schedule, the grid and the workspace. FwdParams::plan carries it to the launchers and the kernels, which
// follow it and decide nothing again.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda/decode.h"
#include "cuda/kernel_table.h"
#include "cuda/params.h"
#include "cuda/sm80/tile_size.h"
#include "cuda/sm90/sequences.h"
#include "cuda/sm90/tile_scheduler.h"
#include "cuda/sm90/tile_size.h"
#include "cuda/switches.h"

namespace flashattn {

// What the device and the build offer the call.
struct FwdDevice {
  bool sm90;           // a Hopper GPU, and the Hopper kernels built (sm_90a in FLASHATTN_CUDA_ARCHS)
  bool tma_maps_q_kv;  // TMA can describe q, k and v as they are (sm90/tma.h: tma_can_map)
  int num_sms;
  int smem_per_block;  // the most shared memory a CTA may opt into
};

// Whether the call asks for the Hopper kernel (on a Hopper GPU, the bucket covered, the switch not off), whatever the
// inputs' strides: in strict mode flash_api raises where the plan then could not take it.
inline bool fwd_wants_sm90(int bucket, const FwdDevice& device, const Switches& sw) {
  return device.sm90 && sw.fwd_sm90 != Sm90Use::kOff && sm90_fwd_covers(bucket);
}

// Whether the decode path takes the call: a few query rows (any score modification), kv heads x row groups within
// CUDA's limit of 65535 CTAs along y, on a GPU whose CTAs may have the kernel's shared memory (not above D64 on sm_86
// / sm_89, nor above D128 on sm_80). The forward kernels (a 1-D grid) take the others. Never the batch size: a row's
// bits do not depend on it.
inline bool decode_applies(const FwdParams& p, int bucket, const FwdDevice& device, const Switches& sw) {
  constexpr int64_t kMaxGridY = 65535;
  const int64_t groups = static_cast<int64_t>(p.heads_kv) * decode_row_groups(p.heads_per_kv, p.len_q);
  return sw.decode && p.len_q <= kDecodeMaxLenQ && groups <= kMaxGridY &&
         decode_smem_bytes(decode_head_dim(bucket)) <= device.smem_per_block;
}

// The decode path's plan: its head dim, the key splits (`requested` > 0 overrides them), whether a CTA runs them in
// turn (the switch may force either way) and their workspace.
inline FwdPlan plan_decode(const FwdParams& p, int bucket, int num_sms, int64_t requested, const Switches& sw) {
  FwdPlan plan{};
  plan.kernel = FwdKernel::kDecode;
  plan.head_dim = decode_head_dim(bucket);
  plan.splits = decode_splits(p.heads_kv, p.heads_per_kv, p.len_q, p.len_k, num_sms, requested);
  plan.splits_in_turn = sw.decode_splits == DecodeSplits::kAuto
                            ? decode_splits_in_turn(p.batch, p.heads_kv, p.heads_per_kv, p.len_q, p.len_k, num_sms,
                                                    plan.splits)
                            : sw.decode_splits == DecodeSplits::kInTurn && plan.splits > 1;
  if (!plan.splits_in_turn) {
    plan.workspace_bytes = decode_workspace_floats(p, plan.splits, plan.head_dim) * static_cast<int64_t>(sizeof(float));
  }
  return plan;
}

// Where a KV cache's key splits put their parts in the Hopper sequences kernel's workspace (decode.h's layout).
inline int64_t sequences_split_offset(int64_t batch) {
  return sm90::round_up_128(sm90::sequences_workspace(batch).bytes);
}

// A KV cache's query chunks on Hopper split over the cache's keys where an entry's tiles leave SMs idle (batch 1: H32
// Lq128 is 32 tiles on 132 SMs, each walking every key block): as many splits as give one entry's tiles the SMs, each
// at least kMinSplitKeys of the capacity long; `requested` > 0 sets the count. From the shape and the SM count only,
// as the decode path's splits: a row's bits do not depend on the batch. Every split's part is a float32 copy of its
// rows, written and read again by the combine: against a split's keys, 8 bytes a row and column per 4 * keys FLOPs.
inline constexpr int64_t kMinSplitKeys = 4096;
inline int sequences_key_splits(const FwdParams& p, int block_m, int block_n, int num_sms, int64_t requested) {
  if (p.cu_seqlens_q != nullptr) return 1;  // packed sequences
  const int64_t blocks = (static_cast<int64_t>(p.len_k) + block_n - 1) / block_n;
  const int64_t entry_tiles = static_cast<int64_t>(sm90::sequence_m_blocks(p.len_q, block_m)) * p.heads;
  const int64_t want = requested > 0 ? requested
                                     : std::min<int64_t>(num_sms / entry_tiles, p.len_k / kMinSplitKeys);
  const int splits = static_cast<int>(std::clamp<int64_t>(want, 1, std::min<int64_t>(kDecodeMaxSplits, blocks)));
  // Without a split past the last key block.
  const int64_t per_split = sm90::split_key_blocks(p.len_k, block_n, splits);
  return static_cast<int>((blocks + per_split - 1) / per_split);
}

// Whether a CTA runs each tile's key splits in turn (folding the parts as the combine does: the same bits) rather than
// a CTA per split: unless CTAs of their own take at least a quarter fewer rounds of the SMs (tiles of equal length).
// Elsewhere their fp32 parts, the combine pass and CTA starts cost more than the rounds they save (B8 H32 Lq128 8k,
// 256 tiles in the same 4 rounds either way: 227 -> 364 us as CTAs of their own), and the parts grow with the batch.
constexpr bool sequences_splits_in_turn(int64_t tiles, int splits, int num_sms) {
  const int64_t in_turn_rounds = (tiles + num_sms - 1) / num_sms * splits;
  const int64_t split_rounds = (tiles * splits + num_sms - 1) / num_sms;
  return splits > 1 && 4 * split_rounds > 3 * in_turn_rounds;
}
static_assert(!sequences_splits_in_turn(32, 4, 132) && !sequences_splits_in_turn(160, 4, 132),
              "H32 Lq128 B1: 1 round instead of 4; B5: 5 instead of 8");
static_assert(sequences_splits_in_turn(128, 4, 132) && sequences_splits_in_turn(4096, 2, 132),
              "B4: 4 rounds either way; B128 over an 8k cache: 63 instead of 64");
// The state a consumer thread keeps between splits run in turn: its accumulator's head_dim / 2 values and each of its
// two rows' running maximum and sum (sm90/fwd_epilogue.h: fold_state).
inline int64_t sequences_fold_floats(int grid, int consumers, int head_dim) {
  return static_cast<int64_t>(grid) * consumers * 128 * (head_dim / 2 + 4);
}

// Packed sequences on Hopper (`p` a packed call's params, or a KV cache call's: its entries as the sequences): one
// tile shape per head dim, every SM, tiles from a counter in the order the preparation builds on the device; a KV
// cache's key splits (`requested`: the caller's count, 0 automatic) with their parts, or where a CTA runs them in
// turn its consumers' fold states, after the preparation's data.
inline FwdPlan plan_fwd_sequences(const FwdParams& p, int bucket, const FwdDevice& device, int64_t requested = 0,
                                  DecodeSplits mode = DecodeSplits::kAuto) {
  FwdPlan plan{};
  plan.kernel = FwdKernel::kSm90;
  plan.head_dim = sm90_kernel_head_dim(bucket);
  const sm90::FwdTileShape shape = sm90::fwd_sequences_tile_shape(plan.head_dim, p.causal);
  plan.consumers = shape.consumers;
  plan.block_m = shape.block_m;
  plan.block_n = shape.block_n;
  plan.schedule = FwdSchedule::kSequences;
  // At most one CTA per tile there can be (each sequence's rows in whole tiles: packed.h's slot count).
  const int64_t entry_m_blocks = sm90::sequence_m_blocks(p.len_q, plan.block_m);  // a KV cache's entries
  plan.splits = sequences_key_splits(p, plan.block_m, plan.block_n, device.num_sms, requested);
  const int64_t tiles = entry_m_blocks * p.heads * p.batch;  // a KV cache's, before the splits
  plan.splits_in_turn = mode == DecodeSplits::kAuto ? sequences_splits_in_turn(tiles, plan.splits, device.num_sms)
                                                    : mode == DecodeSplits::kInTurn && plan.splits > 1;
  const int64_t most_tiles = p.cu_seqlens_q != nullptr
                                 ? (static_cast<int64_t>(p.len_q) / plan.block_m + p.batch) * p.heads
                                 : tiles * decode_split_ctas(plan);
  plan.grid = static_cast<int>(std::min<int64_t>(device.num_sms, most_tiles));
  const int64_t split_floats = plan.splits_in_turn
                                   ? sequences_fold_floats(plan.grid, plan.consumers, plan.head_dim)
                                   : decode_workspace_floats(p, plan.splits, plan.head_dim);
  plan.workspace_bytes = sequences_split_offset(p.batch) + split_floats * static_cast<int64_t>(sizeof(float));
  plan.zeroed_bytes = sizeof(int);
  return plan;
}

// The portable forward: as many K/V tiles as the device's CTAs may have (fewer where FLASHATTN_SM80_KV_TILES asks, from
// D128), 0 where not even one fits (the caller raises).
inline FwdPlan plan_fwd_sm80(int bucket, const FwdDevice& device, const Switches& sw) {
  FwdPlan plan{};
  plan.kernel = FwdKernel::kSm80;
  plan.head_dim = bucket;
  plan.kv_tiles = sm80::fwd_kv_tiles(bucket, device.smem_per_block, sw.sm80_kv_tiles > 0 ? sw.sm80_kv_tiles : 4);
  return plan;
}

// `p` holds the call's shapes (its plan is ignored); `deterministic`: torch.use_deterministic_algorithms is on.
inline FwdPlan plan_fwd(const FwdParams& p, int bucket, const FwdDevice& device, const Switches& sw,
                        bool deterministic) {
  if (decode_applies(p, bucket, device, sw)) return plan_decode(p, bucket, device.num_sms, 0, sw);
  if (!fwd_wants_sm90(bucket, device, sw) || !device.tma_maps_q_kv) return plan_fwd_sm80(bucket, device, sw);

  FwdPlan plan{};
  plan.kernel = FwdKernel::kSm90;
  plan.head_dim = sm90_kernel_head_dim(bucket);
  const bool softcap = p.options && p.softcap > 0.f;
  const sm90::FwdTileShape shape = sm90::fwd_tile_shape(plan.head_dim, p.causal, p.len_q, p.len_k, softcap);
  plan.consumers = shape.consumers;
  plan.block_m = shape.block_m;
  plan.block_n = shape.block_n;
  const int64_t num_m_blocks = (p.len_q + plan.block_m - 1) / plan.block_m;
  const int64_t num_tiles = num_m_blocks * p.heads * p.batch;
  const int64_t num_n_blocks = (p.len_k + plan.block_n - 1) / plan.block_n;

  switch (sm90::fwd_tile_order(plan.head_dim, p.causal, p.options)) {
    case sm90::TileOrder::kDynamic: {
      const int zigzag = sw.fwd_schedule == FwdScheduleChoice::kCounter
                             ? 0
                             : sm90::causal_zigzag_grid(num_m_blocks, num_tiles, device.num_sms);
      plan.schedule = zigzag > 0 ? FwdSchedule::kZigzag : FwdSchedule::kCounter;
      plan.grid = zigzag > 0 ? zigzag : device.num_sms;
      if (zigzag == 0) plan.workspace_bytes = plan.zeroed_bytes = sizeof(int);
      break;
    }
    case sm90::TileOrder::kStrideThenStreamK: {
      // The split depends on the batch: only where invariance is given up or the split forced, never deterministic.
      const bool forced = sw.fwd_schedule == FwdScheduleChoice::kStreamK;
      const bool allowed = forced || (sw.fwd_schedule == FwdScheduleChoice::kAuto && !sw.batch_invariant);
      if (allowed && !deterministic) {
        plan.sk_tiles = static_cast<int>(sm90::stream_k_tiles(num_tiles, device.num_sms, num_n_blocks,
                                                               forced ? 1 : sm90::kStreamKMinBlocks));
      }
      if (plan.sk_tiles > 0) {
        plan.schedule = FwdSchedule::kStreamK;
        plan.grid = device.num_sms;
        const int64_t slots = static_cast<int64_t>(device.num_sms) * sm90::kStreamKSlotsPerCta;
        plan.zeroed_bytes = 2 * slots * static_cast<int64_t>(sizeof(int));
        const int64_t partial_bytes =
            slots * sm90::stream_k_partial_floats(plan.head_dim) * static_cast<int64_t>(sizeof(float));
        plan.workspace_bytes = plan.zeroed_bytes + partial_bytes;
        break;
      }
      [[fallthrough]];
    }
    case sm90::TileOrder::kSequences:  // not asked for here (packed calls: plan_fwd_sequences)
    case sm90::TileOrder::kStride: {
      // The consumers that compute in a head's last tile (all of them but where a consumer without rows skips).
      const int64_t last_tile_rows = p.len_q - (num_m_blocks - 1) * plan.block_m;
      const int short_tile_consumers =
          plan.consumers == 3 ? static_cast<int>((last_tile_rows + 63) / 64) : plan.consumers;
      plan.schedule = FwdSchedule::kStride;
      plan.grid = sm90::static_grid(num_m_blocks, num_tiles, device.num_sms, plan.consumers, short_tile_consumers);
      break;
    }
  }
  plan.grid = static_cast<int>(std::min<int64_t>(num_tiles, plan.grid));
  return plan;
}

}  // namespace flashattn
