// GPU probe of the Hopper building blocks in csrc/cuda/sm90 (built by tests/test_sm90_primitives.py, sm_90a only):
//   wgmma_probe: S = A B^T with both operands K-major in 128B-swizzled shared memory (wgmma SS), then
//                O = P V with P = S rounded in registers and V as an MN-major (transposed) operand (wgmma RS);
//                D = 64 and 128 (two 64-column sub-tiles, as in the forward kernel), bf16 and fp16.
//   tma_probe:   one TMA box load of a (rows x 64) tile into shared memory, returned raw (swizzled).
//   transposed_a_probe: the backward's P^T / dS^T paths: an accumulator stored by the threads into a swizzled tile
//                (store_swizzled_tile), then read by wgmma as an M-major (transposed) A and as a K-major A.
//   transposed_dq_probe: the backward's 80-query dQ path: an accumulator (64 x 80) packed as A registers, stored
//                transposed by stmatrix (store_transposed_tile) as a K-major [80][64] tile, read by wgmma as B against
//                an M-major A (dQ^T = K^T dS^T), and that fp32 result stored transposed into the dQ boxes
//                (store_transposed_fp32_tile).
//   attention_probe: the sm90 forward kernel (csrc/cuda/sm90/fwd_kernel.h, as the plan of fwd_plan.h runs it) on
//                contiguous bf16 (B, H, L, D) inputs.
//   tma_negative_rows_probe: a TMA box load at a negative row (the first tile of a head starts there in the
//                three-consumer causal forward): it must zero-fill those rows and still count the whole box's bytes.
//                (A TMA store at a negative row fails with a CUDA error on the H200, so the forward
//                skips those O boxes.)
//   key_rows_probe: the backward's dK / dV epilogue: accumulators staged in swizzled 64-column sub-tiles, then
//                16-byte rows to global memory (store_key_rows), rows past Lk and columns past the head dim skipped.
//   merge_split_tile_probe: the stream-K merge of a tile split between two CTAs (fwd_epilogue.h, merge_split_tile) for
//                one warp's rows at D128, with the part holding the tile's first key blocks taking the lock first or
//                second: the merged result must be the same bit for bit.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "cuda/ptx_common.h"
#include "cuda/sm90/bwd_kernel.h"
#include "cuda/fwd_plan.h"
#include "cuda/sm90/fwd_launch.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/tma.h"
#include "cuda/sm90/wgmma_ops.h"

namespace {

using flashattn::sm90::Wgmma;
using T = __nv_bfloat16;  // the TMA and attention probes

// Row-major (rows x cols) global tile -> shared sub-tiles of [rows x 64] in the 128B-swizzle layout that TMA writes
// with CU_TENSOR_MAP_SWIZZLE_128B (16-byte chunk c of row r stored at chunk c ^ (r % 8)), as the kernel keeps them.
template <typename E>
__device__ void store_swizzled(E* smem, const E* gmem, int rows, int cols) {
  for (int idx = threadIdx.x; idx < rows * cols / 8; idx += blockDim.x) {
    const int r = idx / (cols / 8), chunk = idx % (cols / 8);
    const int sub = chunk / 8, c = chunk % 8;
    *reinterpret_cast<uint4*>(smem + sub * rows * 64 + r * 64 + (c ^ (r % 8)) * 8) =
        *reinterpret_cast<const uint4*>(gmem + r * cols + chunk * 8);
  }
}

// Writes a 64 x kN fp32 accumulator (wgmma layout) row-major.
template <int kN>
__device__ void store_accumulator(float* out, const float (&d)[kN / 2]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = 0; j < kN / 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * warp + lane / 4 + 8 * (i / 2);
      const int col = 8 * j + 2 * (lane % 4) + i % 2;
      out[row * kN + col] = d[4 * j + i];
    }
  }
}

// S = A B^T (A: 64 x kDim, B: kDim x kDim, both K-major in kDim / 64 sub-tiles), then O = P V with P = S rounded to E
// in registers and V (kDim keys x kDim) read transposed across its kDim / 64 column sub-tiles: the layouts of the
// forward kernel, including the 32-byte k steps, the +sub-tile jumps and V's leading byte offset.
template <typename E, int kDim>
__global__ void __launch_bounds__(128) wgmma_probe_kernel(const E* a, const E* b, const E* v, float* s_out,
                                                          float* o_out) {
  extern __shared__ unsigned char smem_raw[];
  E* const sA = reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  E* const sB = sA + 64 * kDim;
  E* const sV = sB + kDim * kDim;
  store_swizzled(sA, a, 64, kDim);
  store_swizzled(sB, b, kDim, kDim);
  store_swizzled(sV, v, kDim, kDim);
  flashattn::sm90::fence_proxy_async_smem();
  __syncthreads();

  float s[kDim / 2];
  for (int i = 0; i < kDim / 2; ++i) s[i] = 0.f;
  flashattn::sm90::wgmma_fence_registers(s);
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < kDim / 16; ++kk) {
    const int sub = kk / 4, k_in_row = (kk % 4) * 16;
    Wgmma<E, kDim>::template ss<false>(s, flashattn::sm90::smem_desc_sw128(sA + sub * 64 * 64 + k_in_row),
                                       flashattn::sm90::smem_desc_sw128(sB + sub * kDim * 64 + k_in_row), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(s);
  store_accumulator<kDim>(s_out, s);

  uint32_t p[kDim / 16][4];
  for (int kk = 0; kk < kDim / 16; ++kk) {
    for (int i = 0; i < 4; ++i) p[kk][i] = flashattn::pack2<E>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
  float o[kDim / 2];
  for (int i = 0; i < kDim / 2; ++i) o[i] = 0.f;
  flashattn::sm90::wgmma_fence_registers(o);
  flashattn::sm90::wgmma_fence_registers(p);
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < kDim / 16; ++kk) {  // k16 steps over keys: 16 rows = 2048 bytes down each sub-tile
    Wgmma<E, kDim>::template rs<true>(
        o, p[kk], flashattn::sm90::smem_desc_sw128(sV + kk * 16 * 64, kDim * 64 * sizeof(E)), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(o);
  store_accumulator<kDim>(o_out, o);
}

template <typename E, int kDim>
void launch_wgmma_probe(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& v, torch::Tensor& s,
                        torch::Tensor& o) {
  auto kernel = wgmma_probe_kernel<E, kDim>;
  const int smem = (64 * kDim + 2 * kDim * kDim) * sizeof(E) + 1024;
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess);
  kernel<<<1, 128, smem>>>(reinterpret_cast<const E*>(a.data_ptr()), reinterpret_cast<const E*>(b.data_ptr()),
                           reinterpret_cast<const E*>(v.data_ptr()), s.data_ptr<float>(), o.data_ptr<float>());
}

// acc = X Y^T (64 x 64, the verified SS path); acc rounded into a swizzled [64][64] tile by the threads, as the
// backward stores dS^T; then out = acc^T Z with the tile as an M-major A and Z (K x N) as an MN-major B, as the
// backward's dQ = dS K reads them. Returns acc, out and the raw tile.
__global__ void __launch_bounds__(128) transposed_a_probe_kernel(const T* x, const T* y, const T* z, float* acc_out,
                                                                 float* out, T* tile_out, float* out_k_major) {
  __shared__ __align__(1024) T sX[64 * 64];
  __shared__ __align__(1024) T sY[64 * 64];
  __shared__ __align__(1024) T sZ[64 * 64];
  __shared__ __align__(1024) T tile[64 * 64];
  store_swizzled(sX, x, 64, 64);
  store_swizzled(sY, y, 64, 64);
  store_swizzled(sZ, z, 64, 64);
  flashattn::sm90::fence_proxy_async_smem();
  __syncthreads();

  float acc[32];
  flashattn::sm90::wgmma_fence_registers(acc);
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {
    Wgmma<T, 64>::ss<false>(acc, flashattn::sm90::smem_desc_sw128(sX + kk * 16),
                            flashattn::sm90::smem_desc_sw128(sY + kk * 16), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(acc);
  store_accumulator<64>(acc_out, acc);

  flashattn::sm90::store_swizzled_tile<T, 64>(tile, acc, threadIdx.x / 32, threadIdx.x % 32);
  flashattn::sm90::fence_proxy_async_smem();
  __syncthreads();
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) tile_out[i] = tile[i];

  float o[32];
  flashattn::sm90::wgmma_fence_registers(o);
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {  // k16 steps down the rows of both tiles
    Wgmma<T, 64>::ss<true, true>(o, flashattn::sm90::smem_desc_sw128(tile + kk * 16 * 64),
                                 flashattn::sm90::smem_desc_sw128(sZ + kk * 16 * 64), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(o);
  store_accumulator<64>(out, o);

  // The split backward's other use of a thread-written tile: as a K-major A (out_k_major = acc Z^T, Z as the
  // K-major B, like the forward's K).
  float ok[32];
  flashattn::sm90::wgmma_fence_registers(ok);
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {
    Wgmma<T, 64>::ss<false>(ok, flashattn::sm90::smem_desc_sw128(tile + kk * 16),
                            flashattn::sm90::smem_desc_sw128(sZ + kk * 16), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(ok);
  store_accumulator<64>(out_k_major, ok);
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

// Loads the 64 x 64 box at row `row` of head 1 from `in_map`. The wait is bounded: done[0] = 1 once the load's
// mbarrier completed (0: it never did).
__global__ void __launch_bounds__(128) tma_negative_rows_kernel(const __grid_constant__ CUtensorMap in_map, int row,
                                                                T* loaded, int* done) {
  __shared__ __align__(1024) T tile[64 * 64];
  __shared__ __align__(8) uint64_t bar;
  __shared__ int landed;
  if (threadIdx.x == 0) {
    flashattn::sm90::mbarrier_init(&bar, 1);
    flashattn::sm90::fence_barrier_init();
    landed = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    flashattn::sm90::mbarrier_arrive_expect_tx(&bar, sizeof(tile));
    flashattn::sm90::tma_load_4d(tile, &in_map, &bar, 0, row, 1, 0);
    for (int spin = 0; spin < (1 << 24) && !landed; ++spin) {
      uint32_t complete = 0;
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(complete)
          : "r"(flashattn::smem_addr(&bar))
          : "memory");
      landed = complete;
    }
    *done = landed;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) loaded[i] = tile[i];
}

// a: (64, D), b: (D, D), v: (D, D), contiguous bf16 or fp16 with D = 64 or 128. Returns S = a b^T and O = P v.
std::vector<torch::Tensor> wgmma_probe(torch::Tensor a, torch::Tensor b, torch::Tensor v) {
  const int64_t dim = a.size(1);
  TORCH_CHECK(dim == 64 || dim == 128, "wgmma_probe: D must be 64 or 128");
  auto s = torch::empty({64, dim}, a.options().dtype(torch::kFloat));
  auto o = torch::empty({64, dim}, a.options().dtype(torch::kFloat));
  const bool bf16 = a.scalar_type() == torch::kBFloat16;
  if (dim == 64) {
    bf16 ? launch_wgmma_probe<__nv_bfloat16, 64>(a, b, v, s, o) : launch_wgmma_probe<__half, 64>(a, b, v, s, o);
  } else {
    bf16 ? launch_wgmma_probe<__nv_bfloat16, 128>(a, b, v, s, o) : launch_wgmma_probe<__half, 128>(a, b, v, s, o);
  }
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

// x: (1, 2, 64, 64) bf16, read at head 1. Returns the loaded tile (raw, swizzled) and whether the load's mbarrier
// completed.
std::vector<torch::Tensor> tma_negative_rows_probe(torch::Tensor x, int64_t row) {
  CUtensorMap in_map;  // (1, 2, 64, 64), contiguous, boxes of 64 rows
  TORCH_CHECK(flashattn::sm90::make_bhld_map(&in_map, x.data_ptr(), true, 1, 2, 64, 64, 2 * 64 * 64, 64 * 64, 64, 64),
              "cuTensorMapEncodeTiled failed");
  auto loaded = torch::empty({64, 64}, x.options());
  auto done = torch::zeros({1}, x.options().dtype(torch::kInt));
  tma_negative_rows_kernel<<<1, 128>>>(in_map, static_cast<int>(row), reinterpret_cast<T*>(loaded.data_ptr()),
                                       done.data_ptr<int>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "tma_negative_rows_probe launch failed");
  return {loaded, done};
}

// x, y, z: (64, 64) bf16, contiguous. Returns x y^T, (x y^T rounded)^T z, the raw swizzled tile, and
// (x y^T rounded) z^T.
std::vector<torch::Tensor> transposed_a_probe(torch::Tensor x, torch::Tensor y, torch::Tensor z) {
  const auto f32 = x.options().dtype(torch::kFloat);
  auto acc = torch::empty({64, 64}, f32), out = torch::empty({64, 64}, f32);
  auto out_k_major = torch::empty({64, 64}, f32);
  auto tile = torch::empty_like(x);
  transposed_a_probe_kernel<<<1, 128>>>(reinterpret_cast<const T*>(x.data_ptr()),
                                        reinterpret_cast<const T*>(y.data_ptr()),
                                        reinterpret_cast<const T*>(z.data_ptr()), acc.data_ptr<float>(),
                                        out.data_ptr<float>(), reinterpret_cast<T*>(tile.data_ptr()),
                                        out_k_major.data_ptr<float>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "transposed_a_probe launch failed");
  return {acc, out, tile, out_k_major};
}

// acc = X Y^T (X: 64 x 64, Y: 80 x 64; SS with N = 80), packed and stored transposed into `tile` ([80][64], 128-byte
// swizzle) as the backward stores dS; then out = Z^T acc (Z: 64 x 64 read as an M-major A, the tile as the K-major
// B), as its dQ^T = K^T dS^T, and out stored transposed into two fp32 [80][32] boxes (`boxes`). Returns acc, the raw
// tile, out and the raw boxes.
__global__ void __launch_bounds__(128) transposed_dq_probe_kernel(const T* x, const T* y, const T* z, float* acc_out,
                                                                  T* tile_out, float* out, float* boxes_out) {
  constexpr int kM = 80;
  __shared__ __align__(1024) T sX[64 * 64];
  __shared__ __align__(1024) T sY[kM * 64];
  __shared__ __align__(1024) T sZ[64 * 64];
  __shared__ __align__(1024) T tile[kM * 64];
  __shared__ __align__(1024) float boxes[2 * kM * 32];
  store_swizzled(sX, x, 64, 64);
  store_swizzled(sY, y, kM, 64);
  store_swizzled(sZ, z, 64, 64);
  flashattn::sm90::fence_proxy_async_smem();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  float acc[kM / 2];
  flashattn::sm90::wgmma_fence_registers(acc);
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {
    Wgmma<T, kM>::ss<false>(acc, flashattn::sm90::smem_desc_sw128(sX + kk * 16),
                            flashattn::sm90::smem_desc_sw128(sY + kk * 16), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(acc);
  store_accumulator<kM>(acc_out, acc);

  uint32_t a[kM / 16][4];
  flashattn::sm90::pack_a<T, kM>(a, acc);
  flashattn::sm90::store_transposed_tile<T, kM>(tile, a, warp, lane);
  flashattn::sm90::fence_proxy_async_smem();
  __syncthreads();
  for (int i = threadIdx.x; i < kM * 64; i += blockDim.x) tile_out[i] = tile[i];

  float o[kM / 2];
  flashattn::sm90::wgmma_fence_registers(o);
  flashattn::sm90::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {  // k16 steps down Z's rows and along the tile's
    Wgmma<T, kM>::ss<false, true>(o, flashattn::sm90::smem_desc_sw128(sZ + kk * 16 * 64),
                                  flashattn::sm90::smem_desc_sw128(tile + kk * 16), kk > 0);
  }
  flashattn::sm90::wgmma_commit();
  flashattn::sm90::wgmma_wait<0>();
  flashattn::sm90::wgmma_fence_registers(o);
  store_accumulator<kM>(out, o);

  flashattn::sm90::store_transposed_fp32_tile<kM>(boxes, o, warp, lane);
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * kM * 32; i += blockDim.x) boxes_out[i] = boxes[i];
}

std::vector<torch::Tensor> transposed_dq_probe(torch::Tensor x, torch::Tensor y, torch::Tensor z) {
  const auto f32 = x.options().dtype(torch::kFloat);
  auto acc = torch::empty({64, 80}, f32), out = torch::empty({64, 80}, f32), boxes = torch::empty({2, 80, 32}, f32);
  auto tile = torch::empty({80, 64}, x.options());
  transposed_dq_probe_kernel<<<1, 128>>>(reinterpret_cast<const T*>(x.data_ptr()),
                                         reinterpret_cast<const T*>(y.data_ptr()),
                                         reinterpret_cast<const T*>(z.data_ptr()), acc.data_ptr<float>(),
                                         reinterpret_cast<T*>(tile.data_ptr()), out.data_ptr<float>(),
                                         boxes.data_ptr<float>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "transposed_dq_probe launch failed");
  return {acc, tile, out, boxes};
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
  // The plan the extension makes (the default switches, less the decode path: this probe runs the Hopper kernel),
  // and its workspace.
  int num_sms = 0;
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.get_device());
  flashattn::Switches switches{};
  switches.decode = false;
  p.plan = flashattn::plan_fwd(p, static_cast<int>(q.size(3)), flashattn::FwdDevice{true, true, num_sms}, switches,
                               false);
  auto workspace = torch::zeros({std::max<int64_t>(p.plan.workspace_bytes, 1)}, q.options().dtype(torch::kByte));
  char* base = static_cast<char*>(workspace.data_ptr());
  if (p.plan.schedule == flashattn::FwdSchedule::kCounter) {
    p.tile_counter = reinterpret_cast<int*>(base);
  } else if (p.plan.schedule == flashattn::FwdSchedule::kStreamK) {
    p.sk_flags = reinterpret_cast<int*>(base);
    p.sk_partial = reinterpret_cast<float*>(base + p.plan.zeroed_bytes);
  }
  const auto run = [&](auto head_dim_tag) {
    constexpr int kHeadDim = decltype(head_dim_tag)::value;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    return causal ? flashattn::sm90::run_fwd_sm90<T, kHeadDim, true, false, false>(p, stream)
                  : flashattn::sm90::run_fwd_sm90<T, kHeadDim, false, false, false>(p, stream);
  };
  cudaError_t err = cudaErrorInvalidValue;
  switch (q.size(3)) {
    case 64: err = run(std::integral_constant<int, 64>{}); break;
    case 128: err = run(std::integral_constant<int, 128>{}); break;
    case 256: err = run(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, "attention_probe: head dim 64, 128 or 256");
  }
  TORCH_CHECK(err == cudaSuccess, "attention_probe: ", cudaGetErrorString(err));
  return {out, lse};
}

// CTA b holds part b (0: the tile's first key blocks) of one warp's rows: parts[b][i][lane] for the 64 O values,
// then 2 row maxima and 2 row sums. The part named by `second_part_first` takes the lock first (the other waits for
// it); the one that merges writes its O, row maxima and row sums to `merged` in the same layout.
__global__ void __launch_bounds__(32) merge_split_tile_kernel(const float* parts, float scale_log2,
                                                              bool second_part_first, int* flags, float* partial,
                                                              float* merged) {
  constexpr int kSums = 64;
  const int lane = threadIdx.x, part = blockIdx.x;
  const float* const src = parts + part * (kSums + 4) * 32;
  float o[kSums], row_max[2], row_sum[2];
  for (int i = 0; i < kSums; ++i) o[i] = src[i * 32 + lane];
  for (int h = 0; h < 2; ++h) {
    row_max[h] = src[(kSums + h) * 32 + lane];
    row_sum[h] = src[(kSums + 2 + h) * 32 + lane];
  }
  if (part != (second_part_first ? 1 : 0)) {  // the later one: wait until the other holds the lock
    if (lane == 0) {
      while (*static_cast<volatile int*>(flags) == 0) __nanosleep(64);
    }
    __syncwarp();
  }
  if (flashattn::sm90::merge_split_tile<128>(o, row_max, row_sum, scale_log2, part == 0, flags, flags + 1, partial,
                                             lane)) {
    for (int i = 0; i < kSums; ++i) merged[i * 32 + lane] = o[i];
    for (int h = 0; h < 2; ++h) {
      merged[(kSums + h) * 32 + lane] = row_max[h];
      merged[(kSums + 2 + h) * 32 + lane] = row_sum[h];
    }
  }
}

// parts: (2, 68, 32) float32, contiguous (merge_split_tile_kernel). Returns the merged (68, 32).
torch::Tensor merge_split_tile_probe(torch::Tensor parts, double scale_log2, bool second_part_first) {
  auto flags = torch::zeros({2}, parts.options().dtype(torch::kInt));
  auto partial = torch::empty({68, 32}, parts.options());
  auto merged = torch::full({68, 32}, std::nanf(""), parts.options());
  merge_split_tile_kernel<<<2, 32>>>(parts.data_ptr<float>(), static_cast<float>(scale_log2), second_part_first,
                                     flags.data_ptr<int>(), partial.data_ptr<float>(), merged.data_ptr<float>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "merge_split_tile_probe launch failed");
  return merged;
}

// Thread t of warpgroup w votes values[round][t] with warpgroup_all on barrier 4 + w, round after round, as the
// forward's consumers do once per key block (kOptimisticExp); out[round][t] is what it got back.
__global__ void __launch_bounds__(384) warpgroup_all_kernel(const int* values, int rounds, int* out) {
  const int t = threadIdx.x, warpgroup = t / 128;
  for (int round = 0; round < rounds; ++round) {
    out[round * 384 + t] = flashattn::sm90::warpgroup_all(values[round * 384 + t] != 0, 4 + warpgroup);
  }
}

// values: (rounds, 384) int32, contiguous. Returns (rounds, 384) int32: each thread's vote result.
torch::Tensor warpgroup_all_probe(torch::Tensor values) {
  auto out = torch::full_like(values, -1);
  warpgroup_all_kernel<<<1, 384>>>(values.data_ptr<int>(), static_cast<int>(values.size(0)), out.data_ptr<int>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "warpgroup_all_probe launch failed");
  return out;
}

// The backward's dK / dV epilogue (bwd_common.h): two warpgroups' accumulators, each entry values[row][column], into
// swizzled 64-column sub-tiles (store_swizzled_tile, times scale), then store_key_rows into out's rows n_start ..
// (rows past len_k and columns past head_dim left alone). kSplitColumns (the D256 kernel): warpgroup c holds all 64
// rows and columns 128 c .., staged as the K tile is, stored by both warpgroups; otherwise rows 64 c .. and all
// columns, staged and stored by each warpgroup alone, its sub-tile b at (2 b + c) * 64 * 64 (as dV is at D128).
struct ProbeKeyBlock {
  int n_start, len;
  __device__ int len_k(const flashattn::BwdParams&) const { return len; }
  __device__ int64_t kv_offset(int key, int64_t, int64_t, int64_t row_stride) const { return key * row_stride; }
};

template <int kHeadDim, int kBlockN, bool kSplitColumns>
__global__ void __launch_bounds__(256) key_rows_probe_kernel(const float* values, float scale, int n_start, int len_k,
                                                             int head_dim, T* out) {
  __shared__ __align__(1024) T tile[kBlockN * kHeadDim];
  constexpr int kCols = kSplitColumns ? kHeadDim / 2 : kHeadDim;
  const int consumer = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int row0 = kSplitColumns ? 0 : 64 * consumer, col0 = kSplitColumns ? kCols * consumer : 0;
  float acc[kCols / 2];
  for (int j = 0; j < kCols / 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + 16 * warp + lane / 4 + 8 * (i / 2), col = col0 + 8 * j + 2 * (lane % 4) + i % 2;
      acc[4 * j + i] = values[row * kHeadDim + col];
    }
  }
  flashattn::BwdParams p{};
  p.head_dim = head_dim;
  p.dk = out;  // the rows of dK: out's
  p.dk_row_stride = head_dim;
  const ProbeKeyBlock block{n_start, len_k};
  if constexpr (kSplitColumns) {
    flashattn::sm90::store_swizzled_tile<T, kCols, kBlockN * 64>(tile + (col0 / 64) * kBlockN * 64, acc, warp, lane,
                                                                  scale);
    __syncthreads();
    flashattn::sm90::store_key_rows<T, kHeadDim, kBlockN, 256, kBlockN * 64>(p, block, tile, false, 0, threadIdx.x);
  } else {
    constexpr int kStride = 2 * 64 * 64;
    T* const own = tile + consumer * 64 * 64;
    flashattn::sm90::store_swizzled_tile<T, kCols, kStride>(own, acc, warp, lane, scale);
    __syncthreads();
    flashattn::sm90::store_key_rows<T, kHeadDim, 64, 128, kStride>(p, block, own, false, row0, threadIdx.x % 128);
  }
}

// values: (block_n, bucket) float32; out: (rows, head_dim) bf16, contiguous, written in place.
void key_rows_probe(torch::Tensor values, double scale, int64_t n_start, int64_t len_k, int64_t head_dim,
                    int64_t bucket, torch::Tensor out) {
  const auto args = [&](auto kernel) {
    kernel<<<1, 256>>>(values.data_ptr<float>(), static_cast<float>(scale), static_cast<int>(n_start),
                       static_cast<int>(len_k), static_cast<int>(head_dim), reinterpret_cast<T*>(out.data_ptr()));
  };
  switch (bucket) {
    case 64: args(key_rows_probe_kernel<64, 128, false>); break;
    case 128: args(key_rows_probe_kernel<128, 128, false>); break;
    case 256: args(key_rows_probe_kernel<256, 64, true>); break;
    default: TORCH_CHECK(false, "key_rows_probe: bucket 64, 128 or 256");
  }
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "key_rows_probe launch failed");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wgmma_probe", &wgmma_probe);
  m.def("tma_probe", &tma_probe);
  m.def("transposed_a_probe", &transposed_a_probe);
  m.def("transposed_dq_probe", &transposed_dq_probe);
  m.def("attention_probe", &attention_probe);
  m.def("tma_negative_rows_probe", &tma_negative_rows_probe);
  m.def("merge_split_tile_probe", &merge_split_tile_probe);
  m.def("warpgroup_all_probe", &warpgroup_all_probe);
  m.def("key_rows_probe", &key_rows_probe);
}
