// CUDA backend of torch.ops.flashattn: validate, guard the device, allocate, fill the params, pick a kernel.
// ATen types stop here; kernels only see FwdParams / BwdParams.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "api/checks.h"
#include "cuda/bwd_chunked.h"
#include "cuda/launch.h"
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

// cp.async and TMA move 16-byte chunks: every row must start on a 16-byte boundary. Returns the first rule `t`
// breaks, worded to follow the tensor's name in an error message; empty if it breaks none.
std::string row_alignment_violation(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
    return c10::str(" must be 16-byte aligned (its data pointer is not; its storage offset is ", t.storage_offset(),
                    ")");
  }
  for (int dim = 0; dim < 3; ++dim) {
    if (t.size(dim) > 1 && t.stride(dim) % 8 != 0) {
      return c10::str(".stride(", dim, ") must be a multiple of 8 elements (16 bytes), got ", t.stride(dim));
    }
  }
  return {};
}

// CUDA-only rules for the q, k, v the kernels read, shared by fwd and bwd.
void check_cuda_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionShape& s) {
  TORCH_CHECK(q.is_cuda(), op, ": expected CUDA tensors, got q on ", q.device());
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
              ": CUDA supports float16 and bfloat16; cast q, k, v to one of them (got ", q.scalar_type(), ")");
  TORCH_CHECK(s.head_dim % 8 == 0 && s.head_dim <= 256, op,
              ": on CUDA the head dim must be a multiple of 8 and at most 256, got ", s.head_dim);
  for (const auto& [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    const std::string violation = row_alignment_violation(*t);
    TORCH_CHECK(violation.empty(), op, ": ", name, violation);
  }
  // Kernels index rows and blocks with 32-bit ints (offsets into memory are 64-bit); leave headroom for a block.
  constexpr int64_t kMaxLen = std::numeric_limits<int32_t>::max() - 256;
  const int64_t num_blocks = (std::max(s.len_q, s.len_k) + 63) / 64 * s.heads * s.batch;
  TORCH_CHECK(s.len_q <= kMaxLen && s.len_k <= kMaxLen && num_blocks <= std::numeric_limits<int32_t>::max() &&
                  (s.batch * s.heads * s.len_q + 7) / 8 <= std::numeric_limits<int32_t>::max(),
              op, ": Lq and Lk must be below 2^31 - 256, and B * H * ceil(max(Lq, Lk) / 64) below 2^31");
}

// Sizes and softmax scale, the fields FwdParams and BwdParams share.
template <typename Params>
void set_shape_and_scale(Params& p, const AttentionShape& s, double scale) {
  p.batch = static_cast<int>(s.batch);
  p.heads = static_cast<int>(s.heads);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.len_q = static_cast<int>(s.len_q);
  p.len_k = static_cast<int>(s.len_k);
  p.head_dim = static_cast<int>(s.head_dim);
  p.heads_per_kv = static_cast<int>(s.heads / s.heads_kv);
  p.scale = static_cast<float>(scale);
  // The kernels need a normal scale_log2: masked scores are -inf, -inf * 0 is NaN, and --use_fast_math flushes float
  // denormals to 0. A smaller |scale| (0, 1e-40, 1e-300) gives the same uniform softmax as the smallest normal float
  // of its sign: every scaled score rounds to 0.
  const double scale_log2 = scale * M_LOG2E;
  p.scale_log2 = std::abs(scale_log2) < std::numeric_limits<float>::min()
                     ? static_cast<float>(std::copysign(std::numeric_limits<float>::min(), scale_log2))
                     : static_cast<float>(scale_log2);
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
  set_shape_and_scale(p, s, scale);
  p.causal = causal;
  return p;
}

// On Hopper (sm_90) the forward runs the TMA + wgmma kernel, each bucket in the one of head dim 64, 128 or 256 that
// holds it (launch.h: sm90_kernel_head_dim); strides TMA cannot describe fall back to the sm80 kernel.
// FLASHATTN_FWD_SM90 overrides: "0" always uses sm80 (the portable path, for comparison and tests), "strict" raises
// instead of falling back, so a test run proves the Hopper kernel ran. FLASHATTN_BWD_SM90 does the same for the
// Hopper backward (its fallback: the sm80 kernel up to bucket 128, the chunked backward above).
enum class Sm90Mode { kOff, kOn, kStrict };

Sm90Mode parse_sm90_mode(const char* variable, Sm90Mode unset) {
  const char* env = std::getenv(variable);
  if (env == nullptr) return unset;
  if (std::strcmp(env, "1") == 0) return Sm90Mode::kOn;
  if (std::strcmp(env, "0") == 0) return Sm90Mode::kOff;
  TORCH_CHECK(std::strcmp(env, "strict") == 0, variable, " must be 0, 1 or strict, got '", env, "'");
  return Sm90Mode::kStrict;
}

Sm90Mode sm90_fwd_mode() {
  static const Sm90Mode mode = parse_sm90_mode("FLASHATTN_FWD_SM90", Sm90Mode::kOn);
  return mode;
}

Sm90Mode sm90_bwd_mode() {
  static const Sm90Mode mode = parse_sm90_mode("FLASHATTN_BWD_SM90", Sm90Mode::kOn);
  return mode;
}

// FLASHATTN_FWD_SCHEDULE (read per call, for tests and comparisons): "counter" makes the causal Hopper forward take
// its tiles from a counter even where the static zigzag applies; "whole-tiles" keeps the non-causal one from splitting
// its last tiles over keys (stream-K), and "stream-k" has it split them however few key blocks they have (the other
// rules of sm90_stream_k_tiles still apply). Returns the value, or "auto".
std::string fwd_schedule_override() {
  const char* env = std::getenv("FLASHATTN_FWD_SCHEDULE");
  if (env == nullptr || *env == '\0') return "auto";
  const std::string value(env);
  TORCH_CHECK(value == "auto" || value == "counter" || value == "whole-tiles" || value == "stream-k",
              "FLASHATTN_FWD_SCHEDULE must be auto, counter, whole-tiles or stream-k, got '", value, "'");
  return value;
}

// Batch invariance: a sequence's out and lse are the same bits whatever else is in the batch. The one schedule that
// would break it is the D128 Hopper forward's stream-K split of its last round of tiles (sized by the total tile
// count), so by default the forward runs whole tiles. FLASHATTN_BATCH_INVARIANT=0 allows the split (1-2% faster on
// long rows without a mask), except under torch.use_deterministic_algorithms(True), which always implies invariance.
bool batch_invariant_fwd() {
  static const bool opted_out = [] {
    const char* env = std::getenv("FLASHATTN_BATCH_INVARIANT");
    if (env == nullptr || *env == '\0') return false;
    TORCH_CHECK(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0,
                "FLASHATTN_BATCH_INVARIANT must be 0 or 1, got '", env, "'");
    return std::strcmp(env, "0") == 0;
  }();
  return !opted_out || at::globalContext().deterministicAlgorithms();
}

// The causal Hopper forward takes the static zigzag schedule where it is balanced (launch.h): returns its grid, or
// 0 for a tile counter.
int sm90_causal_zigzag_grid_for(const FwdParams& params, int bucket, const at::Tensor& q) {
  if (fwd_schedule_override() == "counter") return 0;
  const int num_sms = at::cuda::getDeviceProperties(q.get_device())->multiProcessorCount;
  const int block_m = sm90_causal_block_m(sm90_kernel_head_dim(bucket), params.len_q, params.len_k);
  const int64_t num_m_blocks = (params.len_q + block_m - 1) / block_m;
  return sm90_causal_zigzag_grid(num_m_blocks, num_m_blocks * params.heads * params.batch, num_sms);
}

bool is_sm90(const at::Tensor& q) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  return props->major == 9 && props->minor == 0;
}

bool sm90_fwd_applies(int bucket, const at::Tensor& q) {
#ifdef FLASHATTN_WITH_SM90
  return sm90_fwd_mode() != Sm90Mode::kOff && sm90_fwd_covers(bucket) && is_sm90(q);
#else
  (void)bucket, (void)q;
  return false;
#endif
}

bool sm90_bwd_applies(int bucket, const at::Tensor& q) {
#ifdef FLASHATTN_WITH_SM90
  return sm90_bwd_mode() != Sm90Mode::kOff && sm90_bwd_covers(bucket) && is_sm90(q);
#else
  (void)bucket, (void)q;
  return false;
#endif
}

// The one place where runtime values become template parameters: kernel x dtype x head-dim bucket x causal.
cudaError_t launch_fwd(const FwdParams& params, at::ScalarType dtype, int bucket, bool use_sm90,
                       cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_half_type(dtype == at::kBFloat16, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_head_dim(bucket, [&](auto head_dim_tag) {
      constexpr int kHeadDim = decltype(head_dim_tag)::value;
      dispatch_bool(params.causal, [&](auto causal_tag) {
        constexpr bool kCausal = decltype(causal_tag)::value;
#ifdef FLASHATTN_WITH_SM90
        if constexpr (sm90_fwd_covers(kHeadDim)) {
          if (use_sm90) {
            err = sm90::run_fwd_sm90<T, sm90_kernel_head_dim(kHeadDim), kCausal>(params, stream);
            if (err != cudaErrorNotSupported || sm90_fwd_mode() == Sm90Mode::kStrict) return;
            // else: strides TMA cannot describe (or no shared memory for it): the sm80 kernel instead
          }
        }
#endif
        err = sm80::run_fwd_sm80<T, kHeadDim, kCausal>(params, stream);
      });
    });
  });
  return err;
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            bool causal, std::optional<double> scale) {
  const AttentionShape s = check_fwd_inputs(q, k, v);
  check_cuda_inputs("flashattn.fwd", q, k, v, s);
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

  FwdParams params = make_fwd_params(q, k, v, out, lse, s, causal, softmax_scale);
  const bool use_sm90 = sm90_fwd_applies(bucket, q);
  // Freed after the launch is enqueued: the caching allocator orders reuse on the stream.
  at::Tensor tile_counter, stream_k_workspace;
  if (use_sm90 && causal) {
    params.zigzag_grid = sm90_causal_zigzag_grid_for(params, bucket, q);
    if (params.zigzag_grid == 0) {
      tile_counter = at::zeros({1}, q.options().dtype(at::kInt));
      params.tile_counter = tile_counter.data_ptr<int>();
    }
  }
  // Without a mask the D128 kernel can split its last tiles over keys where the tiles are long enough (launch.h:
  // sm90_fwd_stream_k, kSm90StreamKMinBlocks; fwd_kernel.h: kStreamKTail): a workspace of 9.2 MB on 132 SMs, its
  // flags zeroed per call. It does so only where batch invariance is given up (batch_invariant_fwd) or the split is
  // forced, never under deterministic algorithms. FLASHATTN_FWD_SCHEDULE is read only where it applies, so no other
  // path rejects it.
  const int kernel_head_dim = sm90_kernel_head_dim(bucket);
  std::string schedule =
      use_sm90 && sm90_fwd_stream_k(kernel_head_dim, causal) ? fwd_schedule_override() : "whole-tiles";
  if ((schedule == "auto" && batch_invariant_fwd()) || at::globalContext().deterministicAlgorithms()) {
    schedule = "whole-tiles";
  }
  if (schedule != "whole-tiles") {
    const int num_sms = at::cuda::getDeviceProperties(q.get_device())->multiProcessorCount;
    const int64_t num_tiles = (s.len_q + kSm90StreamKBlockM - 1) / kSm90StreamKBlockM * s.heads * s.batch;
    const int block_n = sm90_fwd_block_n(kernel_head_dim, causal, s.len_k);
    const int64_t num_n_blocks = (s.len_k + block_n - 1) / block_n;
    params.sk_tiles = static_cast<int>(
        sm90_stream_k_tiles(num_tiles, num_sms, num_n_blocks, schedule == "stream-k" ? 1 : kSm90StreamKMinBlocks));
    if (params.sk_tiles > 0) {
      const int64_t slots = static_cast<int64_t>(num_sms) * kSm90StreamKSlotsPerCta;
      const int64_t flag_bytes = 2 * slots * static_cast<int64_t>(sizeof(int));
      const int64_t partial_bytes =
          slots * sm90_stream_k_partial_floats(kernel_head_dim) * static_cast<int64_t>(sizeof(float));
      stream_k_workspace = at::empty({flag_bytes + partial_bytes}, q.options().dtype(at::kByte));
      params.sk_flags = reinterpret_cast<int*>(stream_k_workspace.data_ptr());
      params.sk_partial = reinterpret_cast<float*>(static_cast<char*>(stream_k_workspace.data_ptr()) + flag_bytes);
      C10_CUDA_CHECK(cudaMemsetAsync(params.sk_flags, 0, flag_bytes, at::cuda::getCurrentCUDAStream()));
    }
  }
  const cudaError_t err = launch_fwd(params, q.scalar_type(), bucket, use_sm90, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flashattn.fwd: CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

// The fused kernel runs wherever it applies; FLASHATTN_CUDA_BWD=chunked forces the chunked backward (a reference
// to compare against, and a fallback).
bool fused_bwd_allowed() {
  static const bool allowed = [] {
    const char* env = std::getenv("FLASHATTN_CUDA_BWD");
    return env == nullptr || std::strcmp(env, "chunked") != 0;
  }();
  return allowed;
}

BwdParams make_bwd_params(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dq_accum,
                          const at::Tensor& dk, const at::Tensor& dv, const AttentionShape& s, double scale) {
  BwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.do_batch_stride = dout.stride(0), p.do_head_stride = dout.stride(1), p.do_row_stride = dout.stride(2);
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  set_shape_and_scale(p, s, scale);
  return p;
}

cudaError_t launch_bwd(const BwdParams& params, bool is_bf16, int bucket, bool causal, bool use_sm90,
                       cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_half_type(is_bf16, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_head_dim(bucket, [&](auto head_dim_tag) {
      constexpr int kHeadDim = decltype(head_dim_tag)::value;
      if constexpr (kHeadDim <= kMaxFusedBwdHeadDim || sm90_bwd_covers(kHeadDim)) {
        dispatch_bool(causal, [&](auto causal_tag) {
          constexpr bool kCausal = decltype(causal_tag)::value;
#ifdef FLASHATTN_WITH_SM90
          if constexpr (sm90_bwd_covers(kHeadDim)) {
            if (use_sm90) {
              err = sm90::run_bwd_sm90<T, sm90_kernel_head_dim(kHeadDim), kCausal>(params, stream);
              if (err != cudaErrorNotSupported || sm90_bwd_mode() == Sm90Mode::kStrict) return;
              // else: strides TMA cannot describe (or no shared memory for it): the sm80 kernel, or (D > 128, where
              // there is none) cudaErrorNotSupported for the caller to take the chunked backward
            }
          }
#endif
          if constexpr (kHeadDim <= kMaxFusedBwdHeadDim) err = sm80::run_bwd_sm80<T, kHeadDim, kCausal>(params, stream);
        });
      }
    });
  });
  return err;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse, bool causal,
                                                        std::optional<double> scale,
                                                        const std::optional<at::Tensor>& dlse, bool deterministic) {
  const AttentionShape s = check_bwd_inputs(dout, q, k, v, out, lse, dlse);
  check_cuda_inputs("flashattn.bwd", q, k, v, s);
  const double softmax_scale = resolve_scale(scale, s.head_dim, "flashattn.bwd");
  const c10::cuda::CUDAGuard device_guard(q.device());

  const int bucket = head_dim_bucket(s.head_dim);
  // The fused kernels accumulate dQ with atomics or TMA reduce-adds (order-dependent): deterministic=True takes the
  // chunked path.
  const bool use_sm90 = sm90_bwd_applies(bucket, q);
  const bool fused = fused_bwd_allowed() && !deterministic && (bucket <= kMaxFusedBwdHeadDim || use_sm90) &&
                     head_dim_bucket_built(bucket) && !s.empty() && s.len_k > 0;
  if (!fused) return bwd_chunked(dout, q, k, v, out, lse, dlse, s, causal, softmax_scale);

  // Gradients can arrive as arbitrary views (e.g. a narrow of a concatenation); the fused kernels need 16-byte rows.
  const auto aligned = [](const at::Tensor& t) {
    return row_alignment_violation(t).empty() ? t : t.clone(at::MemoryFormat::Contiguous);
  };
  const at::Tensor dout_rows = aligned(dout);
  const at::Tensor out_rows = aligned(out);
  const at::Tensor lse_rows = lse.contiguous();
  const std::optional<at::Tensor> dlse_rows =
      dlse.has_value() ? std::optional<at::Tensor>(dlse->contiguous()) : std::nullopt;
  at::Tensor delta = at::empty({s.batch, s.heads, s.len_q}, q.options().dtype(at::kFloat));
  at::Tensor dq_accum = at::zeros({s.batch, s.heads, s.len_q, s.head_dim}, q.options().dtype(at::kFloat));
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;

  BwdDeltaParams delta_params{};
  delta_params.dout = dout_rows.data_ptr();
  delta_params.out = out_rows.data_ptr();
  delta_params.do_batch_stride = dout_rows.stride(0), delta_params.do_head_stride = dout_rows.stride(1);
  delta_params.do_row_stride = dout_rows.stride(2);
  delta_params.o_batch_stride = out_rows.stride(0), delta_params.o_head_stride = out_rows.stride(1);
  delta_params.o_row_stride = out_rows.stride(2);
  delta_params.dlse = dlse_rows.has_value() ? dlse_rows->data_ptr<float>() : nullptr;
  delta_params.delta = delta.data_ptr<float>();
  delta_params.batch = static_cast<int>(s.batch);
  delta_params.heads = static_cast<int>(s.heads);
  delta_params.len_q = static_cast<int>(s.len_q);
  delta_params.head_dim = static_cast<int>(s.head_dim);
  cudaError_t err = sm80::run_bwd_delta(delta_params, is_bf16, stream);
  TORCH_CHECK(err == cudaSuccess, "flashattn.bwd: CUDA kernel launch failed: ", cudaGetErrorString(err));

  const BwdParams params = make_bwd_params(dout_rows, q, k, v, lse_rows, delta, dq_accum, dk, dv, s, softmax_scale);
  err = launch_bwd(params, is_bf16, bucket, causal, use_sm90, stream);
  if (err == cudaErrorNotSupported && bucket > kMaxFusedBwdHeadDim && sm90_bwd_mode() != Sm90Mode::kStrict) {
    return bwd_chunked(dout, q, k, v, out, lse, dlse, s, causal, softmax_scale);  // TMA could not take these strides
  }
  TORCH_CHECK(err == cudaSuccess, "flashattn.bwd: CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {dq_accum.to(q.scalar_type()), dk, dv};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn, CUDA, m) {
  m.impl("fwd", &flashattn::fwd_cuda);
  m.impl("bwd", &flashattn::bwd_cuda);
}
