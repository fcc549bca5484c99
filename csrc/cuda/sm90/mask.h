// The Hopper kernels' masks. FwdMask: which key blocks a forward tile and a consumer's rows see (the n-block range)
// and which scores of a block are masked (the element mask). Bottom-right causal: query i sees key j iff
// j <= i + L_k - L_q. The options variants (Traits::kOptions) take a band instead: i + shift - left <= j <= i + shift +
// right (shift = L_k - L_q), right = -1 unbounded in the non-causal variant, left = -1 unbounded. L_q and L_k are the
// tile's (Tile::len_q, len_k): the call's, or its sequence's. fill_outside: the element mask of a band's edge block,
// forward and backward alike.
#pragma once

#include <cuda_runtime.h>

#include <climits>

#include "cuda/params.h"

namespace flashattn::sm90 {

// The bounds of a row's visible columns that cut into a block (warp-uniform bits): a band's edge block is cut by one,
// a block wider than the band or at L_q / L_k by both.
enum BandEdge : int { kLowEdge = 1, kHighEdge = 2 };

// Entries of an accumulator block in wgmma layout (x[4 j + 2 h + c]: the thread's row h, column 8 j + c counted from
// the lane's first) outside first[h] .. last[h] become `fill`, one comparison per entry and bound tested.
template <bool kLow, bool kHigh, int kRegs>
__device__ __forceinline__ void fill_outside_bounds(float (&x)[kRegs], const int (&first)[2], const int (&last)[2],
                                                    float fill) {
#pragma unroll
  for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = 8 * j + c;
        if ((kLow && col < first[h]) || (kHigh && col > last[h])) x[4 * j + 2 * h + c] = fill;
      }
    }
  }
}

// The same for the bounds named in `edges` (BandEdge bits; 0: nothing to do).
template <int kRegs>
__device__ __forceinline__ void fill_outside(float (&x)[kRegs], const int (&first)[2], const int (&last)[2], int edges,
                                             float fill) {
  if (edges == (kLowEdge | kHighEdge)) {
    fill_outside_bounds<true, true>(x, first, last, fill);
  } else if (edges == kLowEdge) {
    fill_outside_bounds<true, false>(x, first, last, fill);
  } else if (edges == kHighEdge) {
    fill_outside_bounds<false, true>(x, first, last, fill);
  }
}

// The backward's frame (S^T: the thread's keys key0 + 8 h are its rows h, a step's queries its columns): the columns
// each key sees, counted from the lane's first query (lane_query). A band's right edge (key > query + shift + right)
// bounds them from below; its left edge (key < query + shift - left), L_q and L_k from above. Terms grouped so that
// no sum leaves int for lengths below 2^31 (key - L_k <= 0, left <= L_k - 2, right <= L_q - 2).
__device__ __forceinline__ void band_query_cols(int key0, int lane_query, int left, int right, int len_q, int len_k,
                                                int (&first)[2], int (&last)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;  // key - shift = (key - L_k) + L_q
    first[h] = (right >= 0 ? max(0, (key - len_k) + (len_q - right)) : 0) - lane_query;
    last[h] = (key >= len_k ? -1 : left >= 0 ? len_q + min(-1, (key - len_k) + left) : len_q - 1) - lane_query;
  }
}

// The bounds that cut the backward step of queries m_start .. + kBlockM against keys n_start .. + kBlockN, in the
// backward's frame (BandEdge bits of band_query_cols' bounds; 0: no element mask): the band's right edge from below,
// its left edge, L_q and L_k from above.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int band_step_edges(int m_start, int n_start, int causal_shift, int left, int right,
                                               int len_q, int len_k) {
  const bool low = right >= 0 && n_start + kBlockN - 1 > m_start + causal_shift + right;
  const bool high = m_start + kBlockM > len_q || n_start + kBlockN > len_k ||
                    (left >= 0 && n_start < m_start + kBlockM - 1 + causal_shift - left);
  return (low ? kLowEdge : 0) | (high ? kHighEdge : 0);
}

template <typename Traits, bool kCausal>
struct FwdMask {
  __device__ static int left(const FwdParams& p) { return Traits::kOptions ? p.window_left : -1; }
  __device__ static int right(const FwdParams& p) { return kCausal ? (Traits::kOptions ? p.window_right : 0) : -1; }

  // Key blocks n_first(m_first) .. num_n_blocks(m_end) - 1 hold every key that the rows m_first .. m_end - 1 see.
  __device__ static int num_n_blocks(int m_end, int len_q, int len_k, const FwdParams& p) {
    const int n_end = right(p) < 0 ? len_k : max(0, min(len_k, m_end + len_k - len_q + right(p)));
    return (n_end + Traits::kBlockN - 1) / Traits::kBlockN;
  }
  __device__ static int n_first(int m_first, int len_q, int len_k, const FwdParams& p) {
    return left(p) < 0 ? 0 : min(len_k, max(0, m_first + len_k - len_q - left(p))) / Traits::kBlockN;
  }

  // The end of the blocks a consumer computes, from those of its tile (num_n_blocks, or its share n_end with stream-K):
  // where consumers skip the blocks past their rows, those its 64 rows see, at least the tile's first block (whose
  // mask covers rows that see no key).
  __device__ static int consumer_n_end(int m_start, int consumer, int causal_shift, int n_begin, int num_n_blocks,
                                       int n_end, const FwdParams& p) {
    const int last_key_seen = m_start + 64 * consumer + 63 + causal_shift + (Traits::kOptions ? right(p) : 0);
    const int first_end = Traits::kOptions ? n_begin + 1 : 1;
    return Traits::kSkipBlocksPastRows ? max(first_end, min(num_n_blocks, last_key_seen / Traits::kBlockN + 1))
                                       : n_end;
  }

  // The bounds that cut the block starting at key n_start (BandEdge bits; 0: no element mask): L_k or the right edge of
  // the tile's first row from above, the left edge of its last row from below (rows before 0 or past L_q: more blocks
  // masked, never fewer).
  __device__ static int edges(int n_start, int m_start, int causal_shift, int len_k, const FwdParams& p) {
    const bool high = n_start + Traits::kBlockN > len_k ||
                      (right(p) >= 0 && n_start + Traits::kBlockN - 1 > m_start + causal_shift + right(p));
    const bool low = left(p) >= 0 && n_start < m_start + Traits::kBlockM - 1 + causal_shift - left(p);
    return (low ? kLowEdge : 0) | (high ? kHighEdge : 0);
  }

  // The first and last key column each of the thread's two rows (row_in_tile, + 8) may see, relative to the block at
  // n_start and to the lane's first column (RowSoftmax::mask masks the columns outside them).
  __device__ static void cols(int n_start, int m_start, int row_in_tile, int causal_shift, int len_k, int lane,
                              const FwdParams& p, int (&first_col)[2], int (&last_col)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int diagonal = m_start + row_in_tile + 8 * h + causal_shift;
      int last = len_k - 1;
      if (right(p) >= 0) last = min(last, diagonal + right(p));
      last_col[h] = last - n_start - 2 * (lane % 4);
      first_col[h] = left(p) < 0 ? INT_MIN : diagonal - left(p) - n_start - 2 * (lane % 4);
    }
  }
};

}  // namespace flashattn::sm90
