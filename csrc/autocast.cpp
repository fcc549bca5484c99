// Autocast for flashattn.fwd and fwd_varlen, as SDPA has it: under torch.autocast(device, dtype), the floating q, k and
// v that are not float64 are cast to the autocast dtype (fp32 inputs, or a mix such as fp32 q and k after a QK-norm
// that autocast ran in fp32 with a bf16 v) and the op runs in that dtype; sinks stay float32. Outside autocast nothing
// is cast, and mixed dtypes raise. The casts are differentiable, so gradients reach the inputs in their own dtypes; the
// backward op needs no rule of its own (autograd calls it with the tensors the forward ran on).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace flashattn {
namespace {

using FwdSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                                                        std::optional<double>, at::IntArrayRef, double,
                                                        const std::optional<at::Tensor>&);

template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> fwd_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool causal, std::optional<double> scale,
                                                at::IntArrayRef window_size, double softcap,
                                                const std::optional<at::Tensor>& sinks) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_lower_precision_fp_from_device_type(kDevice);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::fwd", "").typed<FwdSignature>();
  return op.call(at::autocast::cached_cast(dtype, q, kDevice), at::autocast::cached_cast(dtype, k, kDevice),
                 at::autocast::cached_cast(dtype, v, kDevice), causal, scale, window_size, softcap, sinks);
}

using FwdVarlenSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    std::optional<int64_t>, std::optional<int64_t>, bool, std::optional<double>, at::IntArrayRef, double,
    const std::optional<at::Tensor>&);

template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> fwd_varlen_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                       std::optional<int64_t> max_seqlen_q,
                                                       std::optional<int64_t> max_seqlen_k, bool causal,
                                                       std::optional<double> scale, at::IntArrayRef window_size,
                                                       double softcap, const std::optional<at::Tensor>& sinks) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_lower_precision_fp_from_device_type(kDevice);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::fwd_varlen", "").typed<FwdVarlenSignature>();
  return op.call(at::autocast::cached_cast(dtype, q, kDevice), at::autocast::cached_cast(dtype, k, kDevice),
                 at::autocast::cached_cast(dtype, v, kDevice), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 causal, scale, window_size, softcap, sinks);
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn, AutocastCUDA, m) {
  m.impl("fwd", &flashattn::fwd_autocast<c10::DeviceType::CUDA>);
  m.impl("fwd_varlen", &flashattn::fwd_varlen_autocast<c10::DeviceType::CUDA>);
}
TORCH_LIBRARY_IMPL(flashattn, AutocastCPU, m) {
  m.impl("fwd", &flashattn::fwd_autocast<c10::DeviceType::CPU>);
  m.impl("fwd_varlen", &flashattn::fwd_varlen_autocast<c10::DeviceType::CPU>);
}
