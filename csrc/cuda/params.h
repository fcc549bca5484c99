// The plain parameter block every forward kernel receives: raw pointers, 64-bit element strides, sizes and
// the softmax scale. No ATen types below this line; flash_api.cpp fills it from validated tensors.
#pragma once

#include <cstdint>

#include "cuda/divmod.h"

namespace flashattn {

// How a forward call runs, decided once on the host (cuda/fwd_plan.h) before anything is allocated or launched.
enum class FwdKernel : int { kSm80, kSm90, kDecode };  // kDecode: few query rows, split over keys (decode.h)
// The Hopper forward's tile schedules as the host runs them (tile_scheduler.h).
enum class FwdSchedule : int {
  kStride,   // whole tiles at a fixed stride
  kStreamK,  // the same, the last sk_tiles tiles split over keys between neighbouring CTAs (not batch-invariant)
  kCounter,  // causal: tiles from a zeroed counter, longest first
  kZigzag,   // causal: static zigzag rounds
  kSequences,  // packed sequences: tiles from a zeroed counter in an order built on the device (sm90/sequences.h)
};
struct FwdPlan {
  FwdKernel kernel;
  int head_dim;                     // the kernel's head dim: the bucket (sm80), 64, 128 or 256 (sm90)
  int kv_tiles;                     // sm80: K/V tiles in shared memory, 4, 2 or 1 (sm80/tile_size.h)
  int consumers, block_m, block_n;  // sm90: the tile shape (sm90/tile_size.h)
  FwdSchedule schedule;             // sm90
  int grid;                         // sm90: persistent CTAs
  int sk_tiles;                     // kStreamK: how many of the last tiles are split
  int64_t workspace_bytes;          // kCounter: the counter; kStreamK: the flags, then the partials; kSequences:
                                    // sm90/sequences.h
  int64_t zeroed_bytes;             // the leading part of the workspace zeroed before the launch
  int splits;                       // kDecode, kSequences over a KV cache: key splits (1: the kernel writes out)
  bool splits_in_turn;              // one CTA runs a row group's (a tile's) splits in turn: no combine pass
};

struct FwdParams {
  // Inputs (B, H or Hk, L, D) with stride(-1) == 1; strides are in elements.
  const void* __restrict__ q;
  const void* __restrict__ k;
  const void* __restrict__ v;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;

  // Outputs: out (B, H, Lq, D) with the strides below; lse float32 (B, H, Lq), contiguous.
  void* __restrict__ out;
  float* __restrict__ lse;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  int batch, heads, heads_kv, len_q, len_k, head_dim;
  int heads_per_kv;  // heads / heads_kv: query head h reads kv head h / heads_per_kv (GQA/MQA)

  float scale;       // multiplies q·k
  float scale_log2;  // scale * log2(e): the kernels work in exp2
  bool causal;       // bottom-right aligned: query i sees key j iff j <= i + len_k - len_q

  // Score modifications, taken by the kernels' options variants (`options`; the plain ones ignore them). The band:
  // query i sees key j iff i + shift - window_left <= j <= i + shift + window_right, shift = len_k - len_q, -1
  // unbounded (causal is folded in as window_right = 0; with options `causal` means window_right >= 0). softcap > 0:
  // scores are softcap * tanh(scale * q·k / softcap). sinks: float32 (heads,), a logit per query head in the softmax
  // denominator, or null.
  bool options;
  int window_left, window_right;
  float softcap;
  const float* __restrict__ sinks;

  // The Hopper forward's schedule state (tile_scheduler.h), set up by flash_api.cpp as the plan asks: tile_counter,
  // a zeroed int32 from which the causal kernels take their tiles (null: zigzag rounds); sk_flags, 2 * num_sms * 8
  // int32 zeroed per call (a lock and a "ready" flag per CTA boundary, consumer and warp of a stream-K split, whose
  // grid is the SM count), and sk_partial, num_sms * 8 * 32 * (D / 2 + 4) floats (a warp's unnormalised O, row bases in
  // log2 units and row sums).
  // Other kernels ignore them.
  int* tile_counter;
  int* sk_flags;
  float* sk_partial;

  FwdPlan plan;

  // Packed sequences (the sm80 sequences variants; null: dense): int32 (batch + 1) offsets of each sequence's rows in q
  // and out, and in k and v (packed.h). Then q, k, v and out are (total, heads, D) with batch strides 0, len_q and
  // len_k are the totals, and lse is (heads, total_q). (Last: the dense kernels' parameter layout stays as it was.)
  const int* __restrict__ cu_seqlens_q;
  const int* __restrict__ cu_seqlens_k;
  // A KV cache (the sm80 sequences variant; on Hopper, the entries as sequences): seqlens_k, int32 (batch,), each
  // entry's valid keys before the len_new appended ones (their sum clamped to len_k, the cache's capacity), or null:
  // len_k. block_table, int32 (batch, block_table_stride), or null: a paged cache, whose k/v batch strides are then the
  // page strides (num_pages pages of page_size rows).
  const int* __restrict__ seqlens_k;
  // leftpad_k, int32 (batch,), or null: a dense cache's entry b starts at row leftpad_k[b] (left padding), its keys
  // [leftpad_k[b], its length).
  const int* __restrict__ leftpad_k;
  int len_new;
  const int* __restrict__ block_table;
  int64_t block_table_stride;
  int page_size, num_pages;
  DivMod page_of;  // row -> page: page_size as a multiply and a shift
  // plan.splits > 1 (kDecode, or a KV cache on Hopper): each split's normalised rows (splits, B, H, Lq, the kernel's
  // head dim) and their lse (splits, B, H, Lq), merged by the combine pass (decode.h); on Hopper with
  // plan.splits_in_turn, split_out holds the consumers' fold states instead (fwd_plan.h: sequences_fold_floats).
  float* split_out;
  float* split_lse;
  // Packed sequences, or a KV cache's entries (cu_seqlens_q null), on Hopper (the sm90 sequences variants;
  // sm90/sequences.h builds these on the device before the launch): seq_order, the sequences in the order their tiles
  // run (longest first); seq_tile_start (batch + 1), each rank's first tile in that order; seq_maps, four CUtensorMaps
  // per sequence (q, k, v, out: its rows only), 128-byte aligned. The tiles come from tile_counter.
  int* seq_order;
  int* seq_tile_start;
  void* seq_maps;
};

#ifdef __CUDACC__
// Batch entry `batch`'s keys in a cache of `capacity` rows: its seqlens_k value and the len_new appended keys, clamped
// into the cache (null seqlens_k: every row).
__device__ inline int entry_len_k(const int* seqlens_k, int len_new, int capacity, int batch) {
  if (seqlens_k == nullptr) return capacity;
  const int64_t keys = static_cast<int64_t>(__ldg(seqlens_k + batch)) + len_new;
  return static_cast<int>(keys < 0 ? 0 : keys > capacity ? capacity : keys);
}
__device__ inline int entry_len_k(const FwdParams& p, int batch) {
  return entry_len_k(p.seqlens_k, p.len_new, p.len_k, batch);
}
// Batch entry `batch`'s keys as cache rows [first, first + len): from its left padding (leftpad_k, clamped to
// [0, entry_len_k]) or 0 to entry_len_k. first is 0 when len is, so the rows' base stays inside the cache.
struct EntryKeys {
  int first;
  int len;
};
__device__ inline EntryKeys entry_keys(const int* seqlens_k, const int* leftpad_k, int len_new, int capacity,
                                       int batch) {
  const int end = entry_len_k(seqlens_k, len_new, capacity, batch);
  if (leftpad_k == nullptr) return {0, end};
  const int pad = __ldg(leftpad_k + batch);
  const int first = pad < 0 ? 0 : pad > end ? end : pad;
  return first < end ? EntryKeys{first, end - first} : EntryKeys{0, 0};
}
__device__ inline EntryKeys entry_keys(const FwdParams& p, int batch) {
  return entry_keys(p.seqlens_k, p.leftpad_k, p.len_new, p.len_k, batch);
}
#endif

// The KV cache's append (kvcache_append.cu): row t of entry b's new keys and values (batch, heads_kv, len_new,
// head_dim) to cache position seqlens[b] + t (null seqlens: capacity - len_new; none outside [0, capacity)), in a
// dense cache or, with a block table, in its page (the caches' batch strides are then the page strides). chunk: the
// elements each copy moves (8: every address and stride a multiple of 16 bytes; else 1).
struct KvAppendParams {
  const void* __restrict__ k_new;
  const void* __restrict__ v_new;
  void* __restrict__ k_cache;
  void* __restrict__ v_cache;
  int64_t kn_batch_stride, kn_head_stride, kn_row_stride;
  int64_t vn_batch_stride, vn_head_stride, vn_row_stride;
  int64_t kc_batch_stride, kc_head_stride, kc_row_stride;
  int64_t vc_batch_stride, vc_head_stride, vc_row_stride;
  const int* __restrict__ seqlens;
  const int* __restrict__ block_table;
  int64_t block_table_stride;
  int batch, heads_kv, len_new, head_dim, capacity, page_size, num_pages, chunk;
};

// The fused backwards (csrc/cuda/sm80/bwd_kernel.h; on Hopper csrc/cuda/sm90/bwd_kernel.h, bwd_split_kernel.h).
// One CTA owns a block of keys of one kv head and walks the query blocks of every query head of its group that can
// see them: dK and dV are complete in registers when it ends (GQA sums included, no atomics); dQ is accumulated
// across CTAs into dq_accum with fp32 atomics or TMA reduce-adds (order-dependent either way).
struct BwdParams {
  const void* __restrict__ q;
  const void* __restrict__ k;
  const void* __restrict__ v;
  const void* __restrict__ dout;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t do_batch_stride, do_head_stride, do_row_stride;

  const float* __restrict__ lse;    // (B, H, Lq) contiguous, natural log, -inf for rows without keys
  const float* __restrict__ delta;  // (B, H, Lq) contiguous: rowsum(dO * O) - dlse
  float* __restrict__ dq_accum;     // (B, H, Lq, D) contiguous, zero on entry; receives dS K (unscaled)
  // Deterministic dQ: int32 counts of the key blocks added into each query block so far, zero on entry (Hopper kernels:
  // (B, H, query blocks, 2 dQ writers); the sm80 sequences variant: launchers.h); null: add in any order.
  int* __restrict__ dq_semaphore;
  // The persistent Hopper kernel (D <= 128): an int32 zero on entry from which its CTAs take key blocks, and its grid
  // bound (the SM count).
  int* tile_counter;
  int max_ctas;
  // Ordered dQ without a mask: the key blocks of this many (batch, kv head) pairs start in turn (tile_size.h's
  // bwd_ordered_interleave); 0 or 1: a pair's blocks one after another.
  int ordered_interleave;

  void* __restrict__ dk;  // (B, Hk, Lk, D) with the strides below, T
  void* __restrict__ dv;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;

  int batch, heads, heads_kv, len_q, len_k, head_dim;
  int heads_per_kv;
  float scale;       // multiplies q·k
  float scale_log2;  // scale * log2(e)
  // As FwdParams' (the sinks enter only through lse, which includes them).
  int window_left, window_right;
  float softcap;

  // Packed sequences (the sm80 sequences variant), as FwdParams'; then lse, delta and dq_accum are (H, total_q[, D])
  // contiguous and dk, dv (total_k, Hk, D) (their batch strides unused).
  const int* __restrict__ cu_seqlens_q;
  const int* __restrict__ cu_seqlens_k;
  // Packed sequences on Hopper (the sm90 sequences variants): five CUtensorMaps per sequence (q, k, v, dout,
  // dq_accum: its rows only; sm90/sequences.h), written on the device before the launch.
  void* seq_maps;
};

// The backward's preprocessing over the query rows (B, H, Lq): delta = rowsum(dO * O) - dlse, and dq_accum (and the
// Hopper kernel's tile counter) zeroed.
struct BwdPreprocessParams {
  const void* __restrict__ dout;
  const void* __restrict__ out;
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  const float* __restrict__ dlse;  // (B, H, Lq) contiguous, or null
  float* __restrict__ delta;       // (B, H, Lq) contiguous
  float* __restrict__ dq_accum;    // (B, H, Lq, D) contiguous, or null
  int* tile_counter;               // zeroed too, or null (BwdParams::tile_counter)
  int batch, heads, len_q, head_dim;
};

// The backward's last pass: dq = scale * dq_accum in the inputs' type.
struct BwdPostprocessParams {
  const float* __restrict__ dq_accum;  // (B, H, Lq, D) contiguous
  void* __restrict__ dq;               // rows 16-byte aligned
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  float scale;
  int batch, heads, len_q, head_dim;
};

}  // namespace flashattn
