// The decode path's shapes (sm80/decode_kernel.h), decided once and used by the host (plan, grid, workspace) and the
// kernels alike: a few query rows against many keys, split over the keys, the query heads of a kv head packed.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/params.h"

namespace flashattn {

inline constexpr int kDecodeRows = 16;     // packed query rows per CTA (query heads of one kv head x queries)
inline constexpr int kDecodeBlockN = 64;   // keys per block of the K/V ring
inline constexpr int kDecodeMaxLenQ = 16;  // the longest query the decode path takes
inline constexpr int kDecodeMaxSplits = 64;
inline constexpr int kDecodeMinBlocksPerSplit = 4;
inline constexpr int kDecodeWarps = 4;  // each takes 16 keys of every block

// The ring's depth: enough bytes in flight to cover the memory latency, 3-4 stages of 64 keys (two CTAs per SM up to
// D128 on Hopper).
inline constexpr int decode_stages(int head_dim) { return head_dim <= 64 ? 4 : 3; }
// The kernel's shared memory (fp16 / bf16 tiles): Q's rows and the K/V ring, then fp32 row maxima and sums of every
// warp and the parts folded so far (sm80/decode_kernel.h); the plan checks it against the device's limit.
inline constexpr int decode_smem_bytes(int head_dim) {
  const int tiles = (kDecodeRows + 2 * decode_stages(head_dim) * kDecodeBlockN) * head_dim;
  const int floats = 2 * kDecodeWarps * kDecodeRows + kDecodeRows * head_dim;
  return tiles * 2 + floats * 4;
}

// CTAs per (kv head, batch entry) over the packed rows heads_per_kv * len_q.
__host__ __device__ constexpr int decode_row_groups(int heads_per_kv, int len_q) {
  return (heads_per_kv * len_q + kDecodeRows - 1) / kDecodeRows;
}

// The split over keys, from the shape and the SM count only (never the batch size nor the lengths in a cache), so
// that a row's bits depend on nothing else in the batch and a captured graph stays valid: as many CTAs for one batch
// entry as fill the GPU twice (two per SM) without a partial third wave, each split at least kDecodeMinBlocksPerSplit
// blocks. `requested` > 0 overrides it.
inline int decode_splits(int heads_kv, int heads_per_kv, int len_q, int64_t len_k, int num_sms, int64_t requested) {
  const int64_t blocks = std::max<int64_t>(1, (len_k + kDecodeBlockN - 1) / kDecodeBlockN);
  const int64_t most = std::min<int64_t>(kDecodeMaxSplits, blocks);
  if (requested > 0) return static_cast<int>(std::min(requested, most));
  const int64_t ctas = static_cast<int64_t>(heads_kv) * decode_row_groups(heads_per_kv, len_q);
  const int64_t want = 2 * static_cast<int64_t>(num_sms) / ctas;
  const int64_t cap = std::max<int64_t>(1, std::min(most, blocks / kDecodeMinBlocksPerSplit));
  return static_cast<int>(std::clamp<int64_t>(want, 1, cap));
}

// Whether one CTA runs all the splits of a row group in turn (folding their parts itself: no combine pass, no
// workspace) instead of a CTA per split: where the row groups alone fill at least 15/16 of two CTAs per SM and either
// the splits are short, so that splitting adds CTA starts, fp32 parts and a pass without adding parallelism (H32 /
// Hk32 B8 4k, 256 row groups on 264 slots: 142.5 -> 138.7 us), or the row groups also fill their last round of the
// SMs to 15/16, so that long CTAs leave no tail (Hk32 B8 32k: 1370.8 -> 1350.0 us on an H100). Elsewhere long splits
// keep a CTA each: many short CTAs fill a partial last round better than a few long ones. The same bits either way.
inline constexpr int kDecodeMaxBlocksInTurn = 8;  // a split's blocks, at most, for its row group to run in turn
inline bool decode_splits_in_turn(int batch, int heads_kv, int heads_per_kv, int len_q, int64_t len_k, int num_sms,
                                  int splits) {
  const int64_t ctas = static_cast<int64_t>(batch) * heads_kv * decode_row_groups(heads_per_kv, len_q);
  const int64_t blocks = (len_k + kDecodeBlockN - 1) / kDecodeBlockN;
  const int64_t slots = 2 * static_cast<int64_t>(num_sms);
  if (splits <= 1 || 16 * ctas < 15 * slots) return false;
  const int64_t last_round = ctas % slots;
  return blocks <= kDecodeMaxBlocksInTurn * splits || last_round == 0 || 16 * last_round >= 15 * slots;
}

// The grid: x the splits that run as CTAs of their own (1 where there is one or they run in turn) times the chunks of
// the batch, y the kv heads x row groups, z the batch entries, up to CUDA's 65535 (a larger batch continues in further
// chunks along x: the same kernel at any batch size).
inline constexpr int kDecodeMaxGridZ = 65535;
__host__ __device__ inline int decode_split_ctas(const FwdPlan& plan) {
  return plan.splits > 1 && !plan.splits_in_turn ? plan.splits : 1;
}

// The splits' workspace: split s's part of output row r (rows (batch, head, query), B * H * Lq of them) is row
// decode_split_part(p, s, r) of split_out (normalised, head_dim floats: the kernel's) and of split_lse, which follows.
__host__ __device__ inline int64_t decode_split_rows(const FwdParams& p) {
  return static_cast<int64_t>(p.batch) * p.heads * p.len_q;
}
__host__ __device__ inline int64_t decode_split_part(const FwdParams& p, int split, int64_t row) {
  return split * decode_split_rows(p) + row;
}
// Floats of the splits' workspace, and where split_lse starts in it.
inline int64_t decode_split_lse_offset(const FwdParams& p, int splits, int head_dim) {
  return splits * decode_split_rows(p) * head_dim;
}
inline int64_t decode_workspace_floats(const FwdParams& p, int splits, int head_dim) {
  if (splits <= 1) return 0;
  return decode_split_lse_offset(p, splits, head_dim) + splits * decode_split_rows(p);
}

// Merges the splits' rows (params.split_out / split_lse, rows of `head_dim` floats) into out and lse, in split order,
// with the sinks (decode_combine.cu); the Hopper forward's key splits of query chunks use it too.
template <typename T>
cudaError_t run_decode_combine(const FwdParams& params, int head_dim, cudaStream_t stream);

}  // namespace flashattn
