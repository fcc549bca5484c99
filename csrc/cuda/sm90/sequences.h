// Packed sequences in the Hopper kernels, host and device halves; the forward takes a KV cache's entries as sequences
// too (cu_seqlens_q null: each entry's len_q query rows, its keys from cache_seqlens and the left padding: params.h,
// entry_keys; a paged cache's keys through the pages' maps, fwd_mainloop.h: kv_boxes). Before a kernel, one small
// kernel (sequences.cu) reads the lengths on the device (the host never does) and writes:
//   tensor maps per sequence (forward: q, k, v, out; backward: q, k, v, dout, dq_accum) whose base is the
//   sequence's first row and whose extent its length: TMA then zero-fills reads past the sequence's end and clips
//   stores there, as it does at a dense tensor's end (a paged cache's k and v: the pages' maps, each entry's cut to
//   the rows of its last page);
//   for the forward, the order in which the sequences' tiles run (longest keys first, so the short tiles come last)
//   and each rank's first tile in that order (its sequence's query blocks times the heads times a cache's key splits,
//   split by split, head by head), from which the producer decodes the tile indices it takes from a counter
//   (tile_scheduler.h: SequenceScheduler).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flashattn::sm90 {

// A sequence's maps in the forward, and in the backward, in this order.
enum SeqMap : int { kSeqMapQ, kSeqMapK, kSeqMapV, kSeqMapO, kSeqMaps };
enum BwdSeqMap : int { kBwdSeqMapQ, kBwdSeqMapK, kBwdSeqMapV, kBwdSeqMapDout, kBwdSeqMapDq, kBwdSeqMaps };
inline constexpr int kMaxSeqMaps = 5;

// The call's workspace, byte offsets from its start: the tile counter (zeroed before the launch), the order, the
// tile starts (batch + 1), the maps (128-byte aligned, as tensormap.replace needs).
struct SequencesWorkspace {
  int64_t order, tile_start, maps, bytes;
};
constexpr int64_t round_up_128(int64_t bytes) { return (bytes + 127) / 128 * 128; }
constexpr SequencesWorkspace sequences_workspace(int64_t batch) {
  const int64_t order = 128;
  const int64_t tile_start = round_up_128(order + 4 * batch);
  const int64_t maps = round_up_128(tile_start + 4 * (batch + 1));
  return {order, tile_start, maps, maps + static_cast<int64_t>(sizeof(CUtensorMap)) * kSeqMaps * batch};
}
static_assert(sizeof(CUtensorMap) == 128, "a tensor map is 128 bytes");

// Up to this many sequences are sorted (one CTA ranks them against each other); more run in their packed order.
inline constexpr int kMaxSortedSequences = 2048;

// A sequence's query blocks.
__host__ __device__ constexpr int sequence_m_blocks(int len_q, int block_m) { return (len_q + block_m - 1) / block_m; }

// A KV cache's key splits (FwdPlan::splits > 1, query chunks only): split s of an entry's tile takes key blocks
// s * b .. (s + 1) * b - 1 (b from the cache's capacity, never its valid lengths), its normalised part and lse go to
// the workspace and the decode path's combine folds them (decode.h).
__host__ __device__ constexpr int split_key_blocks(int64_t capacity, int block_n, int splits) {
  const int64_t blocks = (capacity + block_n - 1) / block_n;
  return static_cast<int>((blocks + splits - 1) / splits);
}

// A paged KV cache in the forward (block_n-key blocks): pages of a multiple of 8 rows (whole 128-byte swizzle atoms)
// that divide the key blocks or that they divide, so that no TMA box crosses a page; a box is a page's rows, or a key
// block's where pages are longer.
__host__ __device__ constexpr bool boxes_pages(int page_size, int block_n) {
  return page_size % 8 == 0 && (page_size % block_n == 0 || block_n % page_size == 0);
}
__host__ __device__ constexpr int page_box_rows(int page_size, int block_n) {
  return page_size < block_n ? page_size : block_n;
}

// A tensor the preparation maps per sequence: its base, the bytes from row to row and (a cache's entries) from entry
// to entry, and whether its rows are the queries' or the keys'.
struct SeqMapSource {
  const char* base;
  int64_t row_bytes;
  bool query_rows;
  int64_t entry_bytes;
};

// What the preparation reads and writes.
struct SequencesPrepParams {
  const int* cu_seqlens_q;  // null: a KV cache's entries, total_q rows each, keys as FwdParams' seqlens_k etc. say
  const int* cu_seqlens_k;
  const int* seqlens_k;
  const int* leftpad_k;
  int len_new;
  int page_size;  // a paged cache's (key maps: the pages' map, cut to the rows of each entry's last page), or 0
  int batch, heads, total_q, total_k, block_m;
  int splits;  // key splits per tile (a KV cache's entries), 1 without
  int num_maps;
  SeqMapSource sources[kMaxSeqMaps];
  int* order;  // null: no tile order (the backward)
  int* tile_start;
  CUtensorMap* maps;  // [batch][num_maps]
};
// The maps over the whole packed tensors (rows = the totals), which each sequence's copy rebases and cuts to its rows.
struct SeqMapTemplates {
  CUtensorMap map[kMaxSeqMaps];
};

// The preparation's sizes for a packed call's FwdParams or BwdParams (its totals in len_q and len_k), num_maps maps
// per sequence; the caller names their sources (and a KV cache's lengths).
template <typename Params>
SequencesPrepParams sequences_prep(const Params& p, int num_maps) {
  SequencesPrepParams prep{};
  prep.cu_seqlens_q = p.cu_seqlens_q;
  prep.cu_seqlens_k = p.cu_seqlens_k;
  prep.batch = p.batch;
  prep.heads = p.heads;
  prep.total_q = p.len_q;
  prep.total_k = p.len_k;
  prep.splits = 1;
  prep.num_maps = num_maps;
  return prep;
}

// Enqueues the preparation on `stream`.
cudaError_t prepare_sequences(const SequencesPrepParams& prep, const SeqMapTemplates& templates, cudaStream_t stream);

// A tile as the producer decodes it and hands it to the consumers (eight ints: one mailbox slot).
struct SeqTile {
  int index;  // its place in the order; -1: the CTA is done
  int batch, m_block, head;
  int q_offset, len_q, len_k;  // the sequence's first row in q, out and lse (packed); its lengths
  int split;                   // its key split (split_key_blocks), 0 without
};
static_assert(sizeof(SeqTile) == 8 * sizeof(int), "a mailbox slot");

}  // namespace flashattn::sm90
