// Packed sequences (varlen) on the device: which sequence and block a CTA's grid slot holds, found from cu_seqlens
// without any host read of them.
//
// Along the blocked dimension (queries in the forward, keys in the backward), sequence b owns the slots
// [cu[b] / block + b, cu[b + 1] / block + b + 1): at least its ceil(len / block) blocks (at most one slot stays idle),
// and total / block + batch slots cover every sequence. A CTA finds its sequence by a binary search over cu.
// Offsets are clamped into [0, total]: cu_seqlens that break their rules give wrong rows, never an access outside
// the tensors.
#pragma once

#include <cuda_runtime.h>

namespace flashattn {

// Slots of a packed grid, per head: `total` rows in `batch` sequences, `block` rows per slot.
__host__ __device__ inline int packed_slots(int total, int batch, int block) { return total / block + batch; }

// Ordered dQ: the first block of block_n keys that sees the query rows from m_start on (the key blocks that see them
// are consecutive from there); shift = Lk - Lq (a packed sequence's), left < 0: no left edge.
__host__ __device__ inline int first_key_block(int m_start, int shift, int left, int block_n) {
  const int first_key = m_start + shift - left;
  return left < 0 || first_key <= 0 ? 0 : first_key / block_n;
}

struct PackedBlock {
  int batch;             // the sequence
  int block;             // the block of rows inside it; block * block_rows >= len for an idle slot
  int row, len;          // the sequence's first row and length along the blocked dimension
  int other_row, other_len;  // ... and along the other one
};

#ifdef __CUDACC__
__device__ __forceinline__ int clamped_offset(const int* cu, int b, int total) {
  return min(max(__ldg(cu + b), 0), total);
}

// The block at `slot` of a packed grid over `cu` (total rows, block_rows per block); `cu_other` (total_other rows)
// gives the same sequence's rows of the other dimension.
__device__ __forceinline__ PackedBlock find_packed_block(const int* cu, int total, const int* cu_other,
                                                         int total_other, int batch, int block_rows, int slot) {
  int lo = 0, hi = batch - 1;  // the last sequence whose first slot is <= slot
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (clamped_offset(cu, mid, total) / block_rows + mid <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  PackedBlock b;
  b.batch = lo;
  b.row = clamped_offset(cu, lo, total);
  b.len = max(0, clamped_offset(cu, lo + 1, total) - b.row);
  b.block = slot - (b.row / block_rows + lo);
  b.other_row = clamped_offset(cu_other, lo, total_other);
  b.other_len = max(0, clamped_offset(cu_other, lo + 1, total_other) - b.other_row);
  return b;
}
#endif  // __CUDACC__

}  // namespace flashattn
