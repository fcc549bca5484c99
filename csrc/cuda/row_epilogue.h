// How every forward kernel (sm80 and sm90) finishes a query row: whether the row sees a key, and its lse.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

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
// sum. A row without keys: -inf. A row with keys sums to at least 1 (its max contributes exp2(0)) unless a score was
// NaN or +inf (NaN sum, from inf - inf) or every score was -inf (sum 0); softmax is NaN there, and so is the lse:
// -inf always means "no key", and the backward turns a NaN row's gradients into NaN, not 0.
__device__ __forceinline__ float row_lse(bool sees_keys, float base_log2, float sum) {
  constexpr float kLn2 = 0.6931471805599453f;
  if (!sees_keys) return -CUDART_INF_F;
  return sum > 0.f ? (base_log2 + __log2f(sum)) * kLn2 : CUDART_NAN_F;
}

}  // namespace flashattn
