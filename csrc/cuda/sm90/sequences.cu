// The preparation of a packed call (or a KV cache's entries) for the Hopper kernels (sequences.h): one CTA writes each
// sequence's tensor maps and, for the forward, ranks the sequences by their keys and counts their tiles in that order.
#include "cuda/packed.h"
#include "cuda/params.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/sequences.h"

namespace flashattn::sm90 {
namespace {

constexpr int kThreads = 1024;

// Sequence b's query or key rows [first, first + len): packed, from cu_seqlens; a cache entry's, every query row or
// its valid keys.
__device__ EntryKeys sequence_rows(const SequencesPrepParams& prep, bool query_rows, int b) {
  if (prep.cu_seqlens_q == nullptr) {
    if (query_rows) return {0, prep.total_q};
    return entry_keys(prep.seqlens_k, prep.leftpad_k, prep.len_new, prep.total_k, b);
  }
  const int* cu = query_rows ? prep.cu_seqlens_q : prep.cu_seqlens_k;
  const int total = query_rows ? prep.total_q : prep.total_k;
  const int first = clamped_offset(cu, b, total);
  return {first, max(0, clamped_offset(cu, b + 1, total) - first)};
}

// The exclusive prefix sum of `value` over the CTA's threads.
__device__ int block_exclusive_sum(int value, int* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int up = __shfl_up_sync(0xffffffff, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int total = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffff, total, d);
      if (lane >= d) total += up;
    }
    warp_sums[lane] = total;
  }
  __syncthreads();
  return inclusive - value + (warp > 0 ? warp_sums[warp - 1] : 0);
}

__global__ void __launch_bounds__(kThreads)
    prepare_sequences_kernel(const __grid_constant__ SeqMapTemplates templates,
                             const __grid_constant__ SequencesPrepParams prep) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ int keys[kMaxSortedSequences];
  __shared__ int warp_sums[kThreads / 32];
  const int batch = prep.batch;
  // Each sequence's maps: the template's copy, based at its first row and cut to its rows (one row where it has none,
  // the base then the tensor's: such a map is never used).
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(batch) * prep.num_maps; i += kThreads) {
    const int b = static_cast<int>(i / prep.num_maps);
    const SeqMapSource& source = prep.sources[i % prep.num_maps];
    CUtensorMap* const map = prep.maps + i;
    const uint4* src = reinterpret_cast<const uint4*>(&templates.map[i % prep.num_maps]);
    uint4* dst = reinterpret_cast<uint4*>(map);
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(CUtensorMap) / sizeof(uint4)); ++w) dst[w] = src[w];
    const EntryKeys rows = sequence_rows(prep, source.query_rows, b);
    if (!source.query_rows && prep.page_size > 0) {  // the rows of the page that holds the entry's last keys
      const int last_page_rows = rows.len - (rows.len - 1) / prep.page_size * prep.page_size;
      tensormap_replace_dim<1>(map, static_cast<uint32_t>(rows.len > 0 ? last_page_rows : 1));
      continue;
    }
    const char* const first = source.base + b * source.entry_bytes + rows.first * source.row_bytes;
    tensormap_replace_address(map, rows.len > 0 ? first : source.base);
    tensormap_replace_dim<1>(map, static_cast<uint32_t>(max(rows.len, 1)));
  }
  fence_tensormap_release();
  if (prep.order == nullptr) return;

  const bool sorted = batch <= kMaxSortedSequences;
  if (sorted) {
    for (int b = threadIdx.x; b < batch; b += kThreads) keys[b] = sequence_rows(prep, false, b).len;
  }
  __syncthreads();
  // Rank (longest keys first, ties in packed order) and tile count of each sequence; tile_start[rank + 1] holds the
  // count until the prefix sum below.
  for (int b = threadIdx.x; b < batch; b += kThreads) {
    int rank = b;
    if (sorted) {
      const int key = keys[b];
      rank = 0;
      for (int other = 0; other < batch; ++other) {
        const int other_key = keys[other];
        rank += other_key > key || (other_key == key && other < b);
      }
    }
    prep.order[rank] = b;
    const int len_q = sequence_rows(prep, true, b).len;
    prep.tile_start[rank + 1] = sequence_m_blocks(len_q, prep.block_m) * prep.heads * prep.splits;
  }
  // tile_start: the exclusive prefix sum of the counts, each thread over a run of ranks.
  __syncthreads();
  const int per_thread = (batch + kThreads - 1) / kThreads;
  const int first = min(batch, static_cast<int>(threadIdx.x) * per_thread), last = min(batch, first + per_thread);
  int sum = 0;
  for (int r = first; r < last; ++r) sum += prep.tile_start[r + 1];
  int running = block_exclusive_sum(sum, warp_sums);
  if (threadIdx.x == 0) prep.tile_start[0] = 0;
  for (int r = first; r < last; ++r) {
    running += prep.tile_start[r + 1];
    prep.tile_start[r + 1] = running;
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace

cudaError_t prepare_sequences(const SequencesPrepParams& prep, const SeqMapTemplates& templates, cudaStream_t stream) {
  prepare_sequences_kernel<<<1, kThreads, 0, stream>>>(templates, prep);
  return cudaGetLastError();
}

}  // namespace flashattn::sm90
