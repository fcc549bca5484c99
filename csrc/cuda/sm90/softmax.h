// Online softmax of the Hopper forward over one block of scores held in wgmma accumulator layout: each thread owns two
// rows (h = 0, 1: rows r and r + 8 of its warp's 16), whose columns live in a 4-lane quad.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/ptx_common.h"
#include "cuda/sm90/mask.h"

namespace flashattn::sm90 {

// With ExpPolicy::kLazyRescale the max a row's exponentials are taken against (its reference) moves only when the
// block's max exceeds it by more than this (log2 units), so the exponentials stay below 2^8 (far from overflow in fp32
// sums and in 16-bit P) and O is rescaled only on blocks where some row moved.
inline constexpr float kLazyRescaleLog2 = 8.f;
// With ExpPolicy::kOptimistic a block's exponentials against the unmoved reference stand while each row's sum over
// the thread's columns stays below this (2^14): every exponential then fits in fp16 (65504) as well as bf16 and fp32.
inline constexpr float kOptimisticSumLimit = 16384.f;
// Softcapped scores are tanh values (at most 1, the softmax takes them times softcap): up to this softcap a reference
// of 1 keeps every exponential, down to 2^(-2 softcap log2 e) > 2^-126, a normal float and bf16 (fp16 P would lose
// them), so no row's reference ever moves.
inline constexpr float kFixedReferenceMaxSoftcap = 40.f;

// The exponentials' base in log2 units for a row whose reference max is `reference`: 0 for a row that has seen no key
// (-inf), so its exponentials stay 0 rather than NaN.
__device__ __forceinline__ float softmax_base_log2(float reference, float scale_log2) {
  return reference == -INFINITY ? 0.f : reference * scale_log2;
}

template <int kBlockN>
struct RowSoftmax {
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  // Masks a block of scores (mask.h gives first_col and last_col: the key columns row h may see, relative to the block
  // and this lane's first column, first_col only with a band's left edge, kBand) where `edges` says a bound cuts the
  // block (BandEdge bits with kBand; else any nonzero value tests last_col, 0 skips the comparisons) and, with a
  // negative scale, negates them, so that the maxima below are maxima of scale * score.
  template <bool kBand>
  __device__ __forceinline__ static void mask(float (&s)[kBlockN / 2], bool negate, int edges,
                                              const int (&first_col)[2], const int (&last_col)[2]) {
    if constexpr (kBand) {
      if (negate) {
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) s[i] = -s[i];
      }
      fill_outside(s, first_col, last_col, edges, -INFINITY);
    } else {
      const bool needs_mask = edges != 0;
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
  }

  // Row h's entries of s become exp2(s * scale_log2 - base), with kCapped exp2(tanh(s * cap_scale) * scale_log2 - base)
  // (softcap's tanh in the same pass); returns their sum.
  template <bool kCapped = false>
  __device__ __forceinline__ static float exp_row(float (&s)[kBlockN / 2], int h, float scale_log2, float base,
                                                  float cap_scale = 0.f) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& x = s[4 * j + 2 * h + c];
        x = fast_exp2(fmaf(kCapped ? fast_tanh(x * cap_scale) : x, scale_log2, -base));
        sum += x;
      }
    }
    return sum;
  }

  // ExpPolicy::kOptimistic: s becomes exp2(s * scale_log2 - reference) with the references unmoved, and block_sum the
  // rows' sums over this thread's columns. Returns whether they can stand: every row below the bound (NaN passes, as
  // it would through the max) and no row without a reference (-inf) saw a key. The caller votes over the warpgroup,
  // then either adds block_sum (accept) or recomputes S (s is spent) and takes update<false>.
  template <bool kBand>
  __device__ __forceinline__ bool exp_against_reference(float (&s)[kBlockN / 2], float scale_log2, bool negate,
                                                        int edges, const int (&first_col)[2],
                                                        const int (&last_col)[2], float (&block_sum)[2]) const {
    mask<kBand>(s, negate, edges, first_col, last_col);
    bool fits = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      block_sum[h] = exp_row(s, h, scale_log2, softmax_base_log2(row_max[h], scale_log2));
      fits &= sum_fits(block_sum[h], row_max[h]);
    }
    return fits;
  }

  // The same for softcapped scores of a block without masks, s still raw: the tanh pass and the exponentials' in one
  // (the same operations in their order: the same bits), so that the tanh and exp2 MUFU streams interleave with the
  // rest of the softmax (as two passes, each MUFU stream queued up alone).
  __device__ __forceinline__ bool capped_exp_against_reference(float (&s)[kBlockN / 2], float cap_scale,
                                                               float scale_log2, float (&block_sum)[2]) const {
    bool fits = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      block_sum[h] = exp_row<true>(s, h, scale_log2, softmax_base_log2(row_max[h], scale_log2), cap_scale);
      fits &= sum_fits(block_sum[h], row_max[h]);
    }
    return fits;
  }

  // A row's block sum stands against its reference. Bitwise, not short-circuit: no branches in the key loop.
  __device__ __forceinline__ static bool sum_fits(float block_sum, float reference) {
    return !(block_sum >= kOptimisticSumLimit) & (block_sum == 0.f | reference != -INFINITY);
  }

  // s becomes exp2(s * scale_log2 - the rows' new reference), the running max and sum are updated, and rescale gets
  // the factor the old O rows must be multiplied by. kLazy: the reference moves only past kLazyRescaleLog2; returns
  // whether one of the thread's rows moved.
  template <bool kLazy, bool kBand>
  __device__ __forceinline__ bool update(float (&s)[kBlockN / 2], float scale_log2, bool negate, int edges,
                                         const int (&first_col)[2], const int (&last_col)[2], float (&rescale)[2]) {
    bool moved = false;
    mask<kBand>(s, negate, edges, first_col, last_col);
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
      rescale[h] = move ? fast_exp2(row_max[h] * scale_log2 - base) : 1.f;
      row_max[h] = reference;
      moved |= move;
      row_sum[h] = row_sum[h] * rescale[h] + exp_row(s, h, scale_log2, base);
    }
    return moved;
  }
};

// The thread's O rows (accumulator layout, kHeadDim columns) times their rescale factors.
template <int kHeadDim>
__device__ __forceinline__ void rescale_o(float (&o)[kHeadDim / 2], const float (&rescale)[2]) {
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[4 * j + i] *= rescale[i / 2];
  }
}

}  // namespace flashattn::sm90
