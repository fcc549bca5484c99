// Division by a divisor fixed for a launch, set up on the host: n / d = (umulhi(n, multiplier) + n) >> shift for
// 0 <= n < 2^31 (Granlund and Montgomery). A paged cache's row -> page in three instructions where a division costs
// about twenty, with both numbers in the kernel's parameters (no registers held).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashattn {

struct DivMod {
  uint32_t multiplier = 1;
  int shift = 0;  // ceil(log2(d))

  static DivMod of(int d) {  // d > 0
    DivMod dm;
    while ((int64_t{1} << dm.shift) < d) ++dm.shift;
    dm.multiplier = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << dm.shift) - d) / d + 1);
    return dm;
  }

#ifdef __CUDACC__
  __device__ __forceinline__ int div(int n) const {
    return static_cast<int>((__umulhi(static_cast<uint32_t>(n), multiplier) + static_cast<uint32_t>(n)) >> shift);
  }
#endif
};

}  // namespace flashattn
