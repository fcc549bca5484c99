// The plain parameter block every forward kernel receives: raw pointers, 64-bit element strides, sizes and
// the softmax scale. No ATen types below this line; flash_api.cpp fills it from validated tensors.
#pragma once

#include <cstdint>

namespace flashattn {

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

  // Hopper forward under a causal mask, where tiles differ in length: the persistent CTAs take their next tile
  // from tile_counter (a zeroed int32) where it is set, else they walk static zigzag rounds on zigzag_grid CTAs
  // (launch.h: sm90_causal_zigzag_grid; 0 means one per SM). flash_api.cpp chooses; other kernels ignore both.
  int* tile_counter;
  int zigzag_grid;

  // Hopper forward without a mask (the D128 kernel): the last sk_tiles tiles are split over keys between neighbouring
  // CTAs (launch.h: sm90_stream_k_tiles; 0: none). sk_flags: 2 * num_sms * 8 int32, zeroed per call (a lock, then a
  // "ready" flag per CTA boundary, consumer and warp); sk_partial: num_sms * 8 * 32 * (D / 2 + 4) floats (a warp's
  // unnormalised O, row bases in log2 units and row sums). flash_api.cpp allocates them; other kernels ignore all
  // three.
  int sk_tiles;
  int* sk_flags;
  float* sk_partial;
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
  float* __restrict__ dq_accum;     // (B, H, Lq, D) contiguous, zero on entry; receives scale * dS K

  void* __restrict__ dk;  // (B, Hk, Lk, D) contiguous, T
  void* __restrict__ dv;

  int batch, heads, heads_kv, len_q, len_k, head_dim;
  int heads_per_kv;
  float scale;       // multiplies q·k
  float scale_log2;  // scale * log2(e)
};

// rowsum(dO * O) - dlse for every query row (the backward's "D" vector).
struct BwdDeltaParams {
  const void* __restrict__ dout;
  const void* __restrict__ out;
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  const float* __restrict__ dlse;  // (B, H, Lq) contiguous, or null
  float* __restrict__ delta;       // (B, H, Lq) contiguous
  int batch, heads, len_q, head_dim;
};

}  // namespace flashattn
