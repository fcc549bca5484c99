// Host side of the Hopper kernels: TMA tensor maps for (B, H, L, D) tensors, encoded through the driver entry point
// that the CUDA runtime hands out (no link against libcuda), and the opt-in to large dynamic shared memory.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sm90/sequences.h"

namespace flashattn::sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      return static_cast<EncodeTiledFn>(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// Encodes a tiled map of `rank` dimensions (innermost first; strides in bytes, one fewer) with the 128-byte swizzle,
// every element stride 1 and no out-of-bounds fill value: every map of the Hopper kernels. False if the driver or
// the entry point is missing, or the driver rejects the map.
inline bool encode_map(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, const void* base,
                       const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) return false;
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  return encode(map, type, rank, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

inline CUtensorMapDataType half_type(bool is_bf16) {
  return is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// A (B, H, L, D) tensor's element strides, where a dimension of extent 1 (whose stride is never used) gets one the
// driver accepts (a multiple of 16 bytes).
struct BhldStrides {
  int64_t row, head, batch;
  BhldStrides(int64_t batch_count, int64_t heads, int64_t len, int64_t head_dim, int64_t batch_stride,
              int64_t head_stride, int64_t row_stride) {
    row = len <= 1 ? head_dim : row_stride;
    head = heads <= 1 ? row * len : head_stride;
    batch = batch_count <= 1 ? head * heads : batch_stride;
  }
};

// A 4-D map over a (B, H, L, D) tensor of 16-bit elements with element strides (batch, head, row) and a box of
// `box_rows` rows x 64 columns (128 bytes: the widest inner box the 128-byte swizzle allows). Coordinates are
// (column, row, head, batch); loads outside rows 0 .. L - 1 or past D are zero-filled, stores past L or D are
// skipped, and a store at a negative row faults (a CUDA error on the H200). Returns false if the driver rejects it
// (alignment: base and strides must be multiples of 16 bytes).
inline bool make_bhld_map(CUtensorMap* map, const void* base, bool is_bf16, int64_t batch, int64_t heads,
                          int64_t len, int64_t head_dim, int64_t batch_stride, int64_t head_stride,
                          int64_t row_stride, uint32_t box_rows) {
  const BhldStrides stride(batch, heads, len, head_dim, batch_stride, head_stride, row_stride);
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(len),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(stride.row * 2), static_cast<cuuint64_t>(stride.head * 2),
                                 static_cast<cuuint64_t>(stride.batch * 2)};
  const cuuint32_t box[4] = {64, box_rows, 1, 1};
  return encode_map(map, half_type(is_bf16), 4, base, dims, strides, box);
}

// A 5-D map over a (B, H, L, D) tensor whose D is a multiple of 64, its columns split into blocks of 64: coordinates
// (column in the block, row, column block, head, batch), boxes of `box_rows` rows x `box_blocks` blocks, which shared
// memory holds block after block, each `box_rows` rows of 128 bytes in the 128-byte swizzle (one TMA store then
// writes every column of those rows). Blocks past D / 64 are skipped. Returns false if the driver rejects it.
inline bool make_bhld_column_block_map(CUtensorMap* map, const void* base, bool is_bf16, int64_t batch, int64_t heads,
                                       int64_t len, int64_t head_dim, int64_t batch_stride, int64_t head_stride,
                                       int64_t row_stride, uint32_t box_rows, uint32_t box_blocks) {
  if (head_dim % 64 != 0) return false;
  const BhldStrides stride(batch, heads, len, head_dim, batch_stride, head_stride, row_stride);
  const cuuint64_t dims[5] = {64, static_cast<cuuint64_t>(len), static_cast<cuuint64_t>(head_dim / 64),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[4] = {static_cast<cuuint64_t>(stride.row * 2), 128, static_cast<cuuint64_t>(stride.head * 2),
                                 static_cast<cuuint64_t>(stride.batch * 2)};
  const cuuint32_t box[5] = {64, box_rows, box_blocks, 1, 1};
  return encode_map(map, half_type(is_bf16), 5, base, dims, strides, box);
}

// The maps over Q (boxes of q_box_rows rows) and K, V (kv_box_rows) that a FwdParams or BwdParams describes.
template <typename Params>
bool make_qkv_maps(const Params& p, bool is_bf16, uint32_t q_box_rows, uint32_t kv_box_rows, CUtensorMap* q_map,
                   CUtensorMap* k_map, CUtensorMap* v_map) {
  return make_bhld_map(q_map, p.q, is_bf16, p.batch, p.heads, p.len_q, p.head_dim, p.q_batch_stride,
                       p.q_head_stride, p.q_row_stride, q_box_rows) &&
         make_bhld_map(k_map, p.k, is_bf16, p.batch, p.heads_kv, p.len_k, p.head_dim, p.k_batch_stride,
                       p.k_head_stride, p.k_row_stride, kv_box_rows) &&
         make_bhld_map(v_map, p.v, is_bf16, p.batch, p.heads_kv, p.len_k, p.head_dim, p.v_batch_stride,
                       p.v_head_stride, p.v_row_stride, kv_box_rows);
}

// A paged KV cache's maps (a FwdParams with a block table): over the (num_pages, Hk, page_size, D) k and v, boxes of
// page_box_rows rows. False if the driver rejects one.
template <typename Params>
bool make_page_maps(const Params& p, bool is_bf16, int block_n, CUtensorMap* k_map, CUtensorMap* v_map) {
  const auto box_rows = static_cast<uint32_t>(page_box_rows(p.page_size, block_n));
  return make_bhld_map(k_map, p.k, is_bf16, p.num_pages, p.heads_kv, p.page_size, p.head_dim, p.k_batch_stride,
                       p.k_head_stride, p.k_row_stride, box_rows) &&
         make_bhld_map(v_map, p.v, is_bf16, p.num_pages, p.heads_kv, p.page_size, p.head_dim, p.v_batch_stride,
                       p.v_head_stride, p.v_row_stride, box_rows);
}

// Whether TMA can describe q, k and v of `p` (a FwdParams or BwdParams) as they are: the driver encodes a map of each
// (alignment, strides below 2^40 bytes, ...). The plan asks before it picks a Hopper kernel.
template <typename Params>
bool tma_can_map(const Params& p, bool is_bf16) {
  CUtensorMap q_map, k_map, v_map;
  return make_qkv_maps(p, is_bf16, 64, 64, &q_map, &k_map, &v_map);
}

// The same for the backward's q, k, v and dout (a BwdParams).
template <typename Params>
bool tma_can_map_bwd(const Params& p, bool is_bf16) {
  CUtensorMap do_map;
  return tma_can_map(p, is_bf16) && make_bhld_map(&do_map, p.dout, is_bf16, p.batch, p.heads, p.len_q, p.head_dim,
                                                   p.do_batch_stride, p.do_head_stride, p.do_row_stride, 64);
}

// A 4-D map over the backward's fp32 dQ accumulator (B, H, Lq, D), contiguous, for TMA reductions: boxes of
// `box_rows` rows x 32 columns (128 bytes, 128-byte swizzle). Coordinates (column, row, head, batch); parts past Lq
// or D are skipped. Returns false if the driver rejects it.
inline bool make_dq_accum_map(CUtensorMap* map, float* base, int64_t batch, int64_t heads, int64_t len,
                              int64_t head_dim, uint32_t box_rows) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(len),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim * 4), static_cast<cuuint64_t>(len * head_dim * 4),
                                 static_cast<cuuint64_t>(heads * len * head_dim * 4)};
  const cuuint32_t box[4] = {32, box_rows, 1, 1};
  return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box);
}

}  // namespace flashattn::sm90
