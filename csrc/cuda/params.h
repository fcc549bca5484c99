// The plain parameter block every forward kernel receives: raw pointers, 64-bit element strides, sizes and
// the softmax scale. No ATen types below this line; flash_api.cpp fills it from validated tensors.
#pragma once

#include <cstdint>

namespace flashattn {

struct FwdParams {
  // Inputs (B, H or Hk, L, D) with stride(-1) == 1; strides are in elements.
  const void* __restrict__ q;
  const void* __restrict__ k;
  const void* __restrict__ v;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;

  // Outputs: out (B, H, Lq, D) with the strides below; lse float32 (B, H, Lq), contiguous.
  void* __restrict__ out;
  float* __restrict__ lse;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  int batch, heads, heads_kv, len_q, len_k, head_dim;
  int heads_per_kv;  // heads / heads_kv: query head h reads kv head h / heads_per_kv (GQA/MQA)

  float scale;       // multiplies q·k
  float scale_log2;  // scale * log2(e): the kernels work in exp2
  bool causal;       // bottom-right aligned: query i sees key j iff j <= i + len_k - len_q
};

}  // namespace flashattn
