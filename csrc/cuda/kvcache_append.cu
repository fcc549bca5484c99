// The KV cache's append in one launch: each new row of keys and values goes to its cache position (params.h,
// KvAppendParams), found on the device from cache_seqlens and the block table, so that nothing is read back to the host
// and a captured graph replays with new lengths. Rows whose positions fall outside the cache (out-of-range lengths) are
// not written; out-of-range pages are clamped into it: wrong rows, never memory outside the cache.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launchers.h"

namespace flashattn {
namespace {

constexpr int kThreads = 256;

// A row is a group of `lanes` threads (a power of two, at most kThreads), each copying chunks of type C.
template <typename C>
__device__ void copy_rows(const KvAppendParams& p, int lanes) {
  constexpr int kElems = sizeof(C) / 2;  // 2-byte elements (fp16, bf16)
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / lanes) + threadIdx.x / lanes;
  if (row >= static_cast<int64_t>(p.batch) * p.heads_kv * p.len_new) return;
  const int t = static_cast<int>(row % p.len_new);
  const int head = static_cast<int>(row / p.len_new % p.heads_kv);
  const int64_t batch = row / p.len_new / p.heads_kv;

  const int64_t start = p.seqlens != nullptr ? __ldg(p.seqlens + batch) : p.capacity - p.len_new;
  const int64_t pos = start + t;
  // A position outside the cache (lengths that break the rules) is not written: clamped, several rows would land on
  // one in no fixed order.
  if (pos < 0 || pos >= p.capacity) return;
  int64_t k_dst = head * p.kc_head_stride, v_dst = head * p.vc_head_stride;
  if (p.block_table != nullptr) {
    const int page = min(max(__ldg(p.block_table + batch * p.block_table_stride + pos / p.page_size), 0),
                         p.num_pages - 1);
    const int64_t in_page = pos % p.page_size;
    k_dst += page * p.kc_batch_stride + in_page * p.kc_row_stride;
    v_dst += page * p.vc_batch_stride + in_page * p.vc_row_stride;
  } else {
    k_dst += batch * p.kc_batch_stride + pos * p.kc_row_stride;
    v_dst += batch * p.vc_batch_stride + pos * p.vc_row_stride;
  }
  const int64_t k_src = batch * p.kn_batch_stride + head * p.kn_head_stride + t * p.kn_row_stride;
  const int64_t v_src = batch * p.vn_batch_stride + head * p.vn_head_stride + t * p.vn_row_stride;
  const auto* const kn = static_cast<const uint16_t*>(p.k_new);
  const auto* const vn = static_cast<const uint16_t*>(p.v_new);
  auto* const kc = static_cast<uint16_t*>(p.k_cache);
  auto* const vc = static_cast<uint16_t*>(p.v_cache);
  for (int c = (threadIdx.x % lanes) * kElems; c < p.head_dim; c += lanes * kElems) {
    *reinterpret_cast<C*>(kc + k_dst + c) = *reinterpret_cast<const C*>(kn + k_src + c);
    *reinterpret_cast<C*>(vc + v_dst + c) = *reinterpret_cast<const C*>(vn + v_src + c);
  }
}

__global__ void __launch_bounds__(kThreads) kvcache_append_kernel(const __grid_constant__ KvAppendParams p,
                                                                  int lanes) {
  if (p.chunk == 8) {
    copy_rows<uint4>(p, lanes);
  } else {
    copy_rows<uint16_t>(p, lanes);
  }
}

}  // namespace

cudaError_t run_kvcache_append(const KvAppendParams& params, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(params.batch) * params.heads_kv * params.len_new;
  if (rows == 0) return cudaSuccess;
  // A row's lanes: the power of two that covers its chunks (at most kThreads).
  const int chunks = (params.head_dim + params.chunk - 1) / params.chunk;
  int lanes = 1;
  while (lanes < chunks && lanes < kThreads) lanes *= 2;
  const int64_t blocks = (rows + kThreads / lanes - 1) / (kThreads / lanes);
  kvcache_append_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params, lanes);
  return cudaGetLastError();
}

}  // namespace flashattn
