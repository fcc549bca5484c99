// How every forward kernel (sm80 and sm90) finishes a query row: whether the row sees a key, and its lse.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include "cuda/ptx_common.h"

namespace flashattn {

// Query `row` sees at least one key unless the bottom-right causal mask leaves it none: row + (Lk - Lq) < 0
// (causal_shift = Lk - Lq; the kernels run only with Lk > 0).
template <bool kCausal>
__device__ __forceinline__ bool row_sees_keys(int row, int causal_shift) {
  return !kCausal || row + causal_shift >= 0;
}

// Query `row` sees at least one key of the band (FwdParams::window_left / window_right; -1 unbounded).
__device__ __forceinline__ bool row_sees_band(int row, int shift, int left, int right, int len_k) {
  const int first = left < 0 ? 0 : max(0, row + shift - left);
  const int last = right < 0 ? len_k - 1 : min(len_k - 1, row + shift + right);
  return first <= last;
}

// A row's sink joins the softmax: the sum of exp2(score - base) over its keys grows by exp2(sink * log2(e) - base),
// with the base moved to the sink where that is larger. Returns the factor the row's accumulator is multiplied by
// before the division by the new sum; updates base_log2 and sum. A row without keys (sum 0) gets sum 1, base = sink.
__device__ __forceinline__ float add_sink(float sink, float& base_log2, float& sum) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float sink_log2 = sink * kLog2e;
  if (sink_log2 == -CUDART_INF_F) return 1.f;
  const float new_base = sum > 0.f ? fmaxf(base_log2, sink_log2) : sink_log2;
  const float rescale = sum > 0.f ? exp2f(base_log2 - new_base) : 0.f;
  sum = sum * rescale + exp2f(sink_log2 - new_base);
  base_log2 = new_base;
  return rescale;
}

// The natural-log lse of a finished row, from the base its exponentials were taken against (log2 units) and their
// sum. A row without keys: -inf. A row with keys sums to more than 0 (at least 1 against its own max, 2^-116 against
// a fixed softcap reference) unless a score was NaN or +inf (NaN sum, from inf - inf) or every score was -inf (sum 0);
// softmax is NaN there, and so is the lse: -inf always means "no key", and the backward turns a NaN row's gradients
// into NaN, not 0.
__device__ __forceinline__ float row_lse(bool sees_keys, float base_log2, float sum) {
  constexpr float kLn2 = 0.6931471805599453f;
  if (!sees_keys) return -CUDART_INF_F;
  return sum > 0.f ? (base_log2 + __log2f(sum)) * kLn2 : CUDART_NAN_F;
}

// Whether a row that add_sink gave its sink (keep: what add_sink returned) has the sink's logit itself as its lse:
// where no key weighs anything against the sink (the row sees none, every score it sees is -inf, or their weights
// fall below float's range: keep 0 and the sum the sink's 1 alone), as the CPU and the split fold (fold_finish) give.
// A NaN row that sees keys stays NaN (its sum is NaN).
__device__ __forceinline__ bool lse_is_sink(bool sees_keys, float keep, float sum) {
  return !sees_keys || (keep == 0.f && sum == 1.f);
}

// A row computed in key splits (the decode path): its parts, each normalised with its natural-log lse, folded in split
// order into a running maximum m and sum, the output accumulated as acc = acc * alpha + part * beta. The decode kernel
// (a CTA running the splits in turn) and the combine pass (a CTA per split before it) both fold through these, so that
// a row's bits do not depend on which of them ran. A fold starts at {-inf, 0}; a NaN part makes the sum NaN.
struct SplitFold {
  float m, sum;
};

// The factors of the accumulator and of a part of lse `lse` (not -inf) where the parts before it had maximum m_prev
// and m = fmaxf(m_prev, lse): the maxima are exact, so the combine may form them by a scan, in any order.
__device__ __forceinline__ void fold_factors(float m_prev, float m, float lse, float& alpha, float& beta) {
  constexpr float kLog2e = 1.4426950408889634f;
  alpha = m_prev == -CUDART_INF_F ? 0.f : fast_exp2((m_prev - m) * kLog2e);
  beta = fast_exp2((lse - m) * kLog2e);
}

// Folds in a part of lse `lse`: false where the part saw no key of the row (nothing to add), else the factors.
__device__ __forceinline__ bool fold_part(SplitFold& f, float lse, float& alpha, float& beta) {
  if (lse == -CUDART_INF_F) return false;
  const float m = fmaxf(f.m, lse);
  fold_factors(f.m, m, lse, alpha, beta);
  f.sum = fmaf(f.sum, alpha, beta);
  f.m = m;
  return true;
}

__device__ __forceinline__ float fold_add(float acc, float alpha, float part, float beta) {
  return fmaf(part, beta, acc * alpha);
}
__device__ __forceinline__ float4 fold_add(float4 acc, float alpha, float4 part, float beta) {
  return make_float4(fold_add(acc.x, alpha, part.x, beta), fold_add(acc.y, alpha, part.y, beta),
                     fold_add(acc.z, alpha, part.z, beta), fold_add(acc.w, alpha, part.w, beta));
}

// The folded row's end: the sink (natural-log logit; -inf or none: no sink) joins the denominator. Returns the factor
// of the accumulator and sets lse: 0 and -inf for a row without keys or sink, NaN for a NaN row and for a row that
// sees keys (sees_keys: the band's geometry, row_sees_band) whose scores were all -inf (every part empty), as softmax.
__device__ __forceinline__ float fold_finish(SplitFold f, float sink, bool sees_keys, float& lse) {
  constexpr float kLog2e = 1.4426950408889634f;
  float keep = 1.f;
  if (sink != -CUDART_INF_F) {
    const float m = fmaxf(f.m, sink);
    keep = f.m == -CUDART_INF_F ? 0.f : fast_exp2((f.m - m) * kLog2e);
    f.sum = fmaf(f.sum, keep, fast_exp2((sink - m) * kLog2e));
    f.m = m;
  }
  if (f.sum > 0.f) {
    lse = f.m + __logf(f.sum);
    return keep / f.sum;
  }
  const bool empty = f.sum == 0.f && !sees_keys;
  lse = empty ? -CUDART_INF_F : CUDART_NAN_F;
  return empty ? 0.f : CUDART_NAN_F;
}

}  // namespace flashattn
