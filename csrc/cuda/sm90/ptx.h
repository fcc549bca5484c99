// Hopper (sm_90a) building blocks of the forward and backward kernels: wgmma synchronisation and shared-memory
// descriptors, mbarriers, TMA tile loads, register reallocation and named barriers. Each wrapper is one PTX
// instruction; the wgmma instructions themselves are in the generated wgmma_ops.h.
// Checked on the GPU, one piece at a time, by tests/test_sm90_primitives.py before any kernel relies on it.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ptx_common.h"  // smem_addr

namespace flashattn::sm90 {

// ---- wgmma ordering -------------------------------------------------------------------------------------------

// Before the first wgmma that reads registers (accumulators or an A operand) written by ordinary instructions.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the wgmmas issued so far into a group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps ptxas from sinking the computation of `value` below the next wgmma_wait(): ptxas keeps shared-memory
// stores in order around the wait, and this store is predicated on `value` (on an all-ones bit pattern, a NaN that
// arithmetic never produces; if it ever held, the store would only write `scratch`). Without it ptxas hoists the
// wait above independent math, e.g. the softmax that is meant to run while the P V wgmma is in flight.
__device__ __forceinline__ void keep_before_wgmma_wait(float value, uint32_t* scratch) {
  asm volatile(
      "{\n.reg .pred never;\n"
      "setp.eq.u32 never, %0, 0xffffffff;\n"
      "@never st.shared.u32 [%1], %0;\n}\n" ::"r"(__float_as_uint(value)),
      "r"(smem_addr(scratch))
      : "memory");
}

// Keeps the compiler from moving register reads/writes across an asynchronous wgmma: call it on the accumulators
// (and on A-operand registers) right before wgmma_fence() and right after wgmma_wait().
template <int kRegs>
__device__ __forceinline__ void wgmma_fence_registers(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int kRows, int kCols>
__device__ __forceinline__ void wgmma_fence_registers(uint32_t (&a)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

// Shared-memory matrix descriptor for a K-major tile stored in the 128-byte swizzle pattern that TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B: rows of 64 16-bit elements (128 B), 8-row atoms of 1024 B, the 16-byte chunk c of
// row r stored at chunk c ^ (r % 8). Fields (PTX ISA, "matrix descriptor"): start address >> 4 (bits 0-13),
// leading-dimension byte offset >> 4 (16-29), stride-dimension byte offset >> 4 (32-45: 1024 B between 8-row
// atoms), swizzle mode (62-63: 1 = 128 B). The tile must start 1024-byte aligned; a k16 step inside the 64-element
// row advances the start address by 32 bytes.
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* tile, uint32_t leading_byte_offset = 16,
                                                    uint32_t stride_byte_offset = 1024) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr(tile) & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((leading_byte_offset & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>((stride_byte_offset & 0x3FFFF) >> 4) << 32;
  desc |= uint64_t{1} << 62;
  return desc;
}

// Where that swizzle puts 16-byte chunk `chunk` (0-7) of row `row` of such a tile, in 16-bit elements from its start.
__device__ __forceinline__ int sw128_offset(int row, int chunk) { return row * 64 + (chunk ^ (row % 8)) * 8; }

// The descriptor of the tile `byte_offset` bytes (a multiple of 16) past `desc`'s: the start address is the lowest
// field, and shared-memory addresses stay below 2^18, so the offset adds to it without carrying into the next field.
// Built once per tile and advanced by constants, the descriptors of a GEMM's k16 steps cost one add each instead of
// the mask, shift and merge of smem_desc_sw128.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t byte_offset) {
  return desc + (byte_offset >> 4);
}

// ---- mbarriers and TMA ------------------------------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes initialised mbarriers visible to the async proxy (TMA) before it signals them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Spins until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// TMA: copies the box at coordinates (c0 innermost .. c3) of a 4-D tensor map into shared memory and signals
// `bar` with the bytes written (the whole box: out-of-bounds parts are zero-filled and still counted).
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// TMA reduction: adds the shared-memory box to global memory at coordinates (c0 innermost .. c3) of a 4-D fp32
// tensor map (elements out of bounds are skipped). Completion is tracked per thread by bulk groups.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* smem_src, int c0, int c1,
                                                  int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// TMA store: writes the shared-memory box to global memory at coordinates (c0 innermost .. c3) of a 4-D tensor map
// (elements out of bounds are skipped). Completion is tracked per thread by bulk groups.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// The same through a 5-D tensor map (coordinates c0 innermost .. c4).
__device__ __forceinline__ void tma_store_5d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2,
                                             int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's bulk groups still read their shared-memory source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until at most kPending of this thread's bulk groups are incomplete (their global writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 matrices of 16-bit elements from accumulator fragments (thread t holds row t / 4, columns 2 (t % 4) and
// 2 (t % 4) + 1 of each, one register per matrix) to shared memory: lanes 8m .. 8m + 7 give matrix m's row addresses.
__device__ __forceinline__ void stmatrix_x4(void* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row)), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The same with each matrix transposed: row r of matrix m in memory holds column r of the fragments.
__device__ __forceinline__ void stmatrix_x4_trans(void* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Shared memory written by ordinary stores, read next by wgmma or TMA: each writing thread fences before the barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- tensor maps in global memory (built on the device for packed sequences) ------------------------------------

// A 128-byte-aligned tensor map in global memory given another base address, or another extent of dimension kDim.
__device__ __forceinline__ void tensormap_replace_address(void* map, const void* address) {
  asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;\n" ::"l"(map),
               "l"(reinterpret_cast<uint64_t>(address))
               : "memory");
}
template <int kDim>
__device__ __forceinline__ void tensormap_replace_dim(void* map, uint32_t extent) {
  asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], %1, %2;\n" ::"l"(map), "n"(kDim),
               "r"(extent)
               : "memory");
}
// Tensor maps written by threads (generic proxy), then read by TMA (tensormap proxy): the writer releases them, and
// each thread that issues TMA with a map acquires it first.
__device__ __forceinline__ void fence_tensormap_release() {
  asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
}
__device__ __forceinline__ void fence_tensormap_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}

// ---- warp specialisation -----------------------------------------------------------------------------------------

// Register reallocation between warpgroups (needs a register cap at kernel entry: __launch_bounds__(n, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Global memory written by the TMA (async proxy) and flags read or written by threads (generic proxy), in order.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: ping-pong between consumer warpgroups.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Whether `value` holds in every thread of the warpgroup: a named barrier over its 128 threads with an AND reduction.
__device__ __forceinline__ bool warpgroup_all(bool value, int barrier_id) {
  uint32_t all;
  asm volatile(
      "{\n"
      "  .reg .pred p, q;\n"
      "  setp.ne.u32 q, %1, 0;\n"
      "  bar.red.and.pred p, %2, 128, q;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(all)
      : "r"(static_cast<uint32_t>(value)), "r"(barrier_id)
      : "memory");
  return all != 0;
}

}  // namespace flashattn::sm90
