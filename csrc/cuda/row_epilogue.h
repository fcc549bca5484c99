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
