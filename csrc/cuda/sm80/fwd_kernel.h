// Portable FlashAttention-2 forward (sm_80 and newer): mma.sync m16n8k16, ldmatrix, cp.async double buffering (fewer
// K/V tiles where a GPU's CTAs have less shared memory).
//
// One CTA computes a kBlockM x D block of the output for one (batch, head). Its Q block stays in shared memory;
// the CTA walks the K/V blocks the block can see, and each warp keeps the online-softmax state (running max,
// running sum, fp32 output accumulator) of its own 16 * kMTiles query rows in registers. Normalisation is
// deferred to the end. K/V tiles past the sequence end or head dim are zero-filled by cp.async, so only the
// blocks that cross the sequence end or the causal diagonal pay for masking. The options variant (kOptions) adds the
// band of a sliding window (key blocks outside it never loaded, only its edge blocks masked), softcap and sinks; the
// sequences variant (kSequences) adds packed sequences and KV caches to it. Softcap is a kernel of its own
// (kSoftcap, picked on the host): its path in the window kernel cost that kernel 1.6% forward, 2.5% backward.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "cuda/launchers.h"
#include "cuda/packed.h"
#include "cuda/params.h"
#include "cuda/row_epilogue.h"
#include "cuda/sm80/ptx.h"
#include "cuda/sm80/tile_io.h"
#include "cuda/sm80/tile_size.h"

namespace flashattn::sm80 {

template <int HeadDim>
struct FwdTraits {
  static constexpr FwdTileShape kShape = fwd_tile_shape(HeadDim);
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kNWarps = kShape.warps;
  static constexpr int kMTiles = kShape.block_m / (16 * kNWarps);
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockM = kShape.block_m;
  static constexpr int kBlockN = kShape.block_n;
  static constexpr int kSmemStride = kShape.smem_stride;
  static constexpr int kSmemQ = kBlockM * kSmemStride;
  static constexpr int kSmemKV = kBlockN * kSmemStride;
  // Two CTAs per SM where registers (<= 255 per thread for 128 threads) and shared memory allow it.
  static constexpr int kMinBlocksPerSM = kNWarps == 4 ? 2 : 1;

  static_assert(HeadDim % 32 == 0 && HeadDim <= 256, "head-dim buckets are multiples of 32 up to 256");
  static_assert(kMTiles * 16 * kNWarps == kBlockM, "a warp owns whole m16 tiles");
};

// Writes a finished output row range; `rows` rows of the warp, staged in shared memory, 16 bytes per store.
template <typename T, typename Traits>
__device__ __forceinline__ void store_rows(T* gmem, int64_t row_stride, const T* smem, int row0, int rows,
                                           int num_rows, int head_dim, int lane) {
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  for (int chunk = lane; chunk < rows * kChunksPerRow; chunk += 32) {
    const int row = chunk / kChunksPerRow;
    const int col = (chunk % kChunksPerRow) * 8;
    if (row0 + row < num_rows && col < head_dim) {
      *reinterpret_cast<uint4*>(gmem + static_cast<int64_t>(row0 + row) * row_stride + col) =
          *reinterpret_cast<const uint4*>(smem + row * Traits::kSmemStride + col);
    }
  }
}

template <typename T, typename Traits, bool kCausal, bool kOptions, bool kSequences, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSM)
    flash_fwd_kernel(const __grid_constant__ FwdParams p) {
  static_assert(!(kCausal && kOptions), "the options variant carries causal in its band");
  static_assert(kOptions || !kSequences, "per-sequence lengths come with the options variant");
  static_assert(kOptions || !kSoftcap, "softcap is an option");
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kStride = Traits::kSmemStride;
  constexpr int kDTiles = kHeadDim / 8;  // n8 tiles of the output accumulator
  constexpr int kNTiles = kBlockN / 8;   // n8 tiles of the score block

  // The plan's K/V tiles (as many as the device's CTAs may have, sm80/tile_size.h): 4, K and V double-buffered, block
  // j + 1 loading under block j; 2, one tile of each, V_j loading under S = Q K_j^T and K_j+1 under P V_j; 1, K_j then
  // V_j in one tile, only the softmax hiding a load.
  const int kv_tiles = fwd_always_four_tiles(kHeadDim) ? 4 : p.plan.kv_tiles;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const sQ = reinterpret_cast<T*>(smem_raw);
  T* const sK = sQ + Traits::kSmemQ;                         // [kv_tiles == 4 ? 2 : 1][kBlockN][kStride]
  T* const sV = sK + (kv_tiles / 2) * Traits::kSmemKV;       // the same shape (kv_tiles 1: sK itself)

  // Block order: query blocks fastest, so CTAs running together share one head's K/V in L2. Causal runs the
  // longest query blocks (the last ones) first so that the short ones fill the tail of the grid. The sequences
  // variant (kSequences; the others carry none of it) also takes packed sequences: the slots of every sequence
  // (packed.h) fastest, then heads, the sequence's rows starting at row_q / row_k; and a KV cache: each batch entry's
  // valid keys (FwdParams::seqlens_k), from its left padding (leftpad_k: row_k), in pages (block_table) or not.
  const bool packed = kSequences && p.cu_seqlens_q != nullptr;
  const bool paged = kSequences && p.block_table != nullptr;
  int m_block, head, batch, seq_len_q = p.len_q, seq_len_k = p.len_k, row_q = 0, row_k = 0;
  // The lengths: the params' (read where used), or with kSequences the sequence's.
  const auto len_q = [&] { return kSequences ? seq_len_q : p.len_q; };
  const auto len_k = [&] { return kSequences ? seq_len_k : p.len_k; };
  if (!packed) {
    const int num_m_blocks = (p.len_q + kBlockM - 1) / kBlockM;
    const int m_index = blockIdx.x % num_m_blocks;
    m_block = kCausal ? num_m_blocks - 1 - m_index : m_index;
    head = (blockIdx.x / num_m_blocks) % p.heads;
    batch = blockIdx.x / num_m_blocks / p.heads;
    if (kSequences && (p.seqlens_k != nullptr || p.leftpad_k != nullptr)) {
      const EntryKeys keys = entry_keys(p, batch);
      seq_len_k = keys.len, row_k = keys.first;
    }
  } else {
    const int num_slots = packed_slots(p.len_q, p.batch, kBlockM);
    const int index = blockIdx.x % num_slots;
    head = blockIdx.x / num_slots;
    const PackedBlock b = find_packed_block(p.cu_seqlens_q, p.len_q, p.cu_seqlens_k, p.len_k, p.batch, kBlockM,
                                            index);
    if (b.block < 0 || b.block * kBlockM >= b.len) return;  // an idle slot (or cu_seqlens that break their rules)
    batch = 0, m_block = b.block, seq_len_q = b.len, seq_len_k = b.other_len, row_q = b.row, row_k = b.other_row;
  }
  const int kv_head = head / p.heads_per_kv;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int m_start = m_block * kBlockM;
  const int m_end = min(m_start + kBlockM, len_q());
  const int causal_shift = len_k() - len_q();  // query i sees keys j <= i + causal_shift
  const int left = kOptions ? p.window_left : -1;
  const int right = kCausal ? 0 : kOptions ? p.window_right : -1;

  // Keys this block can see: [n_begin, n_end), in key blocks first_n_block .. num_n_blocks - 1.
  const int n_begin = left < 0 ? 0 : min(len_k(), max(0, m_start + causal_shift - left));
  const int n_end = right < 0 ? len_k() : max(0, min(len_k(), m_end + causal_shift + right));
  const int first_n_block = n_begin / kBlockN;
  const int num_n_blocks = kOptions && n_end <= n_begin ? first_n_block : (n_end + kBlockN - 1) / kBlockN;

  const T* q_base = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                    static_cast<int64_t>(row_q) * p.q_row_stride;
  // A paged cache's batch stride is its page stride: its rows are found through the block table instead.
  const T* k_base = static_cast<const T*>(p.k) + (paged ? 0 : batch) * p.k_batch_stride + kv_head * p.k_head_stride +
                    static_cast<int64_t>(row_k) * p.k_row_stride;
  const T* v_base = static_cast<const T*>(p.v) + (paged ? 0 : batch) * p.v_batch_stride + kv_head * p.v_head_stride +
                    static_cast<int64_t>(row_k) * p.v_row_stride;
  // K or V rows start .. start + kBlockN - 1 (those at n_end and past zero-filled) into a tile.
  const auto load_rows = [&](T* tile, const T* base, int64_t page_stride, int64_t row_stride, int start) {
    if (paged) {
      const PagedRows rows{p.block_table + static_cast<int64_t>(batch) * p.block_table_stride, p.page_size,
                           p.num_pages};
      load_paged_tile_async<T, Traits, kBlockN>(tile, base, page_stride, row_stride, rows, start, n_end, p.head_dim);
    } else {
      load_tile_async<T, Traits, kBlockN>(tile, base, row_stride, start, n_end, p.head_dim);
    }
  };
  const auto load_k = [&](int stage, int start) {
    load_rows(sK + stage * Traits::kSmemKV, k_base, p.k_batch_stride, p.k_row_stride, start);
  };
  const auto load_v = [&](int stage, int start) {
    load_rows(sV + stage * Traits::kSmemKV, v_base, p.v_batch_stride, p.v_row_stride, start);
  };
  T* o_base = static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride +
              static_cast<int64_t>(row_q) * p.o_row_stride;
  float* lse_base = p.lse + (static_cast<int64_t>(batch) * p.heads + head) * p.len_q + row_q;

  // Prologue: {Q, K0, and with 4 tiles V0} in flight. Each iteration then waits for block j, and one barrier both
  // publishes it and proves every warp is done with block j - 1, whose stage (4 tiles) receives block j + 1 at once.
  // One barrier per block lets warps drift apart, so one warp's softmax runs under another's MMAs. Two tiles take a
  // second (V_j landed, every warp done with K_j); one tile three more (done with K_j; V_j landed; done with V_j).
  load_tile_async<T, Traits, kBlockM>(sQ, q_base, p.q_row_stride, m_start, len_q(), p.head_dim);
  if (num_n_blocks > first_n_block) {
    load_k(0, first_n_block * kBlockN);
    if (kv_tiles == 4) load_v(0, first_n_block * kBlockN);
  }
  cp_async_commit();

  // Per-thread state. Fragment rows: lane / 4 and lane / 4 + 8 of each m16 tile; columns 2 * (lane % 4) + {0, 1}
  // of each n8 tile. row_max holds raw scores (sign-corrected, see the mask step); exp2 works in log2 units.
  float acc_o[kMTiles][kDTiles][4];
  float row_max[kMTiles][2];
  float row_sum[kMTiles][2];  // partial: this thread's columns only, reduced across the quad at the end
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;
    }
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  const int warp_row0 = warp * kMTiles * 16;  // first row of this warp inside the block
  // ldmatrix row addresses: A fragments (Q) take rows lane % 16, column half lane / 16; B fragments of K take
  // rows (lane / 16) * 8 + lane % 8 (two n8 tiles), column half (lane / 8) % 2; V (transposed) takes rows
  // ((lane / 8) % 2) * 8 + lane % 8 and column half lane / 16.
  const T* q_frag_row = sQ + (warp_row0 + lane % 16) * kStride + (lane / 16) * 8;
  const int k_frag_offset = ((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8;
  const int v_frag_offset = (((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8;

  // With softcap the scores become tanh(scale * q·k / softcap), and the softmax takes them times softcap (> 0).
  const float cap_scale = kSoftcap ? p.scale / p.softcap : 0.f;
  const bool negate = !kSoftcap && p.scale_log2 < 0.f;
  const float scale_log2 = kSoftcap ? p.softcap * 1.4426950408889634f : fabsf(p.scale_log2);

  for (int n_block = first_n_block; n_block < num_n_blocks; ++n_block) {
    const int stage = kv_tiles == 4 ? (n_block - first_n_block) % 2 : 0;
    const T* sK_stage = sK + stage * Traits::kSmemKV;
    const T* sV_stage = sV + stage * Traits::kSmemKV;
    const int n_start = n_block * kBlockN;
    const bool next = n_block + 1 < num_n_blocks;

    cp_async_wait<0>();  // K_j (4 tiles: and V_j) has landed (this thread's copies)...
    __syncthreads();     // ...and everyone's; 4 tiles: stage `stage ^ 1` is free again; 2: V's tile is
    if (kv_tiles == 4 && next) {
      load_k(stage ^ 1, n_start + kBlockN);
      load_v(stage ^ 1, n_start + kBlockN);
    }
    if (kv_tiles == 2) load_v(0, n_start);
    cp_async_commit();

    // S = Q · K_jᵀ
    float acc_s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[mt][nt][i] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], q_frag_row + mt * 16 * kStride + kk * 16);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, sK_stage + k_frag_offset + np * 16 * kStride + kk * 16);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(acc_s[mt][2 * np], a[mt], b[0], b[1]);
          mma_16816<T>(acc_s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    if (kv_tiles == 1) {  // every warp is done with K_j: V_j takes its tile
      __syncthreads();
      load_v(0, n_start);
      cp_async_commit();
    }

    if constexpr (kSoftcap) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc_s[mt][nt][i] = fast_tanh(acc_s[mt][nt][i] * cap_scale);
        }
      }
    }
    // Mask keys past the end and, on the band's edges (the causal diagonal), keys outside each query's range. The
    // scale is applied inside the exp2 below (one FFMA per score); a negative scale is handled by negating the scores
    // here, so the row maxima below are always maxima of scale * score.
    const bool needs_mask = n_start + kBlockN > len_k() ||
                            (right >= 0 && n_start + kBlockN - 1 > m_start + causal_shift + right) ||
                            (left >= 0 && n_start < m_start + kBlockM - 1 + causal_shift - left);
    if (needs_mask || negate) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          // The keys this row may see, relative to this thread's first column in the block.
          const int row = m_start + warp_row0 + mt * 16 + lane / 4 + half * 8;
          int last_col = len_k() - 1;
          if (right >= 0) last_col = min(last_col, row + causal_shift + right);
          last_col -= n_start + 2 * (lane % 4);
          const int first_col = left < 0 ? INT_MIN : row + causal_shift - left - n_start - 2 * (lane % 4);
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& s = acc_s[mt][nt][2 * half + c];
              if (negate) s = -s;
              if (nt * 8 + c > last_col || (kOptions && nt * 8 + c < first_col)) s = -INFINITY;
            }
          }
        }
      }
    }
    // Online softmax: new running max, rescale of the old state, P = exp2(S - max) packed to T at once (half
    // the registers of the fp32 scores; the packed pairs are already in the A-fragment layout of P·V).
    uint32_t p_frag[kMTiles][kNTiles][2];
    float rescale[kMTiles][2];
    bool max_moved = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float block_max = row_max[mt][half];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          block_max = fmaxf(block_max, fmaxf(acc_s[mt][nt][2 * half], acc_s[mt][nt][2 * half + 1]));
        }
        block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 1));
        block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 2));
        // Maxima are of raw scores; `base` is in log2 units. A row with no visible key so far keeps max = -inf;
        // subtracting 0 instead keeps exp2 at 0, not NaN.
        const float base = block_max == -INFINITY ? 0.f : block_max * scale_log2;
        rescale[mt][half] = fast_exp2(row_max[mt][half] * scale_log2 - base);
        max_moved |= block_max != row_max[mt][half];
        row_max[mt][half] = block_max;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const float p0 = fast_exp2(fmaf(acc_s[mt][nt][2 * half], scale_log2, -base));
          const float p1 = fast_exp2(fmaf(acc_s[mt][nt][2 * half + 1], scale_log2, -base));
          p_frag[mt][nt][half] = pack2<T>(p0, p1);
          sum += p0 + p1;
        }
        row_sum[mt][half] = row_sum[mt][half] * rescale[mt][half] + sum;
      }
    }
    // Once the running maxima settle (most blocks of a long row), no row of the warp moves and the rescale of
    // the accumulator, the largest ALU cost of the loop, is skipped.
    if (__any_sync(0xffffffff, max_moved)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] *= rescale[mt][i / 2];
        }
      }
    }

    if (kv_tiles != 4) {
      cp_async_wait<0>();  // V_j has landed (this thread's copies)...
      __syncthreads();     // ...and everyone's; 2 tiles: every warp is done with K_j, whose tile takes K_j+1
      if (kv_tiles == 2 && next) load_k(0, n_start + kBlockN);
      cp_async_commit();
    }

    // O += P · V_j
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a[mt][0] = p_frag[mt][2 * kk][0];
        a[mt][1] = p_frag[mt][2 * kk][1];
        a[mt][2] = p_frag[mt][2 * kk + 1][0];
        a[mt][3] = p_frag[mt][2 * kk + 1][1];
      }
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sV_stage + v_frag_offset + kk * 16 * kStride + dp * 16);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(acc_o[mt][2 * dp], a[mt], b[0], b[1]);
          mma_16816<T>(acc_o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
    if (kv_tiles == 1 && next) {  // every warp is done with V_j: K_j+1 takes the tile
      __syncthreads();
      load_k(0, n_start + kBlockN);
      cp_async_commit();
    }
  }
  // Only matters when the block sees no key: the loop never waited, and other warps' copies into sQ, which the
  // epilogue reuses, may still be in flight.
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: finish the row sums, normalise, write lse; stage O in this warp's own rows of sQ (only this warp
  // ever read them) and store it with 16-byte writes.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[mt][half];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const int row = m_start + warp_row0 + mt * 16 + lane / 4 + half * 8;
      const bool sees_keys = kOptions ? row_sees_band(row, causal_shift, left, right, len_k())
                                      : row_sees_keys<kCausal>(row, causal_shift);
      float base = row_max[mt][half] * scale_log2;
      float keep = 1.f;
      if (kOptions && p.sinks != nullptr) keep = add_sink(p.sinks[head], base, sum);
      const float inv = sees_keys ? (kOptions ? keep / sum : 1.f / sum) : 0.f;  // a row without keys: out = 0
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc_o[mt][dt][2 * half] *= inv;
        acc_o[mt][dt][2 * half + 1] *= inv;
      }
      if (lane % 4 == 0 && row < len_q()) {
        const bool sink_lse = kOptions && p.sinks != nullptr && lse_is_sink(sees_keys, keep, sum);
        lse_base[row] = sink_lse ? p.sinks[head] : row_lse(sees_keys, base, sum);
      }
    }
  }
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      T* dst = sQ + (warp_row0 + mt * 16 + lane / 4) * kStride + dt * 8 + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(dst) = pack2<T>(acc_o[mt][dt][0], acc_o[mt][dt][1]);
      *reinterpret_cast<uint32_t*>(dst + 8 * kStride) = pack2<T>(acc_o[mt][dt][2], acc_o[mt][dt][3]);
    }
  }
  __syncwarp();
  store_rows<T, Traits>(o_base, p.o_row_stride, sQ + warp_row0 * kStride, m_start + warp_row0, kMTiles * 16,
                        len_q(), p.head_dim, lane);
}

// Launches the forward on `stream`; returns the first CUDA error (attribute or launch), never synchronises.
template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_fwd_sm80(const FwdParams& params, cudaStream_t stream) {
  using Traits = FwdTraits<HeadDim>;
  static_assert(sizeof(T) == 2, "fwd_smem_bytes counts 2-byte elements");
  auto kernel = flash_fwd_kernel<T, Traits, kCausal, kOptions, kSequences, false>;
  if constexpr (kOptions) {
    if (params.softcap > 0.f) kernel = flash_fwd_kernel<T, Traits, kCausal, kOptions, kSequences, true>;
  }
  const int kv_tiles = params.plan.kv_tiles;
  if (kv_tiles != 4 && kv_tiles != 2 && kv_tiles != 1) return cudaErrorInvalidValue;
  const int smem_bytes = fwd_smem_bytes(HeadDim, kv_tiles);
  if (smem_bytes > 48 * 1024) {
    if (const cudaError_t err = allow_dynamic_smem(kernel, smem_bytes); err != cudaSuccess) return err;
  }
  const int64_t num_m_blocks = (params.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t blocks = !kSequences || params.cu_seqlens_q == nullptr
                             ? num_m_blocks * params.heads * params.batch
                             : static_cast<int64_t>(packed_slots(params.len_q, params.batch, Traits::kBlockM)) *
                                   params.heads;
  const dim3 grid(static_cast<unsigned>(blocks));
  kernel<<<grid, Traits::kNThreads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flashattn::sm80
