// The Hopper forward's mask: which key blocks a tile and a consumer's rows see (the n-block range) and which scores of
// a block are masked (the element mask). Bottom-right causal: query i sees key j iff j <= i + L_k - L_q.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.h"

namespace flashattn::sm90 {

template <typename Traits, bool kCausal>
struct FwdMask {
  // Key blocks 0 .. num_n_blocks - 1 hold every key that a row below m_end sees (none: 0 blocks).
  __device__ static int num_n_blocks(int m_end, const FwdParams& p) {
    const int n_end = kCausal ? max(0, min(p.len_k, m_end + p.len_k - p.len_q)) : p.len_k;
    return (n_end + Traits::kBlockN - 1) / Traits::kBlockN;
  }

  // The end of the blocks a consumer computes, from those of its tile (num_n_blocks, or its share n_end with stream-K):
  // where consumers skip the blocks past their rows, those its 64 rows see, at least block 0 (whose mask covers rows
  // that see no key).
  __device__ static int consumer_n_end(int m_start, int consumer, int causal_shift, int num_n_blocks, int n_end) {
    const int last_key_seen = m_start + 64 * consumer + 63 + causal_shift;
    return Traits::kSkipBlocksPastRows ? max(1, min(num_n_blocks, last_key_seen / Traits::kBlockN + 1)) : n_end;
  }

  // Whether the block starting at key n_start needs the element mask: it reaches past L_k, or (causal) past the
  // diagonal of the tile's first row (a row before 0 where tiles end at L_q: more blocks masked, never fewer).
  __device__ static bool needs_mask(int n_start, int m_start, int causal_shift, const FwdParams& p) {
    return n_start + Traits::kBlockN > p.len_k || (kCausal && n_start + Traits::kBlockN - 1 > m_start + causal_shift);
  }

  // The last key column each of the thread's two rows (row_in_tile, + 8) may see, relative to the block at n_start and
  // to the lane's first column (RowSoftmax::mask masks the columns past it).
  __device__ static void last_cols(int n_start, int m_start, int row_in_tile, int causal_shift, int lane,
                                   const FwdParams& p, int (&last_col)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int last = p.len_k - 1;
      if (kCausal) last = min(last, m_start + row_in_tile + 8 * h + causal_shift);
      last_col[h] = last - n_start - 2 * (lane % 4);
    }
  }
};

}  // namespace flashattn::sm90
