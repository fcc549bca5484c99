// Runtime values -> compile-time template parameters, in one place. Each dispatch calls `f` with a tag whose
// type carries the value (std::integral_constant / std::bool_constant / TypeTag), so call sites read
//   dispatch_bool(causal, [&](auto causal_tag) { constexpr bool kCausal = decltype(causal_tag)::value; ... });
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

// The head-dim buckets compiled into this build (setup.py passes FLASHATTN_BUILT_HEADDIMS from
// FLASHATTN_HEADDIMS); a bucket that is not listed is never instantiated, so it cannot be a link error.
#ifndef FLASHATTN_BUILT_HEADDIMS
#define FLASHATTN_BUILT_HEADDIMS 32, 64, 96, 128, 160, 192, 224, 256
#endif

namespace flashattn {

template <typename T>
struct TypeTag {
  using type = T;
};

template <int... kBuckets>
struct HeadDimList {
  static constexpr bool contains(int bucket) { return ((bucket == kBuckets) || ...); }

  template <typename F>
  static bool dispatch(int bucket, F&& f) {
    return ((bucket == kBuckets ? (f(std::integral_constant<int, kBuckets>{}), true) : false) || ...);
  }
};

using BuiltHeadDims = HeadDimList<FLASHATTN_BUILT_HEADDIMS>;

inline bool head_dim_bucket_built(int bucket) { return BuiltHeadDims::contains(bucket); }

// Returns false when `bucket` is not built (nothing is called).
template <typename F>
bool dispatch_head_dim(int bucket, F&& f) {
  return BuiltHeadDims::dispatch(bucket, std::forward<F>(f));
}

template <typename F>
void dispatch_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// bf16 or fp16, as the CUDA element type the kernels are written in.
template <typename F>
void dispatch_half_type(bool is_bf16, F&& f) {
  if (is_bf16) {
    f(TypeTag<__nv_bfloat16>{});
  } else {
    f(TypeTag<__half>{});
  }
}

}  // namespace flashattn
