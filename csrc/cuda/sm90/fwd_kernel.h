// The Hopper forward kernel: warp-specialised, TMA + wgmma, persistent. CTA = 1 + kConsumers warpgroups. Warpgroup 0
// is the producer: one thread loads each tile's Q and its K/V blocks into 2- or 3-stage rings with TMA (128-byte
// swizzle; rows past L and columns past D zero-filled), running ahead into the next tile. Each consumer warpgroup owns
// 64 query rows of the tile and runs the main loop over its key blocks, then the epilogue. The pieces:
//   fwd_traits.h      shape, policies, shared-memory layout       tile_scheduler.h  which tiles, in which order
//   fwd_mainloop.h    producer loads, consumer GEMMs + softmax     mask.h, softmax.h the mask and the online softmax
//   fwd_epilogue.h    lse, stream-K merge, O through TMA stores    named_barrier.h   every named-barrier id
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>

#include "cuda/params.h"
#include "cuda/sm90/fwd_epilogue.h"
#include "cuda/sm90/fwd_mainloop.h"
#include "cuda/sm90/fwd_traits.h"
#include "cuda/sm90/ptx.h"
#include "cuda/sm90/softmax.h"
#include "cuda/sm90/tile_scheduler.h"

namespace flashattn::sm90 {

template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap o_map,
                          const __grid_constant__ FwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr bool kStreamK = Traits::kOrder == TileOrder::kStrideThenStreamK;
  using TileT = Tile<Traits, kCausal>;
  using Scheduler = FwdScheduler<Traits, kCausal>;

  // Packed sequences: the scheduler knows the tiles, and ends with index INT_MAX.
  const int num_m_blocks = (p.len_q + kBlockM - 1) / kBlockM;
  const int num_tiles = Traits::kSequences ? INT_MAX : num_m_blocks * p.heads * p.batch;  // flash_api: < 2^31
  const int num_n_blocks = (p.len_k + kBlockN - 1) / kBlockN;

  extern __shared__ unsigned char smem_raw[];
  const SharedStorage<T, Traits> smem(smem_raw);
  if (threadIdx.x == 0) smem.init_barriers();
  __syncthreads();

  // Values every lane of a warp shares are broadcast from lane 0 (here and for the tile index): ptxas then keeps the
  // tile and pipeline arithmetic in uniform registers and needs no convergence barriers in the key loop.
  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  if (warpgroup == 0) {  // ---------------------------------------------------------------------------- producer
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    FwdProducer<T, Traits> producer{smem, q_map, k_map, v_map, p};
    Scheduler scheduler(p, num_tiles, num_m_blocks, num_n_blocks);
    FwdWork work = scheduler.first();
    for (int j = 0;; ++j) {
      if constexpr (Traits::kOrder == TileOrder::kDynamic || Traits::kSequences) scheduler.publish(work, j, smem);
      if (work.index >= num_tiles) break;
      const TileT tile = tile_of<TileT>(work, scheduler, num_m_blocks, p);
      if constexpr (Traits::kOptions) work.n_begin = tile.n_first;
      if constexpr (!kStreamK) work.n_end = tile.num_n_blocks;
      producer.load(tile, work.n_begin, work.n_end);
      scheduler.advance(work, j);
    }
    producer.finish();
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int consumer = warpgroup - 1;                                  // rows 64 * consumer .. of the tile
  const int warp = __shfl_sync(0xffffffff, threadIdx.x / 32, 0) % 4;  // warp inside the warpgroup: 16 rows each
  const int lane = threadIdx.x % 32;
  using Mainloop = FwdConsumer<T, Traits, kCausal>;
  Mainloop mainloop(smem, p, consumer, warp, lane);
  FwdEpilogue<T, Traits, kCausal> epilogue(smem, o_map, p, consumer, warp, lane);
  Mainloop::start_turns(consumer);
  Scheduler scheduler(p, num_tiles, num_m_blocks, num_n_blocks);
  FwdWork work{static_cast<int>(blockIdx.x), 0, 0};
  for (int j = 0; scheduler.next(work, j, smem); ++j) {
    const TileT tile = tile_of<TileT>(work, scheduler, num_m_blocks, p);
    if constexpr (Traits::kOptions) work.n_begin = tile.n_first;
    if constexpr (!kStreamK) work.n_end = tile.num_n_blocks;
    if (tile.num_n_blocks == 0) {  // no row of this tile sees a key
      epilogue.store_keyless(tile);
      continue;
    }
    ConsumerTile done = mainloop.begin_tile(tile, work);
    if (mainloop.skip_rowless(tile, done, epilogue)) continue;

    float o[Traits::kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < Traits::kHeadDim / 2; ++i) o[i] = 0.f;
    RowSoftmax<kBlockN> softmax;
    mainloop.mma(tile, done, o, softmax, epilogue);
    // The rows' totals while the last P V runs; a tile split between two CTAs (stream-K) has them again after the
    // merge, which only then knows the rows' totals and which CTA stores them.
    float inv[2];
    const bool split_tile = kStreamK && (work.n_begin > 0 || work.n_end < tile.num_n_blocks);
    epilogue.row_totals(softmax, tile, mainloop.row_in_block0, mainloop.causal_shift, mainloop.scale_log2,
                        !split_tile, inv);
    keep_before_wgmma_wait(inv[0] + inv[1], smem.scratch);
    mainloop.wait_last_pv(o, done);
    bool store_o = true;
    if constexpr (Traits::kSequences) store_o = epilogue.finish_split(o, inv, tile);  // a KV cache's key split
    if constexpr (kStreamK) {
      if (split_tile) {
        store_o = epilogue.merge_split(o, softmax, work, mainloop.scale_log2);
        epilogue.row_totals(softmax, tile, mainloop.row_in_block0, mainloop.causal_shift, mainloop.scale_log2,
                            store_o, inv);
      }
    }
    epilogue.store(o, inv, tile, done, mainloop, store_o);
  }
  epilogue.release_staged_o();
  mainloop.end_turns();
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace flashattn::sm90
