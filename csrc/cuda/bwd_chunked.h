// The chunked CUDA backward (see bwd_chunked.cpp); called by flash_api.cpp after validation and device guard.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "api/checks.h"

namespace flashattn {

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_chunked(const at::Tensor& dout, const at::Tensor& q,
                                                           const at::Tensor& k, const at::Tensor& v,
                                                           const at::Tensor& out, const at::Tensor& lse,
                                                           const std::optional<at::Tensor>& dlse,
                                                           const AttentionShape& s, const ScoreMods& mods,
                                                           double softmax_scale);

}  // namespace flashattn
