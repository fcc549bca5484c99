// Every named-barrier id of the Hopper kernels (bar.sync / bar.arrive ids 1-15; 0 is __syncthreads).
#pragma once

#include <cuda_runtime.h>

namespace flashattn::sm90 {

// Forward, with kConsumers consumer warpgroups.
template <int kConsumers>
struct FwdBarrier {
  // Consumer c's turn to issue its GEMMs (the ping-pong between consumers): 256 threads, this consumer's and the
  // previous one's.
  __host__ __device__ static constexpr int turn(int consumer) { return 1 + consumer; }
  // Consumer c's warpgroup-wide vote on its exponentials (128 threads).
  __host__ __device__ static constexpr int vote(int consumer) { return 1 + kConsumers + consumer; }
  static_assert(1 + 2 * kConsumers <= 16, "barrier ids run out at 15");
};

// Backward (bwd_kernel.h), two consumer warpgroups and a dQ writer warp for each (whose ids the D256 kernel shares).
struct BwdBarrier {
  // Both consumers at a key block's start (its first statistics staged) and end (done with the dS tiles): 256
  // threads. Within a block the dS tiles pass through mbarriers (bwd_kernel.h).
  static constexpr int kBothConsumers = 1;
  static constexpr int kWriterThreads = 128 + 32;  // consumer warpgroup c and its dQ writer warp
  // Consumer c's dQ tile is in shared memory (kWriterThreads).
  __host__ __device__ static constexpr int dq_full(int consumer) { return 2 + consumer; }
  // The writer has read consumer c's dQ tile: it may be overwritten (kWriterThreads).
  __host__ __device__ static constexpr int dq_empty(int consumer) { return 4 + consumer; }
  // Consumer c's dK and dV are staged in shared memory for its row stores (its 128 threads).
  __host__ __device__ static constexpr int epilogue(int consumer) { return 8 + consumer; }
};

// Backward for D256 (bwd_split_kernel.h), two consumer warpgroups that split each step's work; their dQ writer warps
// take BwdBarrier's dq_full and dq_empty (ids 2-5).
struct BwdSplitBarrier {
  static constexpr int kStepStart = 1;  // a step's statistics are staged (256 threads)
  static constexpr int kPReady = 6;     // P^T is in shared memory
  static constexpr int kDsReady = 7;    // dS^T is in shared memory
};

}  // namespace flashattn::sm90
