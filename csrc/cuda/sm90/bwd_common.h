// Pieces shared by the Hopper backward kernels (bwd_kernel.h for head dims up to 128, bwd_split_kernel.h for 256).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sm80/ptx.h"  // pack2

namespace flashattn::sm90 {

// Accumulator (64 rows x kCols) -> wgmma A fragments for k16 steps along its columns (as the forward packs P).
template <typename T, int kCols>
__device__ __forceinline__ void pack_a(uint32_t (&a)[kCols / 16][4], const float (&acc)[kCols / 2]) {
#pragma unroll
  for (int kk = 0; kk < kCols / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = sm80::pack2<T>(acc[8 * kk + 2 * i], acc[8 * kk + 2 * i + 1]);
  }
}

// The wgmma accumulator of 64 x kBlockM (rows = this thread's keys, columns = queries) into a [64][kBlockM] tile in
// the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), 4-byte stores of column pairs.
template <typename T, int kBlockM>
__device__ __forceinline__ void store_swizzled_tile(T* tile, const float (&acc)[kBlockM / 2], int warp, int lane) {
  static_assert(kBlockM == 64, "one 128-byte swizzle row per tile row");
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * warp + lane / 4 + 8 * h;  // columns 8 j + 2 (lane % 4): chunk j, 2 (lane % 4) inside it
      *reinterpret_cast<uint32_t*>(tile + row * 64 + ((j ^ (row % 8)) * 8) + 2 * (lane % 4)) =
          sm80::pack2<T>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

}  // namespace flashattn::sm90
