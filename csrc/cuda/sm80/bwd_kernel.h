// Portable FlashAttention-2 backward (sm_80 and newer), head dims up to 128.
//
// One CTA owns kBlockN keys of one kv head (warp w: keys 16w..16w+15). It keeps K and V of those keys in shared
// memory and dK, dV in registers, and walks every query block (of every query head of its GQA group) that can see
// them. Per query block, with P recomputed from lse:
//   S^T = K Q^T,  P^T = exp(S^T * scale - lse),  dP^T = V dO^T,  dS^T = P^T (dP^T - delta)
//   dV += P^T dO,  dK += dS^T Q                         (each warp, its 16 keys, no synchronisation)
//   dQ (this block's share) = dS K                      (dS^T staged in shared memory; fp32 atomics to dq_accum)
// Working with S^T (keys as rows) makes P^T and dS^T the A operands of the dV/dK GEMMs straight from registers.
// The options variant (kOptions) walks only the query blocks of a sliding window's band and masks its edges, and with
// softcap (kSoftcap, a kernel of its own picked on the host, as in the forward) recomputes t = tanh(scale * S /
// softcap) for P = exp(softcap * t - lse) and dS = P (dP - delta) (1 - t^2).
// The sequences variant (kSequences) adds packed sequences to it, and with dQ semaphores adds each query block's dQ in
// key-block order (deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/launchers.h"
#include "cuda/packed.h"
#include "cuda/params.h"
#include "cuda/sm80/ptx.h"
#include "cuda/sm80/tile_io.h"

namespace flashattn::sm80 {

template <int HeadDim>
struct BwdTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockN = kNWarps * 16;  // keys per CTA
  static constexpr int kBlockM = 64;            // queries per step (in the dQ GEMM: 16 per warp)
  static constexpr int kSmemStride = HeadDim + 8;     // padded rows: conflict-free ldmatrix (see FwdTraits)
  static constexpr int kSmemDsStride = kBlockM + 8;   // dS^T tile [kBlockN][kBlockM]
  static constexpr int kSmemKV = kBlockN * kSmemStride;
  static constexpr int kSmemQ = kBlockM * kSmemStride;
  template <typename T>
  static constexpr int smem_bytes() {
    return (2 * kSmemKV + 2 * kSmemQ + kBlockN * kSmemDsStride) * static_cast<int>(sizeof(T)) +
           2 * kBlockM * static_cast<int>(sizeof(float));
  }
  static_assert(HeadDim % 32 == 0 && HeadDim <= 128, "the fused backward covers head-dim buckets up to 128");
  static_assert(kBlockM == kNWarps * 16, "the dQ GEMM gives each warp 16 query rows");
  static_assert(kBlockM == kBwdBlockM, "the host sizes the dQ semaphores by kBwdBlockM");
};

// A query block's semaphore: dense (B, H, ceil(Lq / kBlockM)); packed (H, packed_slots(total_q, B, kBlockM)).
template <typename Traits>
__device__ __forceinline__ int64_t dq_semaphore_index_of(const BwdParams& p, bool packed, int batch, int head,
                                                         int q_block) {
  if (packed) return static_cast<int64_t>(head) * packed_slots(p.len_q, p.batch, Traits::kBlockM) + q_block;
  const int num_q_blocks = (p.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
  return (static_cast<int64_t>(batch) * p.heads + head) * num_q_blocks + q_block;
}

template <typename T, typename Traits, bool kCausal, bool kOptions, bool kSequences, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 2) flash_bwd_kernel(const __grid_constant__ BwdParams p) {
  static_assert(!(kCausal && kOptions), "the options variant carries causal in its band");
  static_assert(kOptions || !kSequences, "per-sequence lengths come with the options variant");
  static_assert(kOptions || !kSoftcap, "softcap is an option");
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStride = Traits::kSmemStride;
  constexpr int kDsStride = Traits::kSmemDsStride;
  constexpr int kDTiles = kHeadDim / 8;  // n8 tiles of dK, dV, dQ
  constexpr int kQTiles = kBlockM / 8;   // n8 tiles of S^T (query columns)
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const sK = reinterpret_cast<T*>(smem_raw);
  T* const sV = sK + Traits::kSmemKV;
  T* const sQ = sV + Traits::kSmemKV;
  T* const sdO = sQ + Traits::kSmemQ;
  T* const sdS = sdO + Traits::kSmemQ;  // [kBlockN][kDsStride]: dS^T of the current query block
  float* const s_lse = reinterpret_cast<float*>(sdS + kBlockN * kDsStride);  // lse * log2 e; +inf: P = 0
  float* const s_delta = s_lse + kBlockM;

  // Key blocks fastest, then kv heads, then batches. Packed sequences (the sequences variant; the others carry none of
  // it): the slots of every sequence (packed.h), then kv heads, the sequence's rows starting at row_q / row_k.
  const bool packed = kSequences && p.cu_seqlens_q != nullptr;
  int n_block, kv_head, batch, seq_len_q = 0, seq_len_k = 0, row_q = 0, row_k = 0;
  int dq_block0 = 0;  // ordered dQ: the first query block of this sequence in the semaphores' per-head numbering
  // The lengths: the params' (read where used), or with kSequences the sequence's.
  const auto len_q = [&] { return packed ? seq_len_q : p.len_q; };
  const auto len_k = [&] { return packed ? seq_len_k : p.len_k; };
  if (!packed) {
    const int num_n_blocks = (p.len_k + kBlockN - 1) / kBlockN;
    n_block = blockIdx.x % num_n_blocks;
    kv_head = (blockIdx.x / num_n_blocks) % p.heads_kv;
    batch = blockIdx.x / num_n_blocks / p.heads_kv;
  } else {
    const int num_slots = packed_slots(p.len_k, p.batch, kBlockN);
    kv_head = blockIdx.x / num_slots;
    const PackedBlock b = find_packed_block(p.cu_seqlens_k, p.len_k, p.cu_seqlens_q, p.len_q, p.batch, kBlockN,
                                            blockIdx.x % num_slots);
    if (b.block < 0 || b.block * kBlockN >= b.len) return;  // an idle slot (or cu_seqlens that break their rules)
    batch = 0, n_block = b.block, seq_len_k = b.len, seq_len_q = b.other_len, row_k = b.row, row_q = b.other_row;
    dq_block0 = row_q / kBlockM + b.batch;  // the query side's packed slots (packed.h)
  }
  const int n_start = n_block * kBlockN;
  // Packed cu_seqlens that break their rules can leave a key block's turn unreached: the host flags them (the int
  // after the semaphores), and such calls add dQ unordered rather than wait.
  const bool ordered_dq = kSequences && p.dq_semaphore != nullptr &&
                          !(packed && __ldg(p.dq_semaphore + static_cast<int64_t>(p.heads) *
                                                                 packed_slots(p.len_q, p.batch, kBlockM)) != 0);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int causal_shift = len_k() - len_q();  // query i sees keys j <= i + causal_shift

  const int left = kOptions ? p.window_left : -1;
  const int right = kCausal ? 0 : kOptions ? p.window_right : -1;

  // Query blocks that see at least one of these keys: under the band's right edge (the causal mask) those from the
  // first query i with i + causal_shift + right >= n_start, under its left edge those up to the last query i with
  // i + causal_shift - left <= n_start + kBlockN - 1.
  const int m_block_first = right < 0 ? 0 : max(0, n_start - causal_shift - right) / kBlockM;
  const int m_row_end = left < 0 ? len_q() : max(0, min(len_q(), n_start + kBlockN - causal_shift + left));
  const int num_m_blocks = (m_row_end + kBlockM - 1) / kBlockM;

  const T* k_base = static_cast<const T*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                    static_cast<int64_t>(row_k) * p.k_row_stride;
  const T* v_base = static_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                    static_cast<int64_t>(row_k) * p.v_row_stride;
  load_tile_async<T, Traits, kBlockN>(sK, k_base, p.k_row_stride, n_start, len_k(), p.head_dim);
  load_tile_async<T, Traits, kBlockN>(sV, v_base, p.v_row_stride, n_start, len_k(), p.head_dim);
  cp_async_commit();

  float acc_dk[kDTiles][4];
  float acc_dv[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_dk[dt][i] = acc_dv[dt][i] = 0.f;
  }

  const int key_row0 = warp * 16;    // this warp's keys inside the block (S^T, dK, dV)
  const int query_row0 = warp * 16;  // this warp's queries inside the query block (dQ)
  // ldmatrix lane addresses (see fwd_kernel.h): an A fragment from row-major rows, a B fragment from rows that
  // are the n index (non-transposed), a B fragment from rows that are the k index (transposed).
  const int a_offset = (lane % 16) * kStride + (lane / 16) * 8;
  const int b_offset = ((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8;
  const int bt_offset = (((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8;
  // A fragment of dS (queries x keys) read transposed from the dS^T tile.
  const int ds_a_offset = ((lane / 16) * 8 + lane % 8) * kDsStride + ((lane / 8) % 2) * 8;

  for (int group_index = 0; group_index < p.heads_per_kv; ++group_index) {
    const int head = kv_head * p.heads_per_kv + group_index;
    const T* q_base = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                      static_cast<int64_t>(row_q) * p.q_row_stride;
    const T* do_base = static_cast<const T*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride +
                       static_cast<int64_t>(row_q) * p.do_row_stride;
    const int64_t row_offset = (static_cast<int64_t>(batch) * p.heads + head) * p.len_q + row_q;
    const float* lse = p.lse + row_offset;
    const float* delta = p.delta + row_offset;
    float* dq_accum = p.dq_accum + row_offset * p.head_dim;

    for (int m_block = m_block_first; m_block < num_m_blocks; ++m_block) {
      const int m_start = m_block * kBlockM;
      __syncthreads();  // every warp is done with the previous block's sQ, sdO, sdS, s_lse, s_delta
      load_tile_async<T, Traits, kBlockM>(sQ, q_base, p.q_row_stride, m_start, len_q(), p.head_dim);
      load_tile_async<T, Traits, kBlockM>(sdO, do_base, p.do_row_stride, m_start, len_q(), p.head_dim);
      cp_async_commit();
      if (threadIdx.x < kBlockM) {
        const int row = m_start + threadIdx.x;
        const float row_lse = row < len_q() ? lse[row] : -INFINITY;
        // A row past the end or without any visible key contributes nothing: exp2(x - inf) = 0, and its delta is
        // zeroed so that a non-finite dlse there cannot turn 0 * inf into NaN.
        const bool contributes = row_lse != -INFINITY;
        s_lse[threadIdx.x] = contributes ? row_lse * kLog2e : INFINITY;
        s_delta[threadIdx.x] = contributes ? delta[row] : 0.f;
      }
      cp_async_wait<0>();
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and the kBlockM queries.
      float acc_s[kQTiles][4];
      float acc_dp[kQTiles][4];
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[qt][i] = acc_dp[qt][i] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a_k[4], a_v[4];
        ldmatrix_x4(a_k, sK + key_row0 * kStride + a_offset + kk * 16);
        ldmatrix_x4(a_v, sV + key_row0 * kStride + a_offset + kk * 16);
#pragma unroll
        for (int mp = 0; mp < kBlockM / 16; ++mp) {
          uint32_t b[4];
          ldmatrix_x4(b, sQ + b_offset + mp * 16 * kStride + kk * 16);
          mma_16816<T>(acc_s[2 * mp], a_k, b[0], b[1]);
          mma_16816<T>(acc_s[2 * mp + 1], a_k, b[2], b[3]);
          ldmatrix_x4(b, sdO + b_offset + mp * 16 * kStride + kk * 16);
          mma_16816<T>(acc_dp[2 * mp], a_v, b[0], b[1]);
          mma_16816<T>(acc_dp[2 * mp + 1], a_v, b[2], b[3]);
        }
      }

      // P^T and dS^T, packed to T in the A-fragment layout. Element (qt, i): key key_row0 + lane/4 + 8 (i/2),
      // query qt * 8 + 2 (lane % 4) + i % 2.
      const bool needs_mask = n_start + kBlockN > len_k() ||
                              (right >= 0 && n_start + kBlockN - 1 > m_start + causal_shift + right) ||
                              (left >= 0 && n_start < m_start + kBlockM - 1 + causal_shift - left);
      // Softcap's factors, once a query block: formed per score, the division cost a MUFU.RCP each.
      const float cap_scale = kSoftcap ? p.scale / p.softcap : 0.f, cap_log2 = kSoftcap ? p.softcap * kLog2e : 0.f;
      uint32_t p_frag[kQTiles][2];
      uint32_t ds_frag[kQTiles][2];
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float pv[2], dsv[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i = 2 * half + c;
            const int query = qt * 8 + 2 * (lane % 4) + c;  // inside the query block
            float tanh_score = 0.f;
            if constexpr (kSoftcap) tanh_score = fast_tanh(acc_s[qt][i] * cap_scale);
            float prob = kSoftcap ? fast_exp2(fmaf(tanh_score, cap_log2, -s_lse[query]))
                                  : fast_exp2(fmaf(acc_s[qt][i], p.scale_log2, -s_lse[query]));
            if (needs_mask) {
              const int key = n_start + key_row0 + lane / 4 + 8 * half;
              const int diagonal = m_start + query + causal_shift;
              if (key >= len_k() || (right >= 0 && key > diagonal + right) ||
                  (kOptions && left >= 0 && key < diagonal - left)) {
                prob = 0.f;
              }
            }
            pv[c] = prob;
            dsv[c] = prob * (acc_dp[qt][i] - s_delta[query]);
            if constexpr (kSoftcap) dsv[c] *= 1.f - tanh_score * tanh_score;
          }
          p_frag[qt][half] = pack2<T>(pv[0], pv[1]);
          ds_frag[qt][half] = pack2<T>(dsv[0], dsv[1]);
          // Stage dS^T for the dQ GEMM.
          *reinterpret_cast<uint32_t*>(sdS + (key_row0 + lane / 4 + 8 * half) * kDsStride + qt * 8 +
                                       2 * (lane % 4)) = ds_frag[qt][half];
        }
      }

      // dV += P^T dO and dK += dS^T Q (k index = queries; dO and Q read transposed).
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        const uint32_t a_p[4] = {p_frag[2 * kk][0], p_frag[2 * kk][1], p_frag[2 * kk + 1][0], p_frag[2 * kk + 1][1]};
        const uint32_t a_ds[4] = {ds_frag[2 * kk][0], ds_frag[2 * kk][1], ds_frag[2 * kk + 1][0],
                                  ds_frag[2 * kk + 1][1]};
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sdO + bt_offset + kk * 16 * kStride + dp * 16);
          mma_16816<T>(acc_dv[2 * dp], a_p, b[0], b[1]);
          mma_16816<T>(acc_dv[2 * dp + 1], a_p, b[2], b[3]);
          ldmatrix_x4_trans(b, sQ + bt_offset + kk * 16 * kStride + dp * 16);
          mma_16816<T>(acc_dk[2 * dp], a_ds, b[0], b[1]);
          mma_16816<T>(acc_dk[2 * dp + 1], a_ds, b[2], b[3]);
        }
      }

      __syncthreads();  // dS^T of every warp is in shared memory

      // dQ rows query_row0..+15 of this block: dS (queries x keys) K, summed into dq_accum across key blocks.
      float acc_dq[kDTiles][4];
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_dq[dt][i] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, sdS + ds_a_offset + kk * 16 * kDsStride + query_row0);
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sK + bt_offset + kk * 16 * kStride + dp * 16);
          mma_16816<T>(acc_dq[2 * dp], a, b[0], b[1]);
          mma_16816<T>(acc_dq[2 * dp + 1], a, b[2], b[3]);
        }
      }
      // Ordered dQ (sequences variant, p.dq_semaphore): the key blocks that see this query block add into it one after
      // the other, in key-block order, so the sums are the same bits on every run.
      int* semaphore = nullptr;
      if (ordered_dq) {
        semaphore = p.dq_semaphore + dq_semaphore_index_of<Traits>(p, packed, batch, head, dq_block0 + m_block);
        if (threadIdx.x == 0) {
          const int turn = n_block - first_key_block(m_start, causal_shift, left, Traits::kBlockN);
          while (ld_acquire_gpu(semaphore) != turn) {
          }
        }
        __syncthreads();
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m_start + query_row0 + lane / 4 + 8 * half;
        if (row < len_q()) {
          float* dq_row = dq_accum + static_cast<int64_t>(row) * p.head_dim;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            const int col = dt * 8 + 2 * (lane % 4);
            if (col < p.head_dim) {  // head_dim is a multiple of 8: both columns of the pair are in range
              atomicAdd(dq_row + col, acc_dq[dt][2 * half]);
              atomicAdd(dq_row + col + 1, acc_dq[dt][2 * half + 1]);
            }
          }
        }
      }
      if (semaphore != nullptr) {
        __threadfence();
        __syncthreads();  // every thread's additions are made before the next key block's turn
        if (threadIdx.x == 0) red_release_gpu_add(semaphore, 1);
      }
    }
  }
  cp_async_wait<0>();  // no query block at all: K/V copies may still be in flight

  // dK = scale * dS^T Q; dV = P^T dO. This CTA is the only writer of its keys' rows.
  // Their rows as K's: the batch entry's, or the sequence's from row_k.
  T* const dk_base = static_cast<T*>(p.dk) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
                     static_cast<int64_t>(row_k) * p.dk_row_stride;
  T* const dv_base = static_cast<T*>(p.dv) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
                     static_cast<int64_t>(row_k) * p.dv_row_stride;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = n_start + key_row0 + lane / 4 + 8 * half;
    if (key < len_k()) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + 2 * (lane % 4);
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(dk_base + key * p.dk_row_stride + col) =
              pack2<T>(acc_dk[dt][2 * half] * p.scale, acc_dk[dt][2 * half + 1] * p.scale);
          *reinterpret_cast<uint32_t*>(dv_base + key * p.dv_row_stride + col) =
              pack2<T>(acc_dv[dt][2 * half], acc_dv[dt][2 * half + 1]);
        }
      }
    }
  }
}

// Launches the fused backward on `stream` (dq_accum zeroed and delta computed beforehand); never synchronises.
template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_bwd_sm80(const BwdParams& params, cudaStream_t stream) {
  using Traits = BwdTraits<HeadDim>;
  auto kernel = flash_bwd_kernel<T, Traits, kCausal, kOptions, kSequences, false>;
  if constexpr (kOptions) {
    if (params.softcap > 0.f) kernel = flash_bwd_kernel<T, Traits, kCausal, kOptions, kSequences, true>;
  }
  constexpr int kSmemBytes = Traits::template smem_bytes<T>();
  if constexpr (kSmemBytes > 48 * 1024) {
    if (const cudaError_t err = allow_dynamic_smem(kernel, kSmemBytes); err != cudaSuccess) return err;
  }
  const int64_t num_n_blocks = (params.len_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const int64_t blocks = !kSequences || params.cu_seqlens_q == nullptr
                             ? num_n_blocks * params.heads_kv * params.batch
                             : static_cast<int64_t>(packed_slots(params.len_k, params.batch, Traits::kBlockN)) *
                                   params.heads_kv;
  const dim3 grid(static_cast<unsigned>(blocks));
  kernel<<<grid, Traits::kNThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flashattn::sm80
