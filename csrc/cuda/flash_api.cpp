// CUDA backend of torch.ops.flashattn: validate, guard the device, allocate, fill the params, plan, one dispatch.
// ATen types stop here; kernels only see FwdParams / BwdParams.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "api/checks.h"
#include "api/layouts.h"
#include "cuda/bwd_chunked.h"
#include "cuda/fwd_plan.h"
#include "cuda/kernel_table.h"
#include "cuda/launchers.h"
#include "cuda/packed.h"
#include "cuda/sm90/tile_size.h"
#include "cuda/static_switch.h"
#include "cuda/switches.h"
#ifdef FLASHATTN_WITH_SM90
#include "cuda/sm90/tma.h"
#endif

namespace flashattn {
namespace {

// A CUDA tensor for what the kernels write in full (outputs, lse, delta, dq_accum). Unlike at::empty, it is not filled
// (NaN, or the integer maximum) under deterministic algorithms with torch.utils.deterministic.fill_uninitialized_memory
// (the default): a pass over every buffer, 27% of a D128 L1k causal backward's time under determinism.
at::Tensor empty_written(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cuda(sizes, options));
}
// The same for an output in the layout of input `t` (api/layouts.h).
at::Tensor empty_written_like(const at::Tensor& t) {
  return at::Tensor(at::detail::empty_strided_cuda(t.sizes(), output_strides_like(t), t.options()));
}

// Smallest compiled bucket >= head_dim.
int head_dim_bucket(int64_t head_dim) {
  for (int bucket : kHeadDimBuckets) {
    if (head_dim <= bucket) return bucket;
  }
  return 0;
}

// The bucket of head_dim, which this build must hold (a forward needs its kernels).
int built_bucket(int64_t head_dim, const char* op) {
  const int bucket = head_dim_bucket(head_dim);
  TORCH_CHECK(head_dim_bucket_built(bucket), op, ": head dim ", head_dim, " needs bucket ", bucket,
              ", which this build left out (FLASHATTN_HEADDIMS at build time)");
  return bucket;
}

// cp.async and TMA move 16-byte chunks: every row must start on a 16-byte boundary. Returns the first rule `t`
// breaks, worded to follow the tensor's name in an error message; empty if it breaks none.
std::string row_alignment_violation(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
    return c10::str(" must be 16-byte aligned (its data pointer is not; its storage offset is ", t.storage_offset(),
                    ")");
  }
  for (int64_t dim = 0; dim + 1 < t.dim(); ++dim) {
    if (t.size(dim) > 1 && t.stride(dim) % 8 != 0) {
      return c10::str(".stride(", dim, ") must be a multiple of 8 elements (16 bytes), got ", t.stride(dim));
    }
  }
  return {};
}

// `t`, or a contiguous copy where its rows are not 16-byte aligned: gradients can arrive as arbitrary views (e.g. a
// narrow of a concatenation), and the fused backwards need 16-byte rows.
at::Tensor with_aligned_rows(const at::Tensor& t) {
  return row_alignment_violation(t).empty() ? t : t.clone(at::MemoryFormat::Contiguous);
}

// CUDA-only rules for the q, k, v the kernels read, shared by fwd and bwd (k and v named as the op names them).
void check_cuda_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionShape& s, const char* k_name = "k", const char* v_name = "v") {
  TORCH_CHECK(q.is_cuda(), op, ": expected CUDA tensors, got q on ", q.device());
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
              ": CUDA supports float16 and bfloat16; cast q, k, v to one of them (got ", q.scalar_type(), ")");
  TORCH_CHECK(s.head_dim % 8 == 0 && s.head_dim <= 256, op,
              ": on CUDA the head dim must be a multiple of 8 and at most 256, got ", s.head_dim);
  for (const auto& [name, t] : {std::pair{"q", &q}, std::pair{k_name, &k}, std::pair{v_name, &v}}) {
    const std::string violation = row_alignment_violation(*t);
    TORCH_CHECK(violation.empty(), op, ": ", name, violation);
  }
  // Kernels index rows and blocks with 32-bit ints (offsets into memory are 64-bit), band bounds such as
  // i + (Lk - Lq) + right among them; leave headroom for a block.
  constexpr int64_t kMaxLen = std::numeric_limits<int32_t>::max() - 256;
  const int64_t num_blocks = (std::max(s.len_q, s.len_k) + 63) / 64 * s.heads * s.batch;
  TORCH_CHECK(s.len_q + s.len_k <= kMaxLen && num_blocks <= std::numeric_limits<int32_t>::max() &&
                  (s.batch * s.heads * s.len_q + 7) / 8 <= std::numeric_limits<int32_t>::max(),
              op, ": Lq + Lk must be below 2^31 - 256, and B * H * ceil(max(Lq, Lk) / 64) below 2^31");
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

// The score modifications as the kernels take them (params.h), after the scale (set_shape_and_scale); `sinks` must
// outlive the launch. The kernels form scale / softcap by fast-math division (0 for divisors past 2^126) and flush
// denormal products: a cap above kMaxBindingCap, or one whose scale / softcap is below float32's normal range, is off.
// Such a cap changes no score below ~softcap * 2^-12 (tanh(x) = x to float32 there): it could bind only on scores far
// past any real one, and the raw scores are what it gives.
inline constexpr double kMaxBindingCap = 1e30;
template <typename Params>
void set_score_mods(Params& p, const ScoreMods& mods) {
  p.window_left = static_cast<int>(std::min<int64_t>(mods.left, std::numeric_limits<int>::max()));
  p.window_right = static_cast<int>(std::min<int64_t>(mods.right, std::numeric_limits<int>::max()));
  const bool cap_binds = mods.softcap > 0.0 && mods.softcap <= kMaxBindingCap &&
                         std::abs(p.scale) / mods.softcap >= std::numeric_limits<float>::min();
  p.softcap = cap_binds ? static_cast<float>(mods.softcap) : 0.f;
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

// A Hopper GPU with the Hopper kernels built for it.
bool sm90_device(const at::Tensor& q) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  const bool hopper = props->major == 9 && props->minor == 0;
#ifdef FLASHATTN_WITH_SM90
  return hopper;
#else
  // Strict mode promises the Hopper kernels ran: without them in the build it cannot hold on a Hopper GPU.
  const Switches& sw = switches();
  TORCH_CHECK(!hopper || (sw.fwd_sm90 != Sm90Use::kStrict && sw.bwd_sm90 != Sm90Use::kStrict),
              "flashattn: FLASHATTN_FWD_SM90 or FLASHATTN_BWD_SM90 is strict on a Hopper GPU, but this build has no "
              "Hopper kernels (FLASHATTN_CUDA_ARCHS must name 90a)");
  return false;
#endif
}

// What q's GPU offers a forward (whether TMA can map the inputs is the caller's to ask: tma_maps_inputs).
FwdDevice fwd_device(const at::Tensor& q) {
  FwdDevice device{};
  device.sm90 = sm90_device(q);
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  device.num_sms = props->multiProcessorCount;
  device.smem_per_block = static_cast<int>(props->sharedMemPerBlockOptin);
  return device;
}

// Whether TMA can describe the inputs of `p` as they are (the driver encodes their maps; sm90/tma.h): q, k, v, and for
// the backward dout too.
// The driver encodes the maps in the thread's current context. A thread's first CUDA work may be this call (autograd
// runs the backward on a thread of its own) with no context current yet, where the driver refuses every map:
// cudaSetDevice makes the device's primary context current first.
template <typename Params>
bool tma_maps_inputs(const Params& p, bool is_bf16, c10::DeviceIndex device) {
#ifdef FLASHATTN_WITH_SM90
  C10_CUDA_CHECK(cudaSetDevice(device));
  if constexpr (std::is_same_v<Params, BwdParams>) {
    return sm90::tma_can_map_bwd(p, is_bf16);
  } else {
    return sm90::tma_can_map(p, is_bf16);
  }
#else
  (void)p, (void)is_bf16, (void)device;
  return false;
#endif
}

// The one place where runtime values become template parameters: dtype x head-dim bucket x causal (or the options
// variant), then the kernel the plan chose (the Hopper one in the smallest of its head dims that holds the bucket).
cudaError_t launch_fwd(const FwdParams& params, bool is_bf16, int bucket, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_half_type(is_bf16, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_head_dim(bucket, [&](auto head_dim_tag) {
      constexpr int kBucket = decltype(head_dim_tag)::value;
      dispatch_bool(params.causal, [&](auto causal_tag) {
        constexpr bool kCausal = decltype(causal_tag)::value;
        dispatch_bool(params.options, [&](auto options_tag) {
          constexpr bool kOptions = decltype(options_tag)::value;
          if (params.plan.kernel == FwdKernel::kDecode) {
            constexpr int kDecodeHeadDim = decode_head_dim(kBucket);
            err = params.block_table != nullptr ? sm80::run_decode<T, kDecodeHeadDim, true>(params, stream)
                                                : sm80::run_decode<T, kDecodeHeadDim, false>(params, stream);
            return;
          }
#ifdef FLASHATTN_WITH_SM90
          if constexpr (sm90_fwd_covers(kBucket)) {
            if (params.plan.kernel == FwdKernel::kSm90) {
              constexpr int kHopperHeadDim = sm90_kernel_head_dim(kBucket);
              if (params.plan.schedule == FwdSchedule::kSequences) {
                if constexpr (kOptions) {
                  err = sm90::run_fwd_sm90<T, kHopperHeadDim, kCausal, true, true>(params, stream);
                }
                return;
              }
              err = sm90::run_fwd_sm90<T, kHopperHeadDim, kCausal, kOptions, false>(params, stream);
              return;
            }
          }
#endif
          // The portable options variant carries the whole band in its window (kCausal false); its sequences variant
          // also packed sequences and KV caches.
          const bool sequences = params.cu_seqlens_q != nullptr || params.seqlens_k != nullptr ||
                                 params.leftpad_k != nullptr || params.block_table != nullptr;
          if constexpr (kOptions) {
            if (sequences) {
              err = sm80::run_fwd_sm80<T, kBucket, false, true, true>(params, stream);
              return;
            }
          }
          err = sm80::run_fwd_sm80<T, kBucket, kCausal && !kOptions, kOptions, false>(params, stream);
        });
      });
    });
  });
  return err;
}

// Raises where the portable forward's plan found no K/V pipeline that fits the device's shared memory (one tile fits
// 99 KB at D256: a GPU of sm_80 or later always takes one).
void check_fits(const FwdPlan& plan, const FwdDevice& device, const char* op) {
  TORCH_CHECK(plan.kernel != FwdKernel::kSm80 || plan.kv_tiles > 0, op, ": head dim bucket ", plan.head_dim, " needs ",
              sm80::fwd_smem_bytes(plan.head_dim, 1), " bytes of shared memory per block; this GPU allows ",
              device.smem_per_block);
}

// The plan's workspace (for the caching allocator, which orders its reuse on the stream: the caller keeps it until
// the launch is enqueued), its leading part zeroed on the stream, its parts given to the params.
at::Tensor attach_workspace(FwdParams& params, const at::Tensor& q, cudaStream_t stream) {
  const FwdPlan& plan = params.plan;
  if (plan.workspace_bytes == 0) return at::Tensor();
  at::Tensor workspace = at::empty({plan.workspace_bytes}, q.options().dtype(at::kByte));
  char* base = static_cast<char*>(workspace.data_ptr());
  if (plan.zeroed_bytes > 0) C10_CUDA_CHECK(cudaMemsetAsync(base, 0, plan.zeroed_bytes, stream));
  if (plan.kernel == FwdKernel::kDecode) {
    params.split_out = reinterpret_cast<float*>(base);
    params.split_lse = params.split_out + decode_split_lse_offset(params, plan.splits, plan.head_dim);
  } else if (plan.schedule == FwdSchedule::kCounter) {
    params.tile_counter = reinterpret_cast<int*>(base);
  } else if (plan.schedule == FwdSchedule::kSequences) {
    const sm90::SequencesWorkspace parts = sm90::sequences_workspace(params.batch);
    params.tile_counter = reinterpret_cast<int*>(base);
    params.seq_order = reinterpret_cast<int*>(base + parts.order);
    params.seq_tile_start = reinterpret_cast<int*>(base + parts.tile_start);
    params.seq_maps = base + parts.maps;
    if (plan.splits > 1) {  // the parts and their lse, or the fold states of splits run in turn
      params.split_out = reinterpret_cast<float*>(base + sequences_split_offset(params.batch));
      if (!plan.splits_in_turn) {
        params.split_lse = params.split_out + decode_split_lse_offset(params, plan.splits, plan.head_dim);
      }
    }
  } else {
    params.sk_flags = reinterpret_cast<int*>(base);
    params.sk_partial = reinterpret_cast<float*>(base + plan.zeroed_bytes);
  }
  return workspace;
}

// A call where no row sees a key: out = 0, lse = -inf or the row's sink (lse's heads along lse_head_dim).
void store_keyless(at::Tensor& out, at::Tensor& lse, const ScoreMods& mods, int64_t lse_head_dim) {
  out.zero_();
  if (mods.sinks.has_value()) {
    std::vector<int64_t> shape(lse.dim(), 1);
    shape[lse_head_dim] = lse.size(lse_head_dim);
    lse.copy_(mods.sinks->view(shape).expand_as(lse));
  } else {
    lse.fill_(-std::numeric_limits<float>::infinity());
  }
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            bool causal, std::optional<double> scale, at::IntArrayRef window_size,
                                            double softcap, const std::optional<at::Tensor>& sinks) {
  const AttentionShape s = check_fwd_inputs(q, k, v);
  check_cuda_inputs("flashattn.fwd", q, k, v, s);
  const double softmax_scale = resolve_scale(scale, s.head_dim);
  const ScoreMods mods = check_score_mods(q, s, causal, window_size, softcap, sinks);
  const int bucket = built_bucket(s.head_dim, "flashattn.fwd");
  const Switches& sw = switches();

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = empty_written_like(q);
  at::Tensor lse = empty_written({s.batch, s.heads, s.len_q}, q.options().dtype(at::kFloat));
  if (s.empty()) return {out, lse};
  if (s.len_k == 0) {
    store_keyless(out, lse, mods, /*lse_head_dim=*/1);
    return {out, lse};
  }

  // Windows, softcap and sinks run in the kernels' options variants, whose causal means a band with a right edge.
  FwdParams params = make_fwd_params(q, k, v, out, lse, s, mods.plain() ? mods.causal() : mods.right >= 0,
                                     softmax_scale);
  set_score_mods(params, mods);
  params.options = !mods.plain();
  const at::Tensor sinks_rows = mods.sinks.has_value() ? mods.sinks->contiguous() : at::Tensor();
  params.sinks = sinks_rows.defined() ? sinks_rows.data_ptr<float>() : nullptr;
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  FwdDevice device = fwd_device(q);
  const bool wants_sm90 = fwd_wants_sm90(bucket, device, sw);
  // The decode path needs no maps.
  device.tma_maps_q_kv =
      wants_sm90 && !decode_applies(params, bucket, device, sw) && tma_maps_inputs(params, is_bf16, q.get_device());
  params.plan = plan_fwd(params, bucket, device, sw, at::globalContext().deterministicAlgorithms());
  TORCH_CHECK(sw.fwd_sm90 != Sm90Use::kStrict || !wants_sm90 || params.plan.kernel != FwdKernel::kSm80,
              "flashattn.fwd: FLASHATTN_FWD_SM90=strict, but the Hopper kernel cannot take these inputs (TMA cannot "
              "describe the strides of q, k or v)");
  check_fits(params.plan, device, "flashattn.fwd");

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor workspace = attach_workspace(params, q, stream);
  const cudaError_t err = launch_fwd(params, is_bf16, bucket, stream);
  TORCH_CHECK(err == cudaSuccess, "flashattn.fwd: CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

// The inputs of a backward call: q, k, v, dout as the kernels read them, and the sizes.
BwdParams make_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionShape& s, double scale) {
  BwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.do_batch_stride = dout.stride(0), p.do_head_stride = dout.stride(1), p.do_row_stride = dout.stride(2);
  set_shape_and_scale(p, s, scale);
  return p;
}

// dK and dV, (B, Hk, Lk, D) views with 16-byte rows, for the kernels to write.
void set_key_grads(BwdParams& p, const at::Tensor& dk, const at::Tensor& dv) {
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dk_batch_stride = dk.stride(0), p.dk_head_stride = dk.stride(1), p.dk_row_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_head_stride = dv.stride(1), p.dv_row_stride = dv.stride(2);
}

// The persistent Hopper backward's tile counter (zeroed by the preprocess pass, or undefined) and grid bound: the SM
// count, or FLASHATTN_BWD_CTAS.
void set_bwd_schedule(BwdParams& params, const at::Tensor& tile_counter) {
  params.tile_counter = tile_counter.defined() ? tile_counter.data_ptr<int>() : nullptr;
  const int ctas = switches().bwd_ctas;
  params.max_ctas = ctas > 0 ? ctas : at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Which backward runs a call, decided once: the fused Hopper kernel where it can take the inputs, else the fused sm80
// kernel up to its largest bucket (its options variant for windows and softcap), else the chunked backward (cuBLAS,
// float32).
enum class BwdPath { kSm90, kSm80, kChunked };

// `sequences`: packed sequences, in the sequences variants (which take the band too; sm80: the ordered dQ too).
cudaError_t launch_bwd(const BwdParams& params, bool is_bf16, int bucket, bool causal, bool options, bool sequences,
                       BwdPath path, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_half_type(is_bf16, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_head_dim(bucket, [&](auto head_dim_tag) {
      constexpr int kBucket = decltype(head_dim_tag)::value;
      dispatch_bool(causal, [&](auto causal_tag) {
        constexpr bool kCausal = decltype(causal_tag)::value;
        dispatch_bool(options, [&](auto options_tag) {
          constexpr bool kOptions = decltype(options_tag)::value;
#ifdef FLASHATTN_WITH_SM90
          if constexpr (sm90_bwd_covers(kBucket)) {
            constexpr int kHopperHeadDim = sm90_kernel_head_dim(kBucket);
            if (path == BwdPath::kSm90 && sequences) {  // in the options variants
              if constexpr (kOptions) err = sm90::run_bwd_sm90<T, kHopperHeadDim, kCausal, true, true>(params, stream);
            } else if (path == BwdPath::kSm90) {
              err = sm90::run_bwd_sm90<T, sm90_kernel_head_dim(kBucket), kCausal, kOptions, false>(params, stream);
            }
          }
#endif
          // The portable options variant carries the whole band in its window (kCausal false).
          if constexpr (kBucket <= kMaxFusedBwdSm80Bucket) {
            if (path == BwdPath::kSm80 && sequences) {
              err = sm80::run_bwd_sm80<T, kBucket, false, true, true>(params, stream);
            } else if (path == BwdPath::kSm80) {
              err = sm80::run_bwd_sm80<T, kBucket, kCausal && !kOptions, kOptions, false>(params, stream);
            }
          }
        });
      });
    });
  });
  return err;
}

// d sink_h = -sum over the rows of head h of exp(sink_h - lse_i) delta_i, delta = rowsum(dO * O) - dlse (the fused
// backward's, else computed here), in float32 and a fixed reduction order (deterministic); rows with lse = -inf
// contribute nothing.
at::Tensor sink_grads(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                      const std::optional<at::Tensor>& dlse, const at::Tensor& sinks, at::Tensor delta) {
  if (!delta.defined()) {
    delta = at::linalg_vecdot(dout.to(at::kFloat), out.to(at::kFloat));
    if (dlse.has_value()) delta = delta - *dlse;
  }
  // A row without keys and with a sink of -inf (lse = -inf) adds nothing, whatever its dlse (an inf would give NaN).
  const at::Tensor terms = ((sinks.view({1, -1, 1}) - lse).exp_() * delta).masked_fill_(lse.isneginf(), 0.0);
  return terms.sum(at::IntArrayRef{0, 2}).neg_();
}

// delta = rowsum(dO * O) - dlse and dq_accum zeroed, in one pass: dout and out as (B, H, L, D) views (rows 16-byte
// aligned), dlse and delta (B, H, L) and dq_accum (B, H, L, D) contiguous; tile_counter (one int32, or undefined)
// zeroed as well.
void launch_bwd_preprocess(const at::Tensor& dout, const at::Tensor& out, const std::optional<at::Tensor>& dlse,
                           const at::Tensor& delta, const at::Tensor& dq_accum, const at::Tensor& tile_counter,
                           const char* op) {
  BwdPreprocessParams p{};
  p.dout = dout.data_ptr(), p.out = out.data_ptr();
  p.do_batch_stride = dout.stride(0), p.do_head_stride = dout.stride(1), p.do_row_stride = dout.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.dlse = dlse.has_value() ? dlse->data_ptr<float>() : nullptr;
  p.delta = delta.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.tile_counter = tile_counter.defined() ? tile_counter.data_ptr<int>() : nullptr;
  p.batch = static_cast<int>(dout.size(0)), p.heads = static_cast<int>(dout.size(1));
  p.len_q = static_cast<int>(dout.size(2)), p.head_dim = static_cast<int>(dout.size(3));
  const cudaError_t err =
      run_bwd_preprocess(p, dout.scalar_type() == at::kBFloat16, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// dq = scale * dq_accum in dq's type: dq as a (B, H, L, D) view (rows 16-byte aligned), dq_accum (B, H, L, D)
// contiguous.
void launch_bwd_postprocess(const at::Tensor& dq_accum, const at::Tensor& dq, double scale, const char* op) {
  BwdPostprocessParams p{};
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dq_batch_stride = dq.stride(0), p.dq_head_stride = dq.stride(1), p.dq_row_stride = dq.stride(2);
  p.scale = static_cast<float>(scale);
  p.batch = static_cast<int>(dq.size(0)), p.heads = static_cast<int>(dq.size(1));
  p.len_q = static_cast<int>(dq.size(2)), p.head_dim = static_cast<int>(dq.size(3));
  const cudaError_t err =
      run_bwd_postprocess(p, dq.scalar_type() == at::kBFloat16, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// dQ, dK, dV: by a fused kernel where one takes the call, else by the chunked backward. `delta` receives the fused
// path's rowsum(dO * O) - dlse (left undefined by the chunked one).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_fused_or_chunked(const at::Tensor& dout, const at::Tensor& q,
                                                                    const at::Tensor& k, const at::Tensor& v,
                                                                    const at::Tensor& out, const at::Tensor& lse,
                                                                    const AttentionShape& s, const ScoreMods& mods,
                                                                    double softmax_scale,
                                                                    const std::optional<at::Tensor>& dlse,
                                                                    bool deterministic, at::Tensor& delta) {
  const Switches& sw = switches();
  const int bucket = head_dim_bucket(s.head_dim);
  if (sw.chunked_bwd || !head_dim_bucket_built(bucket) || s.empty() || s.len_k == 0) {
    return bwd_chunked(dout, q, k, v, out, lse, dlse, s, mods, softmax_scale);
  }
  // Windows and softcap run in the kernels' options variants, whose causal means a band with a right edge; sinks only
  // change lse, which every kernel takes.
  const bool options = mods.window() || mods.softcap > 0.0;
  const bool causal = options ? mods.right >= 0 : mods.causal();
  const bool wants_sm90 = sm90_device(q) && sw.bwd_sm90 != Sm90Use::kOff && sm90_bwd_covers(bucket);
  // The fused kernels add dQ up in a fixed order under deterministic=True (dQ semaphores): the Hopper kernels, and the
  // sm80 kernel's sequences variant (any band) up to its largest bucket.
  const bool fused_sm80 = bucket <= kMaxFusedBwdSm80Bucket;
  if (!wants_sm90 && !fused_sm80) return bwd_chunked(dout, q, k, v, out, lse, dlse, s, mods, softmax_scale);
  const at::Tensor dout_rows = with_aligned_rows(dout);
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  BwdParams params = make_bwd_inputs(dout_rows, q, k, v, s, softmax_scale);
  set_score_mods(params, mods);
  const bool sm90_maps = wants_sm90 && tma_maps_inputs(params, is_bf16, q.get_device());
  TORCH_CHECK(sw.bwd_sm90 != Sm90Use::kStrict || !wants_sm90 || sm90_maps,
              "flashattn.bwd: FLASHATTN_BWD_SM90=strict, but the Hopper kernel cannot take these inputs (TMA cannot "
              "describe the strides of q, k, v or dout)");
  const BwdPath path = sm90_maps ? BwdPath::kSm90 : fused_sm80 ? BwdPath::kSm80 : BwdPath::kChunked;
  if (path == BwdPath::kChunked) return bwd_chunked(dout, q, k, v, out, lse, dlse, s, mods, softmax_scale);
  // Deterministic on the sm80 kernel: its sequences variant (the band carries causal) with ordered dQ.
  const bool sm80_ordered_dq = path == BwdPath::kSm80 && deterministic;

  const at::Tensor out_rows = with_aligned_rows(out);
  const at::Tensor lse_rows = lse.contiguous();
  const std::optional<at::Tensor> dlse_rows =
      dlse.has_value() ? std::optional<at::Tensor>(dlse->contiguous()) : std::nullopt;
  delta = empty_written({s.batch, s.heads, s.len_q}, q.options().dtype(at::kFloat));
  at::Tensor dq_accum = empty_written({s.batch, s.heads, s.len_q, s.head_dim}, q.options().dtype(at::kFloat));
  // Deterministic: a count of the key blocks added so far per query block (Hopper: one per dQ writer; sm80: one).
  at::Tensor dq_semaphore;
  if (deterministic) {
    const bool sm90 = path == BwdPath::kSm90;
    const sm90::BwdTileShape tile = sm90::bwd_tile_shape(sm90_kernel_head_dim(bucket), causal || options);
    const int64_t block_m = sm90 ? tile.block_m : sm80::kBwdBlockM;
    dq_semaphore = at::zeros({s.batch, s.heads, (s.len_q + block_m - 1) / block_m, sm90 ? sm90::kBwdDqSemaphores : 1},
                             q.options().dtype(at::kInt));
  }
  at::Tensor dk = empty_written_like(k);
  at::Tensor dv = empty_written_like(v);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const at::Tensor tile_counter = path == BwdPath::kSm90 ? at::empty({1}, q.options().dtype(at::kInt)) : at::Tensor();
  launch_bwd_preprocess(dout_rows, out_rows, dlse_rows, delta, dq_accum, tile_counter, "flashattn.bwd");

  params.lse = lse_rows.data_ptr<float>();
  params.delta = delta.data_ptr<float>();
  params.dq_accum = dq_accum.data_ptr<float>();
  params.dq_semaphore = deterministic ? dq_semaphore.data_ptr<int>() : nullptr;
  set_bwd_schedule(params, tile_counter);
  if (deterministic && path == BwdPath::kSm90) {
    params.ordered_interleave = sm90::bwd_ordered_interleave(
        sm90_kernel_head_dim(bucket), causal, s.len_q, params.heads_per_kv,
        at::cuda::getCurrentDeviceProperties()->l2CacheSize);
  }
  set_key_grads(params, dk, dv);
  const cudaError_t err = launch_bwd(params, is_bf16, bucket, sm80_ordered_dq ? mods.right >= 0 : causal,
                                     options || sm80_ordered_dq, sm80_ordered_dq, path, stream);
  TORCH_CHECK(err == cudaSuccess, "flashattn.bwd: CUDA kernel launch failed: ", cudaGetErrorString(err));
  at::Tensor dq = empty_written_like(q);
  launch_bwd_postprocess(dq_accum, dq, softmax_scale, "flashattn.bwd");
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, std::optional<double> scale, const std::optional<at::Tensor>& dlse,
    bool deterministic, at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& sinks) {
  const AttentionShape s = check_bwd_inputs(dout, q, k, v, out, lse, dlse);
  check_cuda_inputs("flashattn.bwd", q, k, v, s);
  const double softmax_scale = resolve_scale(scale, s.head_dim, "flashattn.bwd");
  const ScoreMods mods = check_score_mods(q, s, causal, window_size, softcap, sinks, "flashattn.bwd");
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor delta;
  auto [dq, dk, dv] =
      bwd_fused_or_chunked(dout, q, k, v, out, lse, s, mods, softmax_scale, dlse, deterministic, delta);
  at::Tensor dsinks = mods.sinks.has_value() ? sink_grads(dout, out, lse, dlse, *mods.sinks, delta)
                                             : at::empty({0}, q.options().dtype(at::kFloat));
  return {dq, dk, dv, dsinks};
}

// ==== Packed sequences =============================================================================================
//
// One launch of the sm80 sequences variants over every sequence (the other kernels stay free of it): the kernels find
// each CTA's sequence in cu_seqlens on the device (packed.h), so nothing is read back to the host and a captured graph
// replays with new lengths. Causal is the band's right edge there.

// CUDA-only rules of a packed call: those of the dense op for the tensors, and 32-bit slot counts.
void check_cuda_varlen_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const VarlenShape& vs) {
  check_cuda_inputs(op, q, k, v, AttentionShape{1, vs.heads, vs.heads_kv, vs.total_q, vs.total_k, vs.head_dim});
  const int64_t slots = (std::max(vs.total_q, vs.total_k) / 64 + vs.batch) * vs.heads;
  TORCH_CHECK(slots <= std::numeric_limits<int32_t>::max(), op,
              ": (max(total_q, total_k) / 64 + B) * H must be below 2^31");
}

// (total, H, D) rows of a packed tensor as the kernels' strides: no batch stride, rows at stride(0).
struct PackedStrides {
  int64_t batch = 0, head, row;
};
PackedStrides packed_strides(const at::Tensor& t) { return {0, t.stride(1), t.stride(0)}; }

// The packed call's sizes and offsets; p.batch is the number of sequences, len_q and len_k the totals.
template <typename Params>
void set_packed_shape(Params& p, const VarlenShape& vs, double scale, const at::Tensor& cu_q, const at::Tensor& cu_k) {
  set_shape_and_scale(p, AttentionShape{vs.batch, vs.heads, vs.heads_kv, vs.total_q, vs.total_k, vs.head_dim}, scale);
  p.cu_seqlens_q = cu_q.data_ptr<int>();
  p.cu_seqlens_k = cu_k.data_ptr<int>();
}

std::tuple<at::Tensor, at::Tensor> fwd_varlen_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                   std::optional<int64_t> /*max_seqlen_q*/,
                                                   std::optional<int64_t> /*max_seqlen_k*/, bool causal,
                                                   std::optional<double> scale, at::IntArrayRef window_size,
                                                   double softcap, const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "flashattn.fwd_varlen";
  const VarlenShape vs = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, op);
  check_cuda_varlen_inputs(op, q, k, v, vs);
  const double softmax_scale = resolve_scale(scale, vs.head_dim, op);
  // Bounds are checked against the totals: one that covers every packed key covers every sequence's.
  const AttentionShape totals{1, vs.heads, vs.heads_kv, vs.total_q, vs.total_k, vs.head_dim};
  const ScoreMods mods = check_score_mods(q, totals, causal, window_size, softcap, sinks, op);
  const int bucket = built_bucket(vs.head_dim, op);

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = empty_written({vs.total_q, vs.heads, vs.head_dim}, q.options());
  at::Tensor lse = empty_written({vs.heads, vs.total_q}, q.options().dtype(at::kFloat));
  if (vs.total_q == 0 || vs.heads == 0 || vs.batch == 0) return {out, lse};
  if (vs.total_k == 0) {  // no sequence has keys
    store_keyless(out, lse, mods, /*lse_head_dim=*/0);
    return {out, lse};
  }
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();

  FwdParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  const PackedStrides sq = packed_strides(q), sk = packed_strides(k), sv = packed_strides(v), so = packed_strides(out);
  p.q_batch_stride = sq.batch, p.q_head_stride = sq.head, p.q_row_stride = sq.row;
  p.k_batch_stride = sk.batch, p.k_head_stride = sk.head, p.k_row_stride = sk.row;
  p.v_batch_stride = sv.batch, p.v_head_stride = sv.head, p.v_row_stride = sv.row;
  p.o_batch_stride = so.batch, p.o_head_stride = so.head, p.o_row_stride = so.row;
  set_packed_shape(p, vs, softmax_scale, cu_q, cu_k);
  p.causal = mods.right >= 0;
  set_score_mods(p, mods);
  p.options = true;
  const at::Tensor sinks_rows = mods.sinks.has_value() ? mods.sinks->contiguous() : at::Tensor();
  p.sinks = sinks_rows.defined() ? sinks_rows.data_ptr<float>() : nullptr;
  // The Hopper sequences kernel where TMA can describe the packed tensors (as one batch entry of all rows), else the
  // portable one.
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  const Switches& sw = switches();
  const FwdDevice device = fwd_device(q);
  const bool wants_sm90 = fwd_wants_sm90(bucket, device, sw);
  FwdParams all_rows = p;
  all_rows.batch = 1;
  if (wants_sm90 && tma_maps_inputs(all_rows, is_bf16, q.get_device())) {
    p.plan = plan_fwd_sequences(p, bucket, device);
  } else {
    TORCH_CHECK(sw.fwd_sm90 != Sm90Use::kStrict || !wants_sm90, op, ": FLASHATTN_FWD_SM90=strict, but the Hopper "
                "kernel cannot take these inputs (TMA cannot describe the strides of q, k or v)");
    p.plan = plan_fwd_sm80(bucket, device, sw);
  }
  check_fits(p.plan, device, op);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor workspace = attach_workspace(p, q, stream);
  const cudaError_t err = launch_fwd(p, is_bf16, bucket, stream);
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_varlen_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    std::optional<int64_t> /*max_seqlen_q*/, std::optional<int64_t> /*max_seqlen_k*/, bool causal,
    std::optional<double> scale, const std::optional<at::Tensor>& dlse, bool deterministic,
    at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "flashattn.bwd_varlen";
  const VarlenShape vs = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, op);
  check_varlen_bwd_inputs(dout, q, out, lse, dlse, vs, op);
  check_cuda_varlen_inputs(op, q, k, v, vs);
  const double softmax_scale = resolve_scale(scale, vs.head_dim, op);
  const AttentionShape totals{1, vs.heads, vs.heads_kv, vs.total_q, vs.total_k, vs.head_dim};
  const ScoreMods mods = check_score_mods(q, totals, causal, window_size, softcap, sinks, op);
  const int bucket = built_bucket(vs.head_dim, op);
  // Above the portable kernel's buckets only the Hopper kernel takes packed sequences. Both have an ordered dQ
  // (deterministic).
  const Switches& sw = switches();
  const bool large = bucket > kMaxFusedBwdSm80Bucket;
  const bool wants_sm90 = sm90_device(q) && sw.bwd_sm90 != Sm90Use::kOff && sm90_bwd_covers(bucket);
  TORCH_CHECK(!large || wants_sm90, op, ": on CUDA the packed backward takes head dims above ",
              kMaxFusedBwdSm80Bucket, " only on Hopper (FLASHATTN_BWD_SM90 not 0); got head dim ", vs.head_dim);

  const c10::cuda::CUDAGuard device_guard(q.device());
  // Zeroed: keys of a sequence without queries get 0 (and rows past cu_seqlens' last value stay 0).
  const auto zero_key_grads = [&] { return at::zeros({vs.total_k, vs.heads_kv, vs.head_dim}, k.options()); };
  at::Tensor dsinks = at::zeros({mods.sinks.has_value() ? vs.heads : 0}, q.options().dtype(at::kFloat));
  if (vs.total_q == 0 || vs.total_k == 0 || vs.heads == 0 || vs.batch == 0) {
    // No keys anywhere: out is 0 and every row's lse its sink, so only the sinks get a gradient (through dlse). The
    // (total, H) rows seen as one dense (1, H, total) batch.
    if (mods.sinks.has_value() && vs.total_q > 0 && vs.heads > 0) {
      const auto dense = [](const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };
      const std::optional<at::Tensor> dlse_dense =
          dlse.has_value() ? std::optional<at::Tensor>(dlse->unsqueeze(0)) : std::nullopt;
      dsinks = sink_grads(dense(dout), dense(out), lse.unsqueeze(0), dlse_dense, *mods.sinks, at::Tensor());
    }
    return {at::zeros({vs.total_q, vs.heads, vs.head_dim}, q.options()), zero_key_grads(), zero_key_grads(), dsinks};
  }
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();

  const at::Tensor dout_rows = with_aligned_rows(dout), out_rows = with_aligned_rows(out);
  const at::Tensor lse_rows = lse.contiguous();
  const std::optional<at::Tensor> dlse_rows =
      dlse.has_value() ? std::optional<at::Tensor>(dlse->contiguous()) : std::nullopt;
  at::Tensor delta = empty_written({vs.heads, vs.total_q}, q.options().dtype(at::kFloat));
  at::Tensor dq_accum = empty_written({vs.heads, vs.total_q, vs.head_dim}, q.options().dtype(at::kFloat));
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // The (H, total_q) rows as one batch of total_q rows.
  const auto as_one_batch = [](const at::Tensor& rows) { return rows.permute({1, 0, 2}).unsqueeze(0); };
  const at::Tensor tile_counter = wants_sm90 ? at::empty({1}, q.options().dtype(at::kInt)) : at::Tensor();

  BwdParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.dout = dout_rows.data_ptr();
  const PackedStrides sq = packed_strides(q), sk = packed_strides(k), sv = packed_strides(v);
  const PackedStrides sd = packed_strides(dout_rows);
  p.q_batch_stride = sq.batch, p.q_head_stride = sq.head, p.q_row_stride = sq.row;
  p.k_batch_stride = sk.batch, p.k_head_stride = sk.head, p.k_row_stride = sk.row;
  p.v_batch_stride = sv.batch, p.v_head_stride = sv.head, p.v_row_stride = sv.row;
  p.do_batch_stride = sd.batch, p.do_head_stride = sd.head, p.do_row_stride = sd.row;
  set_packed_shape(p, vs, softmax_scale, cu_q, cu_k);
  set_score_mods(p, mods);
  p.lse = lse_rows.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  set_bwd_schedule(p, tile_counter);
  // The Hopper sequences kernel where TMA can describe the packed tensors as one batch entry of all rows, with room
  // for each sequence's maps; else the portable one. Decided before the key gradients' zero fill and the preprocess.
  BwdParams all_rows = p;
  all_rows.batch = 1;
  const bool sm90 = wants_sm90 && tma_maps_inputs(all_rows, is_bf16, q.get_device());
  TORCH_CHECK((sw.bwd_sm90 != Sm90Use::kStrict && !large) || !wants_sm90 || sm90, op, ": the Hopper kernel cannot "
              "take these inputs (TMA cannot describe the strides of q, k, v or dout), and FLASHATTN_BWD_SM90=strict "
              "or the head dim (above ", kMaxFusedBwdSm80Bucket, ") leaves no other");
  const at::Tensor dk = zero_key_grads(), dv = zero_key_grads();
  set_key_grads(p, as_one_batch(dk), as_one_batch(dv));
  launch_bwd_preprocess(as_one_batch(dout_rows), as_one_batch(out_rows), dlse_rows, delta, dq_accum, tile_counter, op);
  // Deterministic: dQ added in key-block order, semaphores per query block of each head (packed.h's slots; Hopper:
  // one per dQ writer), then a flag the kernels read: cu_seqlens that break their rules (computed on the device,
  // no synchronisation).
  at::Tensor dq_semaphore;
  if (deterministic) {
    const sm90::BwdTileShape hopper = sm90::bwd_tile_shape(sm90_kernel_head_dim(bucket), /*masked=*/true);
    const int block_m = sm90 ? hopper.block_m : sm80::kBwdBlockM;
    const int64_t per_block = sm90 ? sm90::kBwdDqSemaphores : 1;
    const int64_t num_semaphores = vs.heads * packed_slots(vs.total_q, vs.batch, block_m) * per_block;
    dq_semaphore = at::zeros({num_semaphores + 1}, q.options().dtype(at::kInt));
    const auto broken = [](const at::Tensor& cu, int64_t total) {
      return cu.select(0, 0).ne(0).logical_or(cu.select(0, -1).ne(total)).logical_or(at::diff(cu).lt(0).any());
    };
    dq_semaphore.narrow(0, num_semaphores, 1)
        .copy_(broken(cu_q, vs.total_q).logical_or(broken(cu_k, vs.total_k)).to(at::kInt).view({1}));
    p.dq_semaphore = dq_semaphore.data_ptr<int>();
  }
  at::Tensor seq_maps;
  if (sm90) {
    seq_maps = at::empty({vs.batch * sm90::kBwdSeqMaps * static_cast<int64_t>(sizeof(CUtensorMap))},
                         q.options().dtype(at::kByte));
    p.seq_maps = seq_maps.data_ptr();
  }
  const cudaError_t err = launch_bwd(p, is_bf16, bucket, mods.right >= 0, /*options=*/true, /*sequences=*/true,
                                     sm90 ? BwdPath::kSm90 : BwdPath::kSm80, stream);
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  at::Tensor dq = empty_written({vs.total_q, vs.heads, vs.head_dim}, q.options());
  launch_bwd_postprocess(dq_accum, as_one_batch(dq), softmax_scale, op);
  if (mods.sinks.has_value()) {
    dsinks = sink_grads(dout, out, lse.unsqueeze(0), std::nullopt, *mods.sinks, delta.unsqueeze(0));
  }
  return {dq, dk, dv, dsinks};
}

// ==== KV cache ======================================================================================================
//
// The new keys and values are written into the cache on the device (positions from cache_seqlens, never read on the
// host), then the decode path (a few query rows), the Hopper sequences variant (where TMA can map the cache:
// sm90_maps_kvcache) or the sm80 sequences variant attends over each entry's valid keys, from a dense cache or through
// the block table. cache_seqlens and block_table values are not checked on CUDA: out-of-range ones are
// clamped into the cache (wrong rows, never an access outside it).

// Writes the new keys and values into the caches at the positions the lengths give (KvAppendParams); lengths and
// pages contiguous, or undefined (the cache's last rows; a dense cache).
cudaError_t append_to_kvcache(const KvCacheShape& ks, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& lengths, const at::Tensor& pages,
                              cudaStream_t stream) {
  KvAppendParams a{};
  a.k_new = k.data_ptr();
  a.v_new = v.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.kn_batch_stride = k.stride(0), a.kn_head_stride = k.stride(1), a.kn_row_stride = k.stride(2);
  a.vn_batch_stride = v.stride(0), a.vn_head_stride = v.stride(1), a.vn_row_stride = v.stride(2);
  a.kc_batch_stride = k_cache.stride(0), a.kc_head_stride = k_cache.stride(1), a.kc_row_stride = k_cache.stride(2);
  a.vc_batch_stride = v_cache.stride(0), a.vc_head_stride = v_cache.stride(1), a.vc_row_stride = v_cache.stride(2);
  a.seqlens = lengths.defined() ? lengths.data_ptr<int>() : nullptr;
  if (ks.paged) {
    a.block_table = pages.data_ptr<int>();
    a.block_table_stride = pages.stride(0);
    a.page_size = static_cast<int>(ks.page_size);
    a.num_pages = static_cast<int>(ks.num_pages);
  }
  a.batch = static_cast<int>(ks.batch), a.heads_kv = static_cast<int>(ks.heads_kv);
  a.len_new = static_cast<int>(ks.len_new), a.head_dim = static_cast<int>(ks.head_dim);
  a.capacity = static_cast<int>(ks.capacity);
  // 16-byte copies where every address and stride allows them.
  bool aligned = ks.head_dim % 8 == 0;
  const std::array<const at::Tensor*, 4> tensors{&k, &v, &k_cache, &v_cache};
  for (const at::Tensor* t : tensors) {
    aligned = aligned && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
    for (int d = 0; d < 3; ++d) aligned = aligned && (t->stride(d) % 8 == 0 || t->size(d) == 1);
  }
  a.chunk = aligned ? 8 : 1;
  return run_kvcache_append(a, stream);
}

// Whether the Hopper forward can take KV cache call `p`: TMA maps over its first entry (sm90/sequences.h moves them to
// each entry's rows on the device; every stride being a multiple of 8 elements, each entry's start is 16-byte
// aligned) and, for a paged cache, over the pages, whose size the kernel's key blocks must box (sm90::boxes_pages).
bool sm90_maps_kvcache(const FwdParams& p, int bucket, bool is_bf16, c10::DeviceIndex device) {
#ifdef FLASHATTN_WITH_SM90
  FwdParams first_entry = p;
  first_entry.batch = 1;
  if (p.block_table != nullptr) first_entry.len_k = p.page_size;  // a page's rows
  if (!tma_maps_inputs(first_entry, is_bf16, device)) return false;
  if (p.block_table == nullptr) return true;
  const int block_n = sm90::fwd_sequences_tile_shape(sm90_kernel_head_dim(bucket), p.causal).block_n;
  if (!sm90::boxes_pages(p.page_size, block_n)) return false;
  CUtensorMap k_map, v_map;
  return sm90::make_page_maps(p, is_bf16, block_n, &k_map, &v_map);
#else
  (void)p, (void)bucket, (void)is_bf16, (void)device;
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                                    const std::optional<at::Tensor>& k,
                                                    const std::optional<at::Tensor>& v,
                                                    const std::optional<at::Tensor>& cache_seqlens,
                                                    const std::optional<at::Tensor>& block_table, bool causal,
                                                    std::optional<double> scale, at::IntArrayRef window_size,
                                                    double softcap, const std::optional<at::Tensor>& sinks,
                                                    int64_t num_splits,
                                                    const std::optional<at::Tensor>& cache_leftpad) {
  constexpr const char* op = "flashattn.fwd_kvcache";
  const KvCacheShape ks =
      check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, cache_leftpad, op);
  const AttentionShape s{ks.batch, ks.heads, ks.heads_kv, ks.len_q, ks.capacity, ks.head_dim};
  check_cuda_inputs(op, q, k_cache, v_cache, s, "k_cache", "v_cache");
  const double softmax_scale = resolve_scale(scale, ks.head_dim, op);
  const ScoreMods mods = check_score_mods(q, s, causal, window_size, softcap, sinks, op);
  const int bucket = built_bucket(ks.head_dim, op);

  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor lengths = cache_seqlens.has_value() ? cache_seqlens->contiguous() : at::Tensor();
  const at::Tensor leftpad = cache_leftpad.has_value() ? cache_leftpad->contiguous() : at::Tensor();
  // The block table's rows at any stride (a column slice of a larger table is read in place), its entries contiguous.
  at::Tensor pages;
  if (ks.paged) {
    const bool entries_contiguous = block_table->stride(1) == 1 || block_table->size(1) <= 1;
    pages = entries_contiguous ? *block_table : block_table->contiguous();
  }
  at::Tensor out = empty_written_like(q);
  at::Tensor lse = empty_written({ks.batch, ks.heads, ks.len_q}, q.options().dtype(at::kFloat));
  // The plan first (the switches, strict mode and the device's limits may refuse the call), then the append: a call
  // that raises leaves the caches as they were.
  const bool attends = !s.empty() && ks.capacity > 0;
  FwdParams p{};
  const at::Tensor sinks_rows = mods.sinks.has_value() ? mods.sinks->contiguous() : at::Tensor();
  if (attends) {
    p = make_fwd_params(q, k_cache, v_cache, out, lse, s, mods.right >= 0, softmax_scale);
    set_score_mods(p, mods);
    p.options = true;
    p.sinks = sinks_rows.defined() ? sinks_rows.data_ptr<float>() : nullptr;
    p.seqlens_k = lengths.defined() ? lengths.data_ptr<int>() : nullptr;
    p.leftpad_k = leftpad.defined() ? leftpad.data_ptr<int>() : nullptr;
    p.len_new = static_cast<int>(ks.len_new);
    if (ks.paged) {
      p.block_table = pages.data_ptr<int>();
      p.block_table_stride = pages.stride(0);
      p.page_size = static_cast<int>(ks.page_size);
      p.page_of = DivMod::of(p.page_size);
      p.num_pages = static_cast<int>(ks.num_pages);
    }
    const FwdDevice device = fwd_device(q);
    const Switches& sw = switches();
    if (decode_applies(p, bucket, device, sw)) {
      p.plan = plan_decode(p, bucket, device.num_sms, num_splits, sw);
    } else if (fwd_wants_sm90(bucket, device, sw) &&
               sm90_maps_kvcache(p, bucket, q.scalar_type() == at::kBFloat16, q.get_device())) {
      p.plan = plan_fwd_sequences(p, bucket, device, num_splits, sw.decode_splits);
    } else {
      const std::string page_rule = ks.paged ? c10::str(", or pages of ", ks.page_size, " rows: it takes pages of a "
                                                        "multiple of 8 rows that divide its key blocks (128 keys, 64 "
                                                        "at D256) or that they divide")
                                             : std::string();
      TORCH_CHECK(sw.fwd_sm90 != Sm90Use::kStrict || !fwd_wants_sm90(bucket, device, sw), op,
                  ": FLASHATTN_FWD_SM90=strict, but the Hopper kernel cannot take these inputs (TMA cannot describe "
                  "the strides of q or the caches", page_rule, ")");
      p.plan = plan_fwd_sm80(bucket, device, sw);
    }
    check_fits(p.plan, device, op);
  }

  if (ks.len_new > 0 && ks.capacity > 0) {
    const cudaError_t err = append_to_kvcache(ks, *k, *v, k_cache, v_cache, lengths, pages, stream);
    TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  }
  if (s.empty()) return {out, lse};
  if (ks.capacity == 0) {  // no entry has a key
    store_keyless(out, lse, mods, /*lse_head_dim=*/1);
    return {out, lse};
  }
  const at::Tensor workspace = attach_workspace(p, q, stream);
  const cudaError_t err = launch_fwd(p, q.scalar_type() == at::kBFloat16, bucket, stream);
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn, CUDA, m) {
  m.impl("fwd_kvcache", &flashattn::fwd_kvcache_cuda);
  m.impl("fwd", &flashattn::fwd_cuda);
  m.impl("bwd", &flashattn::bwd_cuda);
  m.impl("fwd_varlen", &flashattn::fwd_varlen_cuda);
  m.impl("bwd_varlen", &flashattn::bwd_varlen_cuda);
}
