// GPU probe of the Hopper building blocks in csrc/cuda/sm90 (built by tests/test_sm90_primitives.py, sm_90a only):
//   wgmma_probe: S = A B^T with both operands K-major in 128B-swizzled shared memory (wgmma SS), then
//                O = bf16(S) V with P from registers and V as an MN-major (transposed) operand (wgmma RS).
//   tma_probe:   one TMA box load of a (rows x 64) tile into shared memory, returned raw (swizzled).
//   attention_probe: the sm90 forward kernel (csrc/cuda/sm90/fwd_kernel.h) on contiguous bf16 (B, H, L, D) inputs.
#include <torch/extension.h>

#include "cuda/sm90/fwd_kernel.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/tma.h"
#include "cuda/sm90/wgmma_ops.h"

namespace {

using flashattn::sm90::Wgmma;
using T = __nv_bfloat16;

// Row-major (rows x 64) global tile -> 128B-swizzle layout (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B).
__device__ void store_swizzled(T* smem, const T* gmem, int rows) {
  for (int idx = threadIdx.x; idx < rows * 8; idx += blockDim.x) {
    const int r = idx / 8, c = idx % 8;
    *reinterpret_cast<uint4*>(smem + r * 64 + (c ^ (r % 8)) * 8) = *reinterpret_cast<const uint4*>(gmem + r * 64 + c * 8);
  }
}

__device__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Writes a 64 x 64 fp32 accumulator (wgmma layout) row-major.
__device__ void store_accumulator(float* out, const float (&d)[32]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = 0; j < 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * warp + lane / 4 + 8 * (i / 2);
      const int col = 8 * j + 2 * (lane % 4) + i % 2;
      out[row * 64 + col] = d[4 * j + i];
    }
  }
}

__global__ void __launch_bounds__(128) wgmma_probe_kernel(const T* a, const T* b, const T* v, float* s_out,
                                                          float* o_out) {
  __shared__ __align__(1024) T sA[64 * 64];
  __shared__ __align__(1024) T sB[64 * 64];
  __shared__ __align__(1024) T sV[64 * 64];
  store_swizzled(sA, a, 64);
  store_swizzled(sB, b, 64);
  store_swizzled(sV, v, 64);
  flashattn::sm90::fence_proxy_async_smem();
  __syncthreads();

  float s[32];
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {  // k16 steps inside the 128-byte rows: +32 bytes each
    Wgmma<T, 64>::ss<false>(s, flashattn::sm90::smem_desc_sw128(sA + kk * 16),
                            flashattn::sm90::smem_desc_sw128(sB + kk * 16), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(s);
  store_accumulator(s_out, s);

  // P = bf16(S) as A fragments: k16 step kk covers S columns 16 kk .. 16 kk + 15, i.e. accumulator tiles 2 kk, 2 kk + 1.
  uint32_t p[4][4];
  for (int kk = 0; kk < 4; ++kk) {
    for (int i = 0; i < 4; ++i) p[kk][i] = pack_bf16(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
  float o[32];
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {  // k16 steps over keys: 16 rows of V = 2048 bytes each
    Wgmma<T, 64>::rs<true>(o, p[kk], flashattn::sm90::smem_desc_sw128(sV + kk * 16 * 64), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(o);
  store_accumulator(o_out, o);
}

__global__ void __launch_bounds__(128) tma_probe_kernel(const __grid_constant__ CUtensorMap map, T* out) {
  __shared__ __align__(1024) T tile[64 * 64];
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x == 0) {
    flashattn::sm90::mbarrier_init(&bar, 1);
    flashattn::sm90::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    flashattn::sm90::mbarrier_arrive_expect_tx(&bar, sizeof(tile));
    flashattn::sm90::tma_load_4d(tile, &map, &bar, 0, 0, 0, 0);
  }
  flashattn::sm90::mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) out[i] = tile[i];
}

std::vector<torch::Tensor> wgmma_probe(torch::Tensor a, torch::Tensor b, torch::Tensor v) {
  auto s = torch::empty({64, 64}, a.options().dtype(torch::kFloat));
  auto o = torch::empty({64, 64}, a.options().dtype(torch::kFloat));
  wgmma_probe_kernel<<<1, 128>>>(reinterpret_cast<const T*>(a.data_ptr()), reinterpret_cast<const T*>(b.data_ptr()),
                                 reinterpret_cast<const T*>(v.data_ptr()), s.data_ptr<float>(), o.data_ptr<float>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "wgmma_probe launch failed");
  return {s, o};
}

torch::Tensor tma_probe(torch::Tensor a) {  // a: (64, 64) bf16, contiguous
  CUtensorMap map;
  TORCH_CHECK(flashattn::sm90::make_bhld_map(&map, a.data_ptr(), true, 1, 1, 64, 64, 64 * 64, 64 * 64, 64, 64),
              "cuTensorMapEncodeTiled failed");
  auto out = torch::empty_like(a);
  tma_probe_kernel<<<1, 128>>>(map, reinterpret_cast<T*>(out.data_ptr()));
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "tma_probe launch failed");
  return out;
}

std::vector<torch::Tensor> attention_probe(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal) {
  auto out = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat));
  flashattn::FwdParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.batch = q.size(0), p.heads = q.size(1), p.heads_kv = k.size(1), p.len_q = q.size(2), p.len_k = k.size(2);
  p.head_dim = q.size(3), p.heads_per_kv = q.size(1) / k.size(1);
  p.scale = 1.0f / std::sqrt(static_cast<float>(q.size(3)));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.causal = causal;
  TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, "attention_probe: head dim 64 or 128");
  cudaError_t err;
  if (q.size(3) == 64) {
    err = causal ? flashattn::sm90::run_fwd_sm90<T, 64, true>(p, nullptr)
                 : flashattn::sm90::run_fwd_sm90<T, 64, false>(p, nullptr);
  } else {
    err = causal ? flashattn::sm90::run_fwd_sm90<T, 128, true>(p, nullptr)
                 : flashattn::sm90::run_fwd_sm90<T, 128, false>(p, nullptr);
  }
  TORCH_CHECK(err == cudaSuccess, "attention_probe: ", cudaGetErrorString(err));
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wgmma_probe", &wgmma_probe);
  m.def("tma_probe", &tma_probe);
  m.def("attention_probe", &attention_probe);
}
