// Host side of the Hopper forward: the TMA maps and the launch of the kernel variant the plan chose (fwd_plan.h).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/params.h"
#include "cuda/sm90/fwd_kernel.h"
#include "cuda/sm90/fwd_traits.h"
#include "cuda/sm90/tma.h"

namespace flashattn::sm90 {

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  const FwdPlan& plan = params.plan;
  if (plan.block_m != Traits::kBlockM || plan.block_n != Traits::kBlockN) return cudaErrorInvalidValue;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  CUtensorMap q_map, k_map, v_map, o_map{};
  // The plan checked the maps' rules (tma.h: tma_can_map); the driver refusing one is unexpected.
  if (!make_qkv_maps(params, kBf16, Traits::kBlockM / Traits::kQParts, Traits::kBlockN, &q_map, &k_map, &v_map)) {
    return cudaErrorNotSupported;
  }
  // O in boxes of one warp's 16 rows, all its columns in one where the kernel stores them so (the output is ours,
  // contiguous).
  const bool o_mapped = Traits::o_one_store(params.head_dim)
                            ? make_bhld_column_block_map(&o_map, params.out, kBf16, params.batch, params.heads,
                                                         params.len_q, params.head_dim, params.o_batch_stride,
                                                         params.o_head_stride, params.o_row_stride, 16,
                                                         Traits::kColumnBlocks)
                            : make_bhld_map(&o_map, params.out, kBf16, params.batch, params.heads, params.len_q,
                                            params.head_dim, params.o_batch_stride, params.o_head_stride,
                                            params.o_row_stride, 16);
  if (!o_mapped) return cudaErrorNotSupported;
  auto kernel = flash_fwd_sm90_kernel<T, Traits, kCausal>;
  static_assert(sizeof(T) == 2, "16-bit elements");
  if (!allow_dynamic_smem(kernel, Traits::kSmemBytes)) return cudaErrorNotSupported;
  kernel<<<plan.grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(q_map, k_map, v_map, o_map, params);
  return cudaGetLastError();
}

// Launches the Hopper forward with HeadDim 64, 128 or 256 on `stream` as params.plan says (kOptions: the variant with
// windows, softcap and sinks). Returns cudaErrorInvalidValue where the plan names a variant this head dim does not
// have, cudaErrorNotSupported where the driver refuses a tensor map or the shared memory; launches nothing then.
template <typename T, int HeadDim, bool kCausal, bool kOptions>
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  const FwdPlan& plan = params.plan;
  if constexpr (HeadDim == 64) {
    if constexpr (kCausal) {
      if (plan.consumers == 3) {
        return launch_fwd_sm90<T, FwdTraits<64, true, 128, 3, kOptions>, true>(params, stream);
      }
      return launch_fwd_sm90<T, FwdTraits<64, true, 128, 2, kOptions>, true>(params, stream);
    } else {
      return launch_fwd_sm90<T, FwdTraits<64, false, 128, 3, kOptions>, false>(params, stream);
    }
  } else if constexpr (HeadDim == 128) {
    return launch_fwd_sm90<T, FwdTraits<128, kCausal, 128, 2, kOptions>, kCausal>(params, stream);
  } else {
    if (plan.block_n == 64) {
      return launch_fwd_sm90<T, FwdTraits<256, kCausal, 64, 2, kOptions>, kCausal>(params, stream);
    }
    return launch_fwd_sm90<T, FwdTraits<256, kCausal, 80, 2, kOptions>, kCausal>(params, stream);
  }
}

}  // namespace flashattn::sm90
