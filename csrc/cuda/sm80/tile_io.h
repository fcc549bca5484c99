// Global -> shared tile copies shared by the sm80 kernels. A Traits type provides kHeadDim, kNThreads and
// kSmemStride (the padded row length of shared tiles, in elements).
#pragma once

#include <cstdint>

#include "cuda/sm80/ptx.h"

namespace flashattn::sm80 {

// Copies rows [row0, row0 + kRows) of a (L, D) slice (row stride in elements) into a padded shared tile.
// Rows >= num_rows and columns >= head_dim are zero-filled. Each thread owns one 16-byte column chunk and
// walks down the rows, so its addresses are one base plus a fixed step (few registers held across the loop).
template <typename T, typename Traits, int kRows>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride, int row0, int num_rows,
                                                int head_dim) {
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  constexpr int kRowsPerStep = Traits::kNThreads / kChunksPerRow;  // threads past the last full row idle
  constexpr int kSteps = (kRows + kRowsPerStep - 1) / kRowsPerStep;
  const int row = threadIdx.x / kChunksPerRow;
  const int col = (threadIdx.x % kChunksPerRow) * 8;
  if (row >= kRowsPerStep) return;
  const bool col_valid = col < head_dim;
  const T* src = gmem + static_cast<int64_t>(row0 + row) * row_stride + col;
  T* dst = smem + row * Traits::kSmemStride + col;
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int r = row + step * kRowsPerStep;
    if (kRows % kRowsPerStep == 0 || r < kRows) {
      const bool valid = col_valid && row0 + r < num_rows;
      cp_async_16(dst + step * kRowsPerStep * Traits::kSmemStride,
                  valid ? src + static_cast<int64_t>(step * kRowsPerStep) * row_stride : gmem, valid);
    }
  }
}

// Where the rows of one batch entry of a paged cache lie: row r in page pages[r / page_size] (clamped into the
// num_pages of the cache, so a bad block table gives wrong rows, never an access outside it), at row r % page_size.
struct PagedRows {
  const int* pages;
  int page_size, num_pages;
};

// load_tile_async from a paged cache: `gmem` is the kv head's rows in page 0, `page_stride` the distance between pages.
template <typename T, typename Traits, int kRows>
__device__ __forceinline__ void load_paged_tile_async(T* smem, const T* gmem, int64_t page_stride, int64_t row_stride,
                                                      const PagedRows& rows, int row0, int num_rows, int head_dim) {
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  constexpr int kRowsPerStep = Traits::kNThreads / kChunksPerRow;
  constexpr int kSteps = (kRows + kRowsPerStep - 1) / kRowsPerStep;
  const int row = threadIdx.x / kChunksPerRow;
  const int col = (threadIdx.x % kChunksPerRow) * 8;
  if (row >= kRowsPerStep) return;
  const bool col_valid = col < head_dim;
  T* dst = smem + row * Traits::kSmemStride + col;
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int r = row + step * kRowsPerStep;
    if (kRows % kRowsPerStep == 0 || r < kRows) {
      const int cache_row = row0 + r;
      const bool valid = col_valid && cache_row < num_rows;
      const T* src = gmem;
      if (valid) {
        const int page = min(max(__ldg(rows.pages + cache_row / rows.page_size), 0), rows.num_pages - 1);
        src = gmem + page * page_stride + static_cast<int64_t>(cache_row % rows.page_size) * row_stride + col;
      }
      cp_async_16(dst + step * kRowsPerStep * Traits::kSmemStride, src, valid);
    }
  }
}

}  // namespace flashattn::sm80
