// The memory layout of an output that corresponds to an input, shared by every backend (and mirrored by
// flashattn_ext/ops.py's fake implementations).
#pragma once

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <c10/util/strides.h>

#include <vector>

namespace flashattn {

// out and dq take q's layout, dk k's and dv v's: torch.empty_like's strides (the input's own where it is dense and
// non-overlapping, else dense strides in its order of dimensions), so that a (B, L, H, D) tensor viewed as (B, H, L, D)
// gets an output in (B, L, H, D) memory, which the caller views back without a copy (aten's attention backends do
// the same). Contiguous where those strides would not suit the kernels (of a dimension of more than one element: the
// last not 1, another not a multiple of 8 elements, 16-byte rows for fp16 / bf16) and for an empty tensor. The
// strides of dimensions of one element address nothing: the fake implementations may differ there.
inline std::vector<int64_t> output_strides_like(const at::Tensor& t) {
  std::vector<int64_t> strides = t.is_non_overlapping_and_dense()
                                     ? t.strides().vec()
                                     : at::infer_dense_strides(t.sizes(), t.strides());
  bool usable = t.numel() > 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) usable = usable && (d + 1 == t.dim() ? strides[d] == 1 : strides[d] % 8 == 0);
  }
  if (usable) return strides;
  const c10::DimVector contiguous = c10::contiguous_strides(t.sizes());
  return {contiguous.begin(), contiguous.end()};
}

// An uninitialised tensor shaped and laid out as output_strides_like(t) (CPU; CUDA allocates without the
// deterministic fill, flash_api.cpp).
inline at::Tensor empty_output_like(const at::Tensor& t) {
  return at::empty_strided(t.sizes(), output_strides_like(t), t.options());
}

}  // namespace flashattn
