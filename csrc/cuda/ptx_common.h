// Register and shared-memory helpers every CUDA kernel uses, sm80 and sm90 alike: shared-memory addresses, ldmatrix,
// packing two floats into a 16-bit pair, the special-function unit's exp2, GPU-scope flags between CTAs, and the
// programmatic dependent launch. Each wraps one instruction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashattn {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// `raw` moved up to the next multiple of kAlign bytes of the shared window by pointer arithmetic, so that the compiler
// still sees shared memory behind it (after an integer round trip every access through it is a generic LD/ST).
template <int kAlign>
__device__ __forceinline__ unsigned char* align_smem(unsigned char* raw) {
  return raw + (kAlign - smem_addr(raw) % kAlign) % kAlign;
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i receives it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// The same, each matrix transposed on the way (V as the B operand of P·V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// Two floats -> one register of two 16-bit values, `lo` in the low half (the lower column of a fragment).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Programmatic dependent launch (sm90+; no-ops before): a grid lets the next kernel of its stream start its CTAs
// (`allow_dependents`), and that kernel waits for the whole grid before it reads its results (`wait_for_primary`).
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// 2^x on the special-function unit; exp2(-inf) = +0, which the masked softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// softcap's tanh on the special-function unit (one instruction, as FlashAttention): relative error <= 2^-11, so
// a capped score moves by at most softcap * 2^-11, below a bf16 score's rounding. NaN stays NaN, +-inf gives +-1.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A GPU-scope flag between CTAs: acquire load, release add.
__device__ __forceinline__ int ld_acquire_gpu(const int* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void red_release_gpu_add(int* flag, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}

}  // namespace flashattn
