// Autograd for the flashattn ops, in C++: fwd and fwd_varlen take their gradients from bwd and bwd_varlen; the
// backward ops themselves have none (a second backward through them raises), nor has the forward-only KV-cache op.
// Kept out of Python because a training step calls it every layer: the Python autograd wrapper cost ~0.5 ms of host
// time per step, more than the GPU time of a short-row attention step.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace flashattn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdResult = std::tuple<at::Tensor, at::Tensor>;
using BwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

const auto& fwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::fwd", "").typed<FwdResult(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, std::optional<double>, at::IntArrayRef, double,
      const std::optional<at::Tensor>&)>();
  return op;
}

const auto& bwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::bwd", "").typed<BwdResult(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      bool, std::optional<double>, const std::optional<at::Tensor>&, bool, at::IntArrayRef, double,
      const std::optional<at::Tensor>&)>();
  return op;
}

const auto& fwd_varlen_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::fwd_varlen", "").typed<FwdResult(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      std::optional<int64_t>, std::optional<int64_t>, bool, std::optional<double>, at::IntArrayRef, double,
      const std::optional<at::Tensor>&)>();
  return op;
}

const auto& bwd_varlen_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::bwd_varlen", "").typed<BwdResult(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, std::optional<int64_t>, std::optional<int64_t>, bool, std::optional<double>,
      const std::optional<at::Tensor>&, bool, at::IntArrayRef, double, const std::optional<at::Tensor>&)>();
  return op;
}

std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The gradients of out and lse as the backward ops take them (grads are not materialised: an output nobody used comes
// as an undefined tensor): a missing dout is zeros; an expanded one (the grad of out.sum()) gets rows of its own.
std::tuple<at::Tensor, std::optional<at::Tensor>> output_grads(const variable_list& grads, const at::Tensor& out) {
  at::Tensor dout = grads[0];
  if (!dout.defined()) {
    dout = at::zeros_like(out);
  } else if (dout.sym_stride(-1) != 1) {  // sym_: under tracing the other strides may be known only at run time
    dout = dout.contiguous();
  }
  const at::Tensor& dlse = grads[1];
  return {dout, dlse.defined() ? std::optional<at::Tensor>(dlse.contiguous()) : std::nullopt};
}

// Options every forward saves for its backward.
void save_options(AutogradContext* ctx, bool causal, std::optional<double> scale, at::IntArrayRef window_size,
                  double softcap) {
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["window_size"] = window_size.vec();
  ctx->saved_data["softcap"] = softcap;
}

struct Options {
  bool causal;
  std::optional<double> scale;
  std::vector<int64_t> window_size;
  double softcap;
};

Options saved_options(AutogradContext* ctx) {
  return {ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toOptional<double>(),
          ctx->saved_data["window_size"].toIntVector(), ctx->saved_data["softcap"].toDouble()};
}

struct Attention : public torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               bool causal, std::optional<double> scale, at::IntArrayRef window_size, double softcap,
                               const std::optional<at::Tensor>& sinks) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = fwd_op().call(q, k, v, causal, scale, window_size, softcap, sinks);
    ctx->save_for_backward({q, k, v, out, lse, sinks.value_or(at::Tensor())});
    save_options(ctx, causal, scale, window_size, softcap);
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const std::optional<at::Tensor> sinks = optional_tensor(saved[5]);
    const Options o = saved_options(ctx);
    auto [dout, dlse] = output_grads(grads, out);
    auto [dq, dk, dv, dsinks] = bwd_op().call(dout, q, k, v, out, lse, o.causal, o.scale, dlse,
                                              at::globalContext().deterministicAlgorithms(), o.window_size,
                                              o.softcap, sinks);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            sinks.has_value() ? dsinks : at::Tensor()};
  }
};

struct VarlenAttention : public torch::autograd::Function<VarlenAttention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k, bool causal,
                               std::optional<double> scale, at::IntArrayRef window_size, double softcap,
                               const std::optional<at::Tensor>& sinks) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = fwd_varlen_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                           scale, window_size, softcap, sinks);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks.value_or(at::Tensor())});
    save_options(ctx, causal, scale, window_size, softcap);
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const std::optional<at::Tensor> sinks = optional_tensor(saved[7]);
    const Options o = saved_options(ctx);
    auto [dout, dlse] = output_grads(grads, out);
    auto [dq, dk, dv, dsinks] = bwd_varlen_op().call(
        dout, q, k, v, out, lse, saved[5], saved[6], ctx->saved_data["max_seqlen_q"].toOptional<int64_t>(),
        ctx->saved_data["max_seqlen_k"].toOptional<int64_t>(), o.causal, o.scale, dlse,
        at::globalContext().deterministicAlgorithms(), o.window_size, o.softcap, sinks);
    variable_list result(12);
    result[0] = dq, result[1] = dk, result[2] = dv;
    if (sinks.has_value()) result[11] = dsinks;
    return result;
  }
};

FwdResult fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                       std::optional<double> scale, at::IntArrayRef window_size, double softcap,
                       const std::optional<at::Tensor>& sinks) {
  const variable_list r = Attention::apply(q, k, v, causal, scale, window_size, softcap, sinks);
  return {r[0], r[1]};
}

FwdResult fwd_varlen_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                              std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k, bool causal,
                              std::optional<double> scale, at::IntArrayRef window_size, double softcap,
                              const std::optional<at::Tensor>& sinks) {
  const variable_list r = VarlenAttention::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 causal, scale, window_size, softcap, sinks);
  return {r[0], r[1]};
}

const auto& fwd_kvcache_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn::fwd_kvcache", "").typed<FwdResult(
      const at::Tensor&, at::Tensor&, at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, std::optional<double>, at::IntArrayRef,
      double, const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&)>();
  return op;
}

// The KV-cache op is forward only: with grad mode on, an input that requires grad raises (its outputs would otherwise
// carry requires_grad and a backward would silently leave the inputs without gradients).
FwdResult fwd_kvcache_autograd(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                               const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                               const std::optional<at::Tensor>& cache_seqlens,
                               const std::optional<at::Tensor>& block_table, bool causal, std::optional<double> scale,
                               at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& sinks,
                               int64_t num_splits, const std::optional<at::Tensor>& cache_leftpad) {
  TORCH_CHECK(!torch::autograd::compute_requires_grad(q, k_cache, v_cache, k.value_or(at::Tensor()),
                                                       v.value_or(at::Tensor()), sinks.value_or(at::Tensor())),
              "flashattn.fwd_kvcache is forward only: call it under torch.no_grad() or on tensors that do not "
              "require grad");
  at::AutoDispatchBelowAutograd below_autograd;  // on to the version counters (below)
  return fwd_kvcache_op().call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window_size,
                               softcap, sinks, num_splits, cache_leftpad);
}

// Caches the op writes (k and v given) get their version counters bumped, as an in-place op's, under inference mode
// too (which skips the Autograd kernel); a call that only reads them leaves them alone, so that caches made under
// inference mode can be read outside it.
FwdResult fwd_kvcache_versions(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                               const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                               const std::optional<at::Tensor>& cache_seqlens,
                               const std::optional<at::Tensor>& block_table, bool causal, std::optional<double> scale,
                               at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& sinks,
                               int64_t num_splits, const std::optional<at::Tensor>& cache_leftpad) {
  FwdResult result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = fwd_kvcache_op().call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window_size,
                                   softcap, sinks, num_splits, cache_leftpad);
  }
  if (k.has_value()) {
    torch::autograd::impl::bump_version(k_cache);
    torch::autograd::impl::bump_version(v_cache);
  }
  return result;
}

// The backward ops under autograd: with grad mode on and a tensor input that requires grad (a backward run with
// create_graph=True), their outputs get a node that raises once something differentiates through them.
template <typename Run>
BwdResult without_double_backward(const variable_list& inputs, const Run& run) {
  BwdResult result;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    result = run();
  }
  if (torch::autograd::compute_requires_grad(inputs)) {
    const auto node = std::make_shared<torch::autograd::Error>(
        "flashattn: double backward (gradients of flashattn gradients, e.g. torch.autograd.grad(..., "
        "create_graph=True) followed by another backward) is not supported",
        torch::autograd::collect_next_edges(inputs));
    const auto& [dq, dk, dv, dsinks] = result;
    for (const at::Tensor& grad : {dq, dk, dv, dsinks}) torch::autograd::set_history(grad, node);
  }
  return result;
}

BwdResult bwd_autograd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, const at::Tensor& lse, bool causal, std::optional<double> scale,
                       const std::optional<at::Tensor>& dlse, bool deterministic, at::IntArrayRef window_size,
                       double softcap, const std::optional<at::Tensor>& sinks) {
  return without_double_backward(
      {dout, q, k, v, out, lse, dlse.value_or(at::Tensor()), sinks.value_or(at::Tensor())}, [&] {
        return bwd_op().call(dout, q, k, v, out, lse, causal, scale, dlse, deterministic, window_size, softcap, sinks);
      });
}

BwdResult bwd_varlen_autograd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                              const at::Tensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
                              std::optional<int64_t> max_seqlen_k, bool causal, std::optional<double> scale,
                              const std::optional<at::Tensor>& dlse, bool deterministic, at::IntArrayRef window_size,
                              double softcap, const std::optional<at::Tensor>& sinks) {
  return without_double_backward(
      {dout, q, k, v, out, lse, dlse.value_or(at::Tensor()), sinks.value_or(at::Tensor())}, [&] {
        return bwd_varlen_op().call(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, scale, dlse, deterministic, window_size, softcap, sinks);
      });
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn, Autograd, m) {
  m.impl("fwd", &flashattn::fwd_autograd);
  m.impl("bwd", &flashattn::bwd_autograd);
  m.impl("fwd_varlen", &flashattn::fwd_varlen_autograd);
  m.impl("bwd_varlen", &flashattn::bwd_varlen_autograd);
  m.impl("fwd_kvcache", &flashattn::fwd_kvcache_autograd);
}

TORCH_LIBRARY_IMPL(flashattn, ADInplaceOrView, m) {
  m.impl("fwd_kvcache", &flashattn::fwd_kvcache_versions);
}
