// The portable forward's CTA shape and shared memory for a head-dim bucket: decided here once, read by the kernel's
// traits (sm80/fwd_kernel.h) and by the host plan, which picks how many K/V tiles the device's CTAs may hold. Host and
// device code alike.
#pragma once

namespace flashattn::sm80 {

struct FwdTileShape {
  int warps;       // 4 up to D = 128 (32 query rows each), 8 above (16 rows each)
  int block_m;     // query rows per CTA: 128 for every head dim
  int block_n;     // keys per block
  int smem_stride; // elements per shared-memory row: D + 8
};

// Up to D = 128 a warp owns 32 rows (two m16 tiles), so every K/V fragment read from shared memory feeds two MMAs:
// with 16 rows per warp the CTA would be bound by ldmatrix bandwidth rather than by the tensor cores. Past 128 the
// fp32 accumulator of 32 rows no longer fits in registers; there 8 warps own 16 rows each. Wider key blocks halve the
// per-block overhead (barriers, row max reductions) where registers allow. Rows of shared-memory tiles are padded by
// 16 bytes: consecutive rows then start in different 16-byte bank groups, which makes every ldmatrix (8 rows x 16
// bytes) conflict-free for any D that is a multiple of 32.
constexpr FwdTileShape fwd_tile_shape(int head_dim) {
  return {head_dim <= 128 ? 4 : 8, 128, head_dim <= 64 ? 128 : 64, head_dim + 8};
}

// The Q tile and `kv_tiles` K/V tiles of fp16 / bf16: 4 (K and V double-buffered), 2 (one tile of each) or 1 (K, then
// V, in one tile).
constexpr int fwd_smem_bytes(int head_dim, int kv_tiles) {
  const FwdTileShape shape = fwd_tile_shape(head_dim);
  return (shape.block_m + kv_tiles * shape.block_n) * shape.smem_stride * 2;
}

// The least shared memory a CTA may opt into on a GPU of sm_80 or later (sm_86, sm_89, sm_120: 99 KB).
inline constexpr int kLeastSmemPerBlock = 99 * 1024;

// Whether every such GPU gives the bucket its 4 K/V tiles (up to D96): its kernel then knows them at compile time.
constexpr bool fwd_always_four_tiles(int head_dim) { return fwd_smem_bytes(head_dim, 4) <= kLeastSmemPerBlock; }

// The most K/V tiles, up to `most` (4, 2 or 1), whose shared memory a CTA may have (`smem_per_block`, the device's
// opt-in limit): 4 on sm_90 and on sm_80 up to D192, fewer for the larger buckets on sm_80 (163 KB) and from D128 on
// sm_86 / sm_89 (99 KB); 4 wherever fwd_always_four_tiles; 0 where not even one fits.
constexpr int fwd_kv_tiles(int head_dim, int smem_per_block, int most = 4) {
  if (fwd_always_four_tiles(head_dim)) return 4;
  for (int tiles = most; tiles >= 1; tiles /= 2) {
    if (fwd_smem_bytes(head_dim, tiles) <= smem_per_block) return tiles;
  }
  return 0;
}

static_assert(fwd_kv_tiles(256, kLeastSmemPerBlock) == 1, "one K/V tile fits every GPU of sm_80 or later at D256");

}  // namespace flashattn::sm80
