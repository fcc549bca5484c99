// Host side of the Hopper forward: the TMA maps and the launch of the kernel variant the plan chose (fwd_plan.h).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/decode.h"
#include "cuda/launchers.h"
#include "cuda/params.h"
#include "cuda/sm90/fwd_kernel.h"
#include "cuda/sm90/fwd_traits.h"
#include "cuda/sm90/sequences.h"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/tma.h"

namespace flashattn::sm90 {

// Packed sequences: the preparation (sequences.h), from the maps over the whole packed q, k, v and out (a KV cache's:
// over its first entry).
template <typename Traits>
cudaError_t prepare_fwd_sequences(const FwdParams& params, const CUtensorMap& q_map, const CUtensorMap& k_map,
                                  const CUtensorMap& v_map, const CUtensorMap& o_map, cudaStream_t stream) {
  SequencesPrepParams prep = sequences_prep(params, kSeqMaps);
  prep.seqlens_k = params.seqlens_k;
  prep.leftpad_k = params.leftpad_k;
  prep.len_new = params.len_new;
  prep.page_size = params.block_table != nullptr ? params.page_size : 0;
  prep.block_m = Traits::kBlockM;
  prep.splits = decode_split_ctas(params.plan);  // a tile's splits that run as tiles of their own
  const bool entries = params.cu_seqlens_q == nullptr;
  const auto source = [&](const void* base, int64_t batch_stride, int64_t row_stride, bool query_rows) {
    return SeqMapSource{static_cast<const char*>(base), row_stride * 2, query_rows, entries ? batch_stride * 2 : 0};
  };
  prep.sources[kSeqMapQ] = source(params.q, params.q_batch_stride, params.q_row_stride, true);
  prep.sources[kSeqMapK] = source(params.k, params.k_batch_stride, params.k_row_stride, false);
  prep.sources[kSeqMapV] = source(params.v, params.v_batch_stride, params.v_row_stride, false);
  prep.sources[kSeqMapO] = source(params.out, params.o_batch_stride, params.o_row_stride, true);
  prep.order = params.seq_order;
  prep.tile_start = params.seq_tile_start;
  prep.maps = static_cast<CUtensorMap*>(params.seq_maps);
  const SeqMapTemplates templates{{q_map, k_map, v_map, o_map}};
  return prepare_sequences(prep, templates, stream);
}

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  const FwdPlan& plan = params.plan;
  if (plan.block_m != Traits::kBlockM || plan.block_n != Traits::kBlockN) return cudaErrorInvalidValue;
  // A softcap kernel only under softcap, an options kernel that never caps only without.
  const bool softcap = params.softcap > 0.f;
  if (Traits::kCap == CapMode::kAlways ? !softcap : Traits::kCap == CapMode::kNever && softcap) {
    return cudaErrorInvalidValue;
  }
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  // Packed sequences: maps over all rows as one batch entry (the preparation cuts each sequence's from them); a KV
  // cache's: over its first entry (the preparation moves them to each entry's).
  FwdParams shape = params;
  if constexpr (Traits::kSequences) shape.batch = 1;
  CUtensorMap q_map, k_map, v_map, o_map{};
  // The plan checked the maps' rules (tma.h: tma_can_map); the driver refusing one is unexpected.
  if (!make_qkv_maps(shape, kBf16, Traits::kBlockM / Traits::kQParts, Traits::kBlockN, &q_map, &k_map, &v_map)) {
    return cudaErrorNotSupported;
  }
  // A paged KV cache: K and V through maps over the pages (kv_boxes: a box per page, or per block of a larger page).
  if (Traits::kSequences && params.block_table != nullptr && !make_page_maps(params, kBf16, Traits::kBlockN, &k_map,
                                                                              &v_map)) {
    return cudaErrorNotSupported;
  }
  // O in boxes of one warp's 16 rows, all its columns in one where the kernel stores them so (the output is ours: its
  // strides are multiples of 16 bytes).
  const bool o_mapped = Traits::o_one_store(shape.head_dim)
                            ? make_bhld_column_block_map(&o_map, shape.out, kBf16, shape.batch, shape.heads,
                                                         shape.len_q, shape.head_dim, shape.o_batch_stride,
                                                         shape.o_head_stride, shape.o_row_stride, 16,
                                                         Traits::kColumnBlocks)
                            : make_bhld_map(&o_map, shape.out, kBf16, shape.batch, shape.heads, shape.len_q,
                                            shape.head_dim, shape.o_batch_stride, shape.o_head_stride,
                                            shape.o_row_stride, 16);
  if (!o_mapped) return cudaErrorNotSupported;
  auto kernel = flash_fwd_sm90_kernel<T, Traits, kCausal>;
  static_assert(sizeof(T) == 2, "16-bit elements");
  if (allow_dynamic_smem(kernel, Traits::kSmemBytes) != cudaSuccess) return cudaErrorNotSupported;
  if constexpr (Traits::kSequences) {
    const cudaError_t err = prepare_fwd_sequences<Traits>(params, q_map, k_map, v_map, o_map, stream);
    if (err != cudaSuccess) return err;
  }
  kernel<<<plan.grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(q_map, k_map, v_map, o_map, params);
  const cudaError_t err = cudaGetLastError();
  // A KV cache's key splits: their parts folded into out and lse (with the sinks) by the decode path's combine.
  if (err != cudaSuccess || !Traits::kSequences || decode_split_ctas(plan) == 1) return err;
  return run_decode_combine<T>(params, Traits::kHeadDim, stream);
}

// An options tile (BlockN keys, Consumers) in its softcap kernel or its kernel without softcap, as the call asks (a
// window kernel that never caps keeps its registers); with kOneKernel in one kernel that caps where the call asks.
template <typename T, int HeadDim, bool kCausal, int BlockN, int Consumers, bool kOptions, bool kOneKernel = false>
cudaError_t launch_fwd_tile(const FwdParams& params, cudaStream_t stream) {
  if constexpr (kOptions && kOneKernel) {
    using Traits = FwdTraits<HeadDim, kCausal, BlockN, Consumers, true, false, CapMode::kPerCall>;
    return launch_fwd_sm90<T, Traits, kCausal>(params, stream);
  } else {
    if constexpr (kOptions) {
      using Traits = FwdTraits<HeadDim, kCausal, BlockN, Consumers, true, false, CapMode::kAlways>;
      if (params.softcap > 0.f) return launch_fwd_sm90<T, Traits, kCausal>(params, stream);
    }
    return launch_fwd_sm90<T, FwdTraits<HeadDim, kCausal, BlockN, Consumers, kOptions>, kCausal>(params, stream);
  }
}

// Launches the Hopper forward with HeadDim 64, 128 or 256 on `stream` as params.plan says (kOptions: the variants
// with windows, softcap and sinks; kSequences: with packed sequences too). Returns cudaErrorInvalidValue where the
// plan names a variant this head dim does not have, cudaErrorNotSupported where the driver refuses a tensor map or
// the shared memory; launches nothing then.
template <typename T, int HeadDim, bool kCausal, bool kOptions, bool kSequences>
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  const FwdPlan& plan = params.plan;
  if constexpr (kSequences) {  // one shape per head dim (tile_size.h: fwd_sequences_tile_shape)
    constexpr FwdTileShape kShape = fwd_sequences_tile_shape(HeadDim, kCausal);
    using Traits = FwdTraits<HeadDim, kCausal, kShape.block_n, kShape.consumers, true, true, CapMode::kPerCall>;
    return launch_fwd_sm90<T, Traits, kCausal>(params, stream);
  } else if constexpr (HeadDim == 64) {
    if constexpr (kCausal) {  // three consumers: one kernel (as a softcap kernel its consumers spilled 292 B)
      if (plan.consumers == 2) return launch_fwd_tile<T, 64, true, 128, 2, kOptions>(params, stream);
      return launch_fwd_tile<T, 64, true, 128, 3, kOptions, true>(params, stream);
    } else {
      return launch_fwd_tile<T, 64, false, 128, 3, kOptions>(params, stream);
    }
  } else if constexpr (HeadDim == 128) {
    if constexpr (kOptions) {  // softcap: three consumers over 64-key blocks, the only tile that caps
      if (plan.consumers == 3) {
        return launch_fwd_sm90<T, FwdTraits<128, kCausal, 64, 3, true, false, CapMode::kAlways>, kCausal>(params,
                                                                                                        stream);
      }
    }
    return launch_fwd_sm90<T, FwdTraits<128, kCausal, 128, 2, kOptions>, kCausal>(params, stream);
  } else {
    if (plan.block_n == 64) return launch_fwd_tile<T, 256, kCausal, 64, 2, kOptions>(params, stream);
    return launch_fwd_tile<T, 256, kCausal, 80, 2, kOptions>(params, stream);
  }
}

}  // namespace flashattn::sm90
