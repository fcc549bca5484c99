"""Shapes the tests share, and Python models of the Hopper forward's host schedule (csrc/cuda/sm90/tile_size.h and
tile_scheduler.h), from which tests predict which schedule a shape gets on the GPU they run on."""
import os

import torch

LENGTHS = [1, 7, 63, 65, 97, 129, 1025]
LENGTH_PAIRS = [(n, n) for n in LENGTHS] + [
    (1, 129),  # decode
    (1, 1025),  # decode, long cache
    (7, 65),
    (63, 97),
    (65, 1025),
    (129, 65),  # Lq > Lk: under causal the first 64 rows see no key
    (97, 7),
    (65, 1),
]
# (Lq, Lk) whose last key block holds one key (1025, 4097, 513) or whose rows cross several query blocks.
TRAILING_LENGTHS = [(1025, 1025), (65, 1025), (129, 4097), (300, 513)]
CUDA_HEAD_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]  # the buckets of the CUDA kernels
# Non-bucket dims (120: bucket 128 with a partly empty second 64-column tile); 1 and 5 run on CPU only.
HEAD_DIMS = CUDA_HEAD_DIMS + [40, 72, 120, 200] + [1, 5]

STREAM_K_MIN_BLOCKS = 12  # tile_scheduler.h kStreamKMinBlocks


def hopper_forward():
    """Whether the Hopper forward runs here (an sm_90 GPU, FLASHATTN_FWD_SM90 not 0)."""
    return torch.cuda.get_device_capability() == (9, 0) and os.environ.get("FLASHATTN_FWD_SM90", "1") != "0"


def stream_k_tiles(num_tiles, grid, num_n_blocks, min_blocks):
    """tile_scheduler.h stream_k_tiles: how many of the last tiles the D128 Hopper forward without a mask splits."""
    rounds, rest = divmod(num_tiles, grid)
    if num_n_blocks < min_blocks or rounds < 2 or rest == 0 or rest * 8 > grid * 7:
        return 0
    return num_tiles - (rounds - 1) * grid


def causal_block_m(head_dim, len_q, len_k):
    """tile_size.h fwd_tile_shape: query rows per causal tile of the Hopper forward."""
    return 192 if head_dim <= 64 and len_q >= 1024 and len_k >= 1024 else 128


def causal_zigzag_grid(num_m_blocks, num_tiles, num_sms):
    """tile_scheduler.h causal_zigzag_grid: the grid of the static causal schedule, 0 for the counter."""
    size = num_sms
    while size > 0 and size * 32 >= num_sms * 31:
        if size < num_sms and num_m_blocks > 64:
            return 0
        if num_tiles <= size:
            return size
        if (size % num_m_blocks == 0 and num_tiles % (2 * size) == 0) or num_m_blocks % (2 * size) == 0:
            return size
        size -= 1
    return 0
