// Split-KV decode forward (sm_80 and newer, Hopper included): a few query rows against a long key sequence or KV
// cache, where the time is the read of K and V.
//
// CTA = (key split, kv head x 16-row group, batch entry). Its 16 rows are the query rows of the kv head's query heads
// packed together (row r: query r % Lq of query head kv_head * G + r / Lq, G = heads_per_kv), so that one read of a
// K/V byte serves all of them. The CTA walks its split's 64-key blocks through a kStages-deep cp.async ring (dense
// rows, or the pages of the block table); each of the 4 warps takes 16 keys of every block with its own online softmax
// (mma.sync m16n8k16), and the warps merge through shared memory at each split's end. With one split the CTA writes
// out and lse. With more, either a CTA per split writes its rows' normalised fp32 part and lse, which decode_combine.cu
// folds in split order, or (plan.splits_in_turn, where the row groups alone fill the GPU) one CTA runs every split of
// its rows in turn and folds the parts itself, with the same arithmetic (row_epilogue.h: SplitFold). Every row's bits
// depend on its own inputs, the split count and nothing else in the batch.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <cmath>

#include "cuda/decode.h"
#include "cuda/launchers.h"
#include "cuda/params.h"
#include "cuda/row_epilogue.h"
#include "cuda/sm80/ptx.h"

namespace flashattn::sm80 {

template <int HeadDim>
struct DecodeTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kRows = kDecodeRows;  // query rows per CTA: one m16 tile, shared by the warps
  static constexpr int kNWarps = kDecodeWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockN = kDecodeBlockN;  // keys per stage: 16 per warp
  static constexpr int kStages = decode_stages(HeadDim);
  // Tile rows are whole 128-byte lines, their 16-byte chunks swizzled (chunk c of row r at c ^ (r % 8)): ldmatrix is
  // conflict-free, and each 128-byte line of global memory lands in one line of shared memory, so that its cp.async is
  // one L2 request (with padded rows, lines straddled two and the L2 served 1.5x the bytes read).
  static constexpr int kSmemStride = HeadDim;
  // Element offset of 16-byte chunk `chunk` of row `row` in a tile.
  __device__ static constexpr int offset(int row, int chunk) { return row * kSmemStride + (chunk ^ (row % 8)) * 8; }
  static constexpr int kSmemQ = kRows * kSmemStride;
  static constexpr int kSmemKV = kBlockN * kSmemStride;
  // The warps' merge at a split's end borrows the ring stage of the split's last block (warps 0, 1 its K tile, 2, 3
  // its V tile: their fp32 output rows); after the ring, the row maxima and sums, then the parts folded so far (fp32
  // rows: in registers they made the D256 kernel spill).
  static constexpr int kMergeStats = 2 * kNWarps * kRows;
  static constexpr int kFoldFloats = kRows * kHeadDim;
  template <typename T>
  static constexpr int smem_bytes() {
    constexpr int kBytes = (kSmemQ + 2 * kStages * kSmemKV) * sizeof(T) + (kMergeStats + kFoldFloats) * sizeof(float);
    static_assert(kBytes == decode_smem_bytes(HeadDim), "the plan's figure (decode.h)");
    return kBytes;
  }
  template <typename T>
  static constexpr bool merge_fits() {
    return 2 * kRows * kHeadDim * static_cast<int>(sizeof(float)) <= kSmemKV * static_cast<int>(sizeof(T));
  }
  static_assert(HeadDim % 64 == 0 && HeadDim <= 256, "decode head dims are 64, 128, 256: rows of whole 128-byte lines");
};

template <typename T, typename Traits, bool kPaged>
__global__ void __launch_bounds__(Traits::kNThreads) flash_decode_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kStride = Traits::kSmemStride;
  constexpr int kRows = Traits::kRows;
  constexpr int kDTiles = kHeadDim / 8;
  static_assert(Traits::template merge_fits<T>(), "two warps' rows fit in a K or V tile");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const sQ = reinterpret_cast<T*>(smem_raw);
  T* const sK = sQ + Traits::kSmemQ;             // [kStages][kBlockN][kStride]
  T* const sV = sK + kStages * Traits::kSmemKV;  // [kStages][kBlockN][kStride]

  allow_dependents();  // the combine's CTAs may take the SMs this grid leaves; they wait for its parts
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool in_turn = p.plan.splits_in_turn;
  const int group_rows = p.heads_per_kv * p.len_q;  // the kv head's packed query rows
  const int row_groups = decode_row_groups(p.heads_per_kv, p.len_q);
  const int kv_head = blockIdx.y / row_groups;
  const int row0 = (blockIdx.y % row_groups) * kRows;
  const int split_ctas = decode_split_ctas(p.plan);
  const int split = blockIdx.x % split_ctas;
  const int batch = blockIdx.x / split_ctas * gridDim.z + blockIdx.z;
  if (batch >= p.batch) return;  // past the batch in its last chunk

  // This entry's keys, from its left padding (a dense cache's), and those some query of it can see:
  // [n_lo, n_hi). The band is the params' (causal folded in as right = 0); its bounds for the queries 0 .. Lq - 1 of
  // every head.
  const EntryKeys keys = kPaged ? EntryKeys{0, entry_len_k(p, batch)} : entry_keys(p, batch);  // pages: no padding
  const int len_k = keys.len;
  const int64_t first_row = keys.first;
  const int shift = len_k - p.len_q;
  const int left = p.window_left, right = p.window_right;
  const int n_lo = left < 0 ? 0 : min(len_k, max(0, shift - left));
  const int n_hi = right < 0 ? len_k : max(n_lo, min(len_k, p.len_q - 1 + shift + right + 1));
  // The splits: the entry's blocks in plan.splits equal runs. The CTA's blocks: one split's, or all of them in turn.
  const int num_blocks = (n_hi - n_lo + kBlockN - 1) / kBlockN;
  const int per_split = (num_blocks + p.plan.splits - 1) / p.plan.splits;
  const int b_begin = in_turn ? 0 : min(num_blocks, split * per_split);
  const int b_end = in_turn ? num_blocks : min(num_blocks, b_begin + per_split);

  // A packed row's query head and query.
  const auto head_of = [&](int r) { return kv_head * p.heads_per_kv + r / p.len_q; };
  const auto query_of = [&](int r) { return r % p.len_q; };

  // Q rows (zero past the group's rows and the head dim), then the ring's first kStages - 1 blocks.
  {
    constexpr int kChunks = kHeadDim / 8;
    for (int chunk = threadIdx.x; chunk < kRows * kChunks; chunk += Traits::kNThreads) {
      const int r = chunk / kChunks, col = (chunk % kChunks) * 8;
      const bool valid = row0 + r < group_rows && col < p.head_dim;
      const T* src = static_cast<const T*>(p.q);
      if (valid) {
        src += batch * p.q_batch_stride + head_of(row0 + r) * p.q_head_stride +
               static_cast<int64_t>(query_of(row0 + r)) * p.q_row_stride + col;
      }
      cp_async_16(sQ + Traits::offset(r, col / 8), src, valid);
    }
  }
  // A paged cache's batch stride is its page stride: its rows are found through the block table.
  const T* const k_base = static_cast<const T*>(p.k) + (kPaged ? 0 : batch * p.k_batch_stride) +
                          kv_head * p.k_head_stride + first_row * p.k_row_stride;
  const T* const v_base = static_cast<const T*>(p.v) + (kPaged ? 0 : batch * p.v_batch_stride) +
                          kv_head * p.v_head_stride + first_row * p.v_row_stride;
  // This thread copies one 16-byte column chunk of kKvSteps rows of each block: in a dense cache rows kRowsPerStep
  // apart, in a paged one consecutive rows, so that they lie in one page wherever the pages are a multiple of kKvSteps
  // rows and the band starts at such a row (at D128: pages of a multiple of 8 rows). Paged: the pages are read from the
  // block table a block ahead of the copies (clamped into the cache: a bad table gives wrong rows, never an access
  // outside it), so that no copy waits for the table; where this thread's rows lie in one page, that is one entry a
  // block and the rows are reached by pointer steps as in a dense cache, otherwise each row has its own entry.
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerStep = Traits::kNThreads / kChunksPerRow;
  constexpr int kKvSteps = kBlockN / kRowsPerStep;
  static_assert(kRowsPerStep * kChunksPerRow == Traits::kNThreads && kBlockN % kRowsPerStep == 0, "whole rows");
  constexpr int kRowStep = kPaged ? 1 : kRowsPerStep;  // between this thread's rows
  const int kv_col = (threadIdx.x % kChunksPerRow) * 8;
  const int kv_row = threadIdx.x / kChunksPerRow * (kPaged ? kKvSteps : 1);  // this thread's first row in a block
  const int64_t k_step = kRowStep * p.k_row_stride, v_step = kRowStep * p.v_row_stride;
  const int* const table = kPaged ? p.block_table + static_cast<int64_t>(batch) * p.block_table_stride : nullptr;
  const bool rows_in_page = kPaged && p.page_size % kKvSteps == 0 && n_lo % kKvSteps == 0;
  const auto page_at = [&](int r) { return min(max(__ldg(table + p.page_of.div(r)), 0), p.num_pages - 1); };
  int pages[kPaged ? kKvSteps : 1];  // the next block's pages (one where this thread's rows share one), -1 past n_hi
  const auto look_up = [&](int block) {
    const int first = n_lo + block * kBlockN + kv_row;
    if (rows_in_page) {
      pages[0] = first < n_hi ? page_at(first) : -1;
      return;
    }
#pragma unroll
    for (int step = 0; step < kKvSteps; ++step) {
      const int r = first + step * kRowStep;
      pages[step] = r < n_hi ? page_at(r) : -1;
    }
  };
  const auto load_kv = [&](int stage, int block) {
    const int start = n_lo + block * kBlockN;
    T* const k_stage = sK + stage * Traits::kSmemKV;
    T* const v_stage = sV + stage * Traits::kSmemKV;
    if (kPaged && !rows_in_page) {
#pragma unroll
      for (int step = 0; step < kKvSteps; ++step) {
        const int r = start + kv_row + step * kRowStep;
        const bool valid = pages[step] >= 0 && kv_col < p.head_dim;
        const int64_t row_in_page = r - p.page_of.div(r) * p.page_size;
        const int64_t k_offset = pages[step] * p.k_batch_stride + row_in_page * p.k_row_stride + kv_col;
        const int64_t v_offset = pages[step] * p.v_batch_stride + row_in_page * p.v_row_stride + kv_col;
        const int dst = Traits::offset(kv_row + step * kRowStep, kv_col / 8);
        cp_async_16(k_stage + dst, valid ? k_base + k_offset : k_base, valid);
        cp_async_16(v_stage + dst, valid ? v_base + v_offset : v_base, valid);
      }
      return;
    }
    // This thread's rows by pointer steps from its first: in the batch entry's rows, or in their page.
    const int first = start + kv_row;
    int64_t row = first;
    const T* k_src = k_base;
    const T* v_src = v_base;
    if constexpr (kPaged) {
      row = first - p.page_of.div(first) * p.page_size;
      k_src += max(pages[0], 0) * p.k_batch_stride;  // -1: no row of this thread is valid
      v_src += max(pages[0], 0) * p.v_batch_stride;
    }
    k_src += row * p.k_row_stride + kv_col;
    v_src += row * p.v_row_stride + kv_col;
#pragma unroll
    for (int step = 0; step < kKvSteps; ++step) {
      const bool valid = kv_col < p.head_dim && first + step * kRowStep < n_hi;
      const int dst = Traits::offset(kv_row + step * kRowStep, kv_col / 8);
      cp_async_16(k_stage + dst, valid ? k_src : k_base, valid);
      cp_async_16(v_stage + dst, valid ? v_src : v_base, valid);
      k_src += k_step;
      v_src += v_step;
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (b_begin + s < b_end) {
      if constexpr (kPaged) look_up(b_begin + s);
      load_kv(s, b_begin + s);
    }
    cp_async_commit();  // one group per stage, empty or not, so that the waits below count alike
  }
  if constexpr (kPaged) {
    if (b_begin + kStages - 1 < b_end) look_up(b_begin + kStages - 1);
  }

  // Per-thread state, in log2 units (the scale folded into the scores): rows lane / 4 and lane / 4 + 8 (h = 0, 1),
  // columns 2 * (lane % 4) + {0, 1} of each n8 tile.
  float acc_o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) acc_o[dt][0] = acc_o[dt][1] = acc_o[dt][2] = acc_o[dt][3] = 0.f;
  float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float row_sum[2] = {0.f, 0.f};  // this thread's columns; reduced over the quad at the end
  // Q's fragments stay in registers up to D128; above, each is read from shared memory beside K's (registers).
  constexpr bool kQInRegisters = kHeadDim <= 128;
  uint32_t q_frag[kQInRegisters ? kHeadDim / 16 : 1][4];
  // Each lane's ldmatrix row and first 16-byte chunk in the Q, K and V tiles (chunk + 2 kk for the kk-th k16 step).
  const int q_frag_row = lane % 16, q_frag_chunk = lane / 16;

  const bool softcap = p.options && p.softcap > 0.f;
  const float cap_scale = softcap ? p.scale / p.softcap : 0.f;
  const float score_log2 = softcap ? p.softcap * 1.4426950408889634f : p.scale_log2;
  // Each thread's two rows: their queries' bounds relative to the band (shift + query).
  int row_last[2], row_first[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int query = query_of(row0 + lane / 4 + 8 * h);
    row_last[h] = right < 0 ? n_hi - 1 : min(n_hi - 1, query + shift + right);
    row_first[h] = left < 0 ? 0 : query + shift - left;
  }
  // Keys every row of the CTA sees: blocks inside [all_first, all_last] skip the mask.
  const int all_first = left < 0 ? 0 : p.len_q - 1 + shift - left;
  const int all_last = right < 0 ? n_hi - 1 : min(n_hi - 1, shift + right);
  const int k_frag_row = (lane / 16) * 8 + lane % 8, k_frag_chunk = (lane / 8) % 2;
  const int v_frag_row = ((lane / 8) % 2) * 8 + lane % 8, v_frag_chunk = lane / 16;

  // The warps' merge at a split's end: thread t gets row t / kThreadsPerRow of the CTA's 16, kCols columns from col0,
  // as fp32 sums against `base` (log2 units) with their total `sum`. The warps' rows go to ring stage `stage` (every
  // warp done with it), 8-column groups swizzled by row (conflict-free float2 stores); then the state is reset.
  constexpr int kThreadsPerRow = Traits::kNThreads / kRows;
  constexpr int kCols = kHeadDim / kThreadsPerRow;
  static_assert(kCols % 8 == 0, "whole 16-byte chunks of the output row");
  const int out_row = threadIdx.x / kThreadsPerRow;
  const int col0 = (threadIdx.x % kThreadsPerRow) * kCols;
  float* const merge_max = reinterpret_cast<float*>(sV + kStages * Traits::kSmemKV);  // [warp][row]
  float* const merge_sum = merge_max + Traits::kNWarps * kRows;
  const auto merge_warps = [&](int stage, float(&o)[kCols], float& base, float& sum) {
    const auto merge_row = [&](int w, int row) {
      float* const half = reinterpret_cast<float*>((w < 2 ? sK : sV) + stage * Traits::kSmemKV);
      return half + ((w % 2) * kRows + row) * kHeadDim;
    };
    const auto swizzled = [](int row, int col) { return col ^ ((row % 4) * 8); };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float total = row_sum[h];
      total += __shfl_xor_sync(0xffffffff, total, 1);
      total += __shfl_xor_sync(0xffffffff, total, 2);
      const int row = lane / 4 + 8 * h;
      if (lane % 4 == 0) {
        merge_max[warp * kRows + row] = row_max[h];
        merge_sum[warp * kRows + row] = total;
      }
      float* const dst = merge_row(warp, row);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<float2*>(dst + swizzled(row, 8 * dt + 2 * (lane % 4))) =
            make_float2(acc_o[dt][2 * h], acc_o[dt][2 * h + 1]);
        acc_o[dt][2 * h] = acc_o[dt][2 * h + 1] = 0.f;
      }
      row_max[h] = -CUDART_INF_F;
      row_sum[h] = 0.f;
    }
    __syncthreads();
    base = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < Traits::kNWarps; ++w) base = fmaxf(base, merge_max[w * kRows + out_row]);
    float weight[Traits::kNWarps];
    sum = 0.f;
#pragma unroll
    for (int w = 0; w < Traits::kNWarps; ++w) {
      weight[w] = base == -CUDART_INF_F ? 0.f : exp2f(merge_max[w * kRows + out_row] - base);
      sum += merge_sum[w * kRows + out_row] * weight[w];
    }
#pragma unroll
    for (int c = 0; c < kCols; c += 4) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < Traits::kNWarps; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(merge_row(w, out_row) + swizzled(out_row, col0 + c));
        acc.x += x.x * weight[w], acc.y += x.y * weight[w], acc.z += x.z * weight[w], acc.w += x.w * weight[w];
      }
      o[c] = acc.x, o[c + 1] = acc.y, o[c + 2] = acc.z, o[c + 3] = acc.w;
    }
  };
  // A split's part of this thread's row: normalised (0 without keys here), with its lse (-inf without keys here); a
  // NaN row stays NaN.
  const auto split_part = [&](float(&o)[kCols], float base, float sum) {
    const bool sees_keys = sum > 0.f || sum != sum;
    const float inv = sees_keys ? 1.f / sum : 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[c] *= inv;
    return row_lse(sees_keys, base, sum);
  };
  // In turn: this thread's columns of the parts folded so far.
  float* const fold_o = merge_sum + Traits::kNWarps * kRows + out_row * kHeadDim + col0;
  if (in_turn) {
#pragma unroll
    for (int c = 0; c < kCols; c += 4) *reinterpret_cast<float4*>(fold_o + c) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  SplitFold fold{-CUDART_INF_F, 0.f};

  for (int block = b_begin; block < b_end; ++block) {
    const int i = block - b_begin;
    const int stage = i % kStages;
    cp_async_wait<kStages - 2>();  // this block's group has landed (this thread's copies)...
    __syncthreads();               // ...and everyone's; the stage of block - 1 is free again
    if (kQInRegisters && i == 0) {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        ldmatrix_x4(q_frag[kk], sQ + Traits::offset(q_frag_row, q_frag_chunk + 2 * kk));
      }
    }
    if (block + kStages - 1 < b_end) {
      load_kv((i + kStages - 1) % kStages, block + kStages - 1);
      if constexpr (kPaged) {
        if (block + kStages < b_end) look_up(block + kStages);  // read while this block computes
      }
    }
    cp_async_commit();

    // S = Q K^T for this warp's 16 keys.
    const T* const k_tile = sK + stage * Traits::kSmemKV + warp * 16 * kStride;
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t b[4];
      ldmatrix_x4(b, k_tile + Traits::offset(k_frag_row, k_frag_chunk + 2 * kk));
      if constexpr (!kQInRegisters) ldmatrix_x4(q_frag[0], sQ + Traits::offset(q_frag_row, q_frag_chunk + 2 * kk));
      const uint32_t(&q_kk)[4] = q_frag[kQInRegisters ? kk : 0];
      mma_16816<T>(s[0], q_kk, b[0], b[1]);
      mma_16816<T>(s[1], q_kk, b[2], b[3]);
    }
    // Scores in log2 units, -inf where the row may not see the key (only blocks at the band's edges have such keys).
    const int block_first = n_lo + block * kBlockN;
    const bool edge = block_first < all_first || block_first + kBlockN - 1 > all_last;
    const int key0 = block_first + warp * 16 + 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * nt + e % 2, h = e / 2;
        float x = softcap ? fast_tanh(s[nt][e] * cap_scale) * score_log2 : s[nt][e] * score_log2;
        if (edge && (key > row_last[h] || key < row_first[h])) x = -CUDART_INF_F;
        s[nt][e] = x;
      }
    }
    // Online softmax; P packed as the A operand of P V (16 rows x this warp's 16 keys).
    uint32_t a[4];
    float rescale[2];
    bool moved = false;  // some row's maximum moved: O needs its rescale (else the factors are exactly 1)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_max = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
      block_max = fmaxf(row_max[h], block_max);
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 2));
      const float base = block_max == -CUDART_INF_F ? 0.f : block_max;  // no key yet: exponentials stay 0
      rescale[h] = fast_exp2(row_max[h] - base);
      moved |= block_max != row_max[h];
      row_max[h] = block_max;
      const float p00 = fast_exp2(s[0][2 * h] - base), p01 = fast_exp2(s[0][2 * h + 1] - base);
      const float p10 = fast_exp2(s[1][2 * h] - base), p11 = fast_exp2(s[1][2 * h + 1] - base);
      row_sum[h] = row_sum[h] * rescale[h] + (p00 + p01) + (p10 + p11);
      a[h] = pack2<T>(p00, p01);
      a[2 + h] = pack2<T>(p10, p11);
    }
    if (__any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc_o[dt][0] *= rescale[0];
        acc_o[dt][1] *= rescale[0];
        acc_o[dt][2] *= rescale[1];
        acc_o[dt][3] *= rescale[1];
      }
    }
    // O += P V for the same 16 keys.
    const T* const v_tile = sV + stage * Traits::kSmemKV + warp * 16 * kStride;
#pragma unroll
    for (int dp = 0; dp < kDTiles / 2; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_tile + Traits::offset(v_frag_row, v_frag_chunk + 2 * dp));
      mma_16816<T>(acc_o[2 * dp], a, b[0], b[1]);
      mma_16816<T>(acc_o[2 * dp + 1], a, b[2], b[3]);
    }
    // In turn, at a split's end: merge the warps into a part and fold it in.
    if (in_turn && ((block + 1) % per_split == 0 || block + 1 == b_end)) {
      __syncthreads();  // every warp is done with this block's stage, which the merge borrows
      float o[kCols], base, sum;
      merge_warps(stage, o, base, sum);
      const float lse = split_part(o, base, sum);
      float alpha, beta;
      if (fold_part(fold, lse, alpha, beta)) {
#pragma unroll
        for (int c = 0; c < kCols; c += 4) {
          float4* const acc = reinterpret_cast<float4*>(fold_o + c);
          *acc = fold_add(*acc, alpha, make_float4(o[c], o[c + 1], o[c + 2], o[c + 3]), beta);
        }
      }
    }
  }
  const int head = head_of(row0 + out_row), query = query_of(row0 + out_row);
  const bool sink = p.options && p.sinks != nullptr;
  // Writes this thread's columns of the output row, times `scale`, and (one thread a row) its lse.
  const auto store_row = [&](const float(&o)[kCols], float scale, float row_lse_value) {
    T* const dst = static_cast<T*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride +
                   static_cast<int64_t>(query) * p.o_row_stride + col0;
#pragma unroll
    for (int c = 0; c < kCols; c += 8) {
      if (col0 + c < p.head_dim) {
        uint4 chunk;
        chunk.x = pack2<T>(o[c] * scale, o[c + 1] * scale);
        chunk.y = pack2<T>(o[c + 2] * scale, o[c + 3] * scale);
        chunk.z = pack2<T>(o[c + 4] * scale, o[c + 5] * scale);
        chunk.w = pack2<T>(o[c + 6] * scale, o[c + 7] * scale);
        *reinterpret_cast<uint4*>(dst + c) = chunk;
      }
    }
    if (col0 == 0) p.lse[(static_cast<int64_t>(batch) * p.heads + head) * p.len_q + query] = row_lse_value;
  };
  if (in_turn) {
    cp_async_wait<0>();  // Q's copies are still in flight where the CTA had no block
    if (row0 + out_row >= group_rows) return;
    float o[kCols], lse;
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[c] = fold_o[c];
    const float scale = fold_finish(fold, sink ? p.sinks[head] : -CUDART_INF_F,
                                    row_sees_band(query, shift, left, right, len_k), lse);
    store_row(o, scale, lse);
    return;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring, whose stage 0 the merge borrows
  float o[kCols], base, sum;
  merge_warps(0, o, base, sum);
  if (row0 + out_row >= group_rows) return;
  if (p.plan.splits == 1) {
    // The whole row: out and lse, with the sink in the denominator.
    const bool sees_keys = row_sees_band(query, shift, left, right, len_k);
    const float keep = sink ? add_sink(p.sinks[head], base, sum) : 1.f;
    store_row(o, sees_keys ? keep / sum : 0.f,  // a row without keys: out = 0
              sink && lse_is_sink(sees_keys, keep, sum) ? p.sinks[head] : row_lse(sees_keys, base, sum));
    return;
  }
  // This split's part, for the combine.
  const float lse = split_part(o, base, sum);
  const int64_t part =
      decode_split_part(p, split, (static_cast<int64_t>(batch) * p.heads + head) * p.len_q + query);
  float* const dst = p.split_out + part * kHeadDim + col0;
#pragma unroll
  for (int c = 0; c < kCols; c += 4) {
    *reinterpret_cast<float4*>(dst + c) = make_float4(o[c], o[c + 1], o[c + 2], o[c + 3]);
  }
  if (col0 == 0) p.split_lse[part] = lse;
}

// Launches the decode kernel (and, with a CTA per split, the combine) on `stream`; returns the first CUDA error.
template <typename T, int HeadDim, bool kPaged>
cudaError_t run_decode(const FwdParams& params, cudaStream_t stream) {
  using Traits = DecodeTraits<HeadDim>;
  auto kernel = flash_decode_kernel<T, Traits, kPaged>;
  constexpr int kSmemBytes = Traits::template smem_bytes<T>();
  if constexpr (kSmemBytes > 48 * 1024) {
    if (const cudaError_t err = allow_dynamic_smem(kernel, kSmemBytes); err != cudaSuccess) return err;
  }
  const int row_groups = decode_row_groups(params.heads_per_kv, params.len_q);
  const bool combine = params.plan.splits > 1 && !params.plan.splits_in_turn;
  const int batch_z = std::min(params.batch, kDecodeMaxGridZ);
  const int chunks = (params.batch + batch_z - 1) / batch_z;
  const dim3 grid(decode_split_ctas(params.plan) * chunks, params.heads_kv * row_groups, batch_z);
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(params);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && combine) err = run_decode_combine<T>(params, HeadDim, stream);
  return err;
}

}  // namespace flashattn::sm80
