// CUDA backend of torch.ops.flashattn: validate, guard the device, allocate, fill FwdParams, pick a kernel.
// ATen types stop here; kernels only see FwdParams.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "api/checks.h"
#include "cuda/fwd_launch.h"
#include "cuda/static_switch.h"

namespace flashattn {
namespace {

// Smallest compiled bucket >= head_dim.
int head_dim_bucket(int64_t head_dim) {
  for (int bucket : kHeadDimBuckets) {
    if (head_dim <= bucket) return bucket;
  }
  return 0;
}

void check_cuda_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionShape& s) {
  TORCH_CHECK(q.is_cuda(), "flashattn.fwd: expected CUDA tensors, got q on ", q.device());
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "flashattn.fwd: CUDA supports float16 and bfloat16; cast q, k, v to one of them (got ",
              q.scalar_type(), ")");
  TORCH_CHECK(s.head_dim % 8 == 0 && s.head_dim <= 256,
              "flashattn.fwd: on CUDA the head dim must be a multiple of 8 and at most 256, got ", s.head_dim);
  // cp.async moves 16-byte chunks: every row of q, k, v must start on a 16-byte boundary.
  for (const auto* t : {&q, &k, &v}) {
    const char* name = t == &q ? "q" : (t == &k ? "k" : "v");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "flashattn.fwd: ", name,
                " must be 16-byte aligned (its data pointer is not; its storage offset is ", t->storage_offset(), ")");
    for (int dim = 0; dim < 3; ++dim) {
      TORCH_CHECK(t->size(dim) <= 1 || t->stride(dim) % 8 == 0, "flashattn.fwd: ", name, ".stride(", dim,
                  ") must be a multiple of 8 elements (16 bytes), got ", t->stride(dim));
    }
  }
  const int64_t num_blocks = (s.len_q + 127) / 128 * s.heads * s.batch;
  TORCH_CHECK(num_blocks <= std::numeric_limits<int32_t>::max() && s.len_q <= std::numeric_limits<int32_t>::max() &&
                  s.len_k <= std::numeric_limits<int32_t>::max(),
              "flashattn.fwd: B * H * ceil(Lq / 128), Lq and Lk must each be below 2^31");
}

FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& lse, const AttentionShape& s, bool causal, double scale) {
  FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.batch = static_cast<int>(s.batch);
  p.heads = static_cast<int>(s.heads);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.len_q = static_cast<int>(s.len_q);
  p.len_k = static_cast<int>(s.len_k);
  p.head_dim = static_cast<int>(s.head_dim);
  p.heads_per_kv = static_cast<int>(s.heads / s.heads_kv);
  p.scale = static_cast<float>(scale);
  // The kernels need scale_log2 != 0 (masked scores are -inf, and -inf * 0 is NaN). For scale == 0 the
  // smallest normal float gives the same uniform softmax: every scaled score rounds to 0.
  p.scale_log2 = scale == 0.0 ? std::numeric_limits<float>::min() : static_cast<float>(scale * M_LOG2E);
  p.causal = causal;
  return p;
}

// The one place where runtime values become template parameters: dtype x head-dim bucket x causal.
cudaError_t launch_fwd(const FwdParams& params, at::ScalarType dtype, int bucket, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_half_type(dtype == at::kBFloat16, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_head_dim(bucket, [&](auto head_dim_tag) {
      constexpr int kHeadDim = decltype(head_dim_tag)::value;
      dispatch_bool(params.causal, [&](auto causal_tag) {
        constexpr bool kCausal = decltype(causal_tag)::value;
        err = sm80::run_fwd_sm80<T, kHeadDim, kCausal>(params, stream);
      });
    });
  });
  return err;
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            bool causal, std::optional<double> scale) {
  const AttentionShape s = check_fwd_inputs(q, k, v);
  check_cuda_inputs(q, k, v, s);
  const double softmax_scale = resolve_scale(scale, s.head_dim);
  const int bucket = head_dim_bucket(s.head_dim);
  TORCH_CHECK(head_dim_bucket_built(bucket), "flashattn.fwd: head dim ", s.head_dim, " needs bucket ", bucket,
              ", which this build left out (FLASHATTN_HEADDIMS at build time)");

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty({s.batch, s.heads, s.len_q, s.head_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads, s.len_q}, q.options().dtype(at::kFloat));
  if (s.empty()) return {out, lse};
  if (s.len_k == 0) {  // every row sees no key
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }

  const FwdParams params = make_fwd_params(q, k, v, out, lse, s, causal, softmax_scale);
  const cudaError_t err = launch_fwd(params, q.scalar_type(), bucket, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashattn.fwd: CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn, CUDA, m) { m.impl("fwd", &flashattn::fwd_cuda); }
