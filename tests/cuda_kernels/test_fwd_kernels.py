"""The CUDA kernels beyond the op contract: agreement with the CPU backend, the tile and key-block switches of the
Hopper forward, its schedules (stride, stream-K, counter, zigzag), streams, and 64-bit offsets."""
import math
import os

import pytest
import torch

import flashattn_ext  # noqa: F401  (registers torch.ops.flashattn)
from cases import causal_block_m, causal_zigzag_grid, hopper_forward, stream_k_tiles
from isolated import run_isolated
from cuda_kernels.schedule_runs import forward_each
from reference import (
    assert_attention_close,
    assert_error_within,
    attention_ref,
    fwd_and_check,
    make_qkv,
    rows_with_keys,
    steer_scores,
)

fwd = torch.ops.flashattn.fwd
run_and_check = fwd_and_check


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 72])
@pytest.mark.parametrize("len_q,len_k", [(257, 257), (1, 513), (200, 97)], ids=["q257-k257", "q1-k513", "q200-k97"])
def test_cuda_matches_cpu(dtype, causal, head_dim, len_q, len_k):
    q, k, v = make_qkv(2, 4, 2, len_q, len_k, head_dim, dtype, "cuda")
    out, lse = fwd(q, k, v, causal)
    # Reference: our CPU kernel on the same inputs upcast to float32.
    cpu_out, cpu_lse = fwd(q.cpu().float(), k.cpu().float(), v.cpu().float(), causal)
    keyed = rows_with_keys(len_q, len_k, causal, "cpu")
    low_precision = [attention_ref(q, k, v, causal, upcast=False)[0].cpu()]
    assert_error_within(out.cpu(), cpu_out, low_precision, keyed, "CUDA vs CPU float32")
    torch.testing.assert_close(lse.cpu(), cpu_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_several_tiles_per_cta(causal, head_dim):
    # More tiles than SMs: each persistent CTA of the Hopper forward walks several, carrying its pipeline counters,
    # O buffers and turns from tile to tile. Lq = 1000 = 5 * 192 + 40: with 192-row tiles (D64 non-causal) the last
    # tile of every head has two consumers without rows.
    q, k, v = make_qkv(4, 16, 8, 1000, 1000, head_dim, torch.bfloat16, "cuda")
    run_and_check(q, k, v, causal)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,causal", [(128, False), (256, False), (256, True), (128, True), (64, True)])
@pytest.mark.parametrize("len_k", [40, 176, 300])
def test_cuda_short_tiles_back_to_back(head_dim, causal, len_k):
    # Several tiles per CTA with one or two key blocks each (under the causal mask many see none): a consumer reaches
    # its next epilogue soon after its last, whose staged O it releases only after the next tile's first S GEMM is
    # issued (fwd_epilogue.h, release_staged_o). D256 (64-key blocks at these lengths) stages the second consumer's O
    # in the V stage of the tile's last block (kLastOInV), which the producer reloads only once that O has left, also
    # where the next tile's one block lies in the other stage; D128 (128-key blocks at these lengths) and D64 causal
    # have a buffer per consumer.
    q, k, v = make_qkv(4, 16, 8, 1000, len_k, head_dim, torch.bfloat16, "cuda")
    run_and_check(q, k, v, causal)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("len_q", [8192, 9000], ids=["zigzag", "counter"])
def test_cuda_causal_many_tiles_without_keys_in_a_row(head_dim, len_q):
    # Lq >> Lk: all but the last tile of each head see no key, so a persistent CTA takes a dozen keyless tiles in a row
    # (in zigzag rounds at 64 query blocks a head, at the counter's end at 71), right after tiles whose last loads its
    # consumers may still wait for (K ahead of V across tiles holds a tile's last V back until the next K).
    q, k, v = make_qkv(2, 16, 8, len_q, 200, head_dim, torch.bfloat16, "cuda")
    # In a process of its own, whose timeout ends a hang.
    [(out, lse, _)] = run_isolated({}, "cuda_kernels.schedule_runs", "forward_each", [(q, k, v, True, None)],
                                   timeout=180)
    assert_attention_close(out, lse, q, k, v, causal=True)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [256, 200])
@pytest.mark.parametrize(
    "causal,batch,heads,len_q,len_k",
    [
        (False, 1, 4, 129, 512),
        (False, 1, 4, 129, 513),
        (False, 1, 4, 30, 1100),  # the second consumer's Q rows (and O) lie wholly past Lq
        (False, 1, 4, 300, 2000),
        (False, 4, 16, 600, 1100),  # 320 tiles, two or three per CTA: the next tile's second K waits for an O store
        (True, 1, 4, 129, 2048),
        (True, 1, 4, 129, 2049),
        (True, 1, 4, 300, 3000),
        (True, 2, 16, 1000, 8300),  # 256 tiles: two zigzag rounds per CTA
        (True, 1, 2, 8400, 8300),  # Lq > Lk: the first 100 rows see no key
        (True, 2, 16, 2400, 2100),  # 608 tiles from the counter; the first 300 rows (two whole tiles) see no key
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_d256_key_block_switch(head_dim, causal, batch, heads, len_q, len_k, dtype):
    # On Hopper, D256 (and the buckets it serves) takes 64-key blocks and an O buffer up to 512 keys (2048 under a
    # causal mask: tile_size.h, d256_short_max_keys), 80-key blocks above, with the first consumer's O staged in
    # the K stage of the tile's last block without a mask (kFirstOInK) or in its rows of Q under one (kOInQ), and the
    # second's in a V stage (kLastOInV): both sides of each switch, and the 80-key kernels over several tiles per CTA,
    # with a consumer that has no rows, and with tiles that see no key. Both kernels are correct on either side, so this
    # checks results, not which kernel ran.
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, dtype, "cuda")
    run_and_check(q, k, v, causal)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [128, 120])
@pytest.mark.parametrize(
    "causal,batch,heads,len_q,len_k",
    [
        (True, 1, 4, 129, 4096),
        (True, 1, 4, 129, 4097),
        (True, 2, 16, 1000, 8300),  # 256 tiles: two zigzag rounds per CTA
        (True, 1, 2, 8400, 8300),  # Lq > Lk: the first 100 rows see no key
        (False, 1, 4, 129, 2048),
        (False, 1, 4, 129, 2049),
        (False, 2, 16, 1000, 1999),  # 128-key blocks, the last one partial; several tiles per CTA
    ],
    ids=lambda value: str(value),
)
def test_cuda_d128_key_blocks(head_dim, causal, batch, heads, len_q, len_k):
    # D128 takes 128-key blocks at every length (tile_size.h, fwd_tile_shape). An earlier kernel switched to 176-key
    # blocks above 4096 keys under a causal mask (above 2048 without one): both sides of those lengths, several tiles
    # per CTA, and rows that see no key.
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, torch.bfloat16, "cuda")
    run_and_check(q, k, v, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [128, 120])
@pytest.mark.parametrize("len_k", [1, 64, 65, 128, 129, 176, 177, 2113, 2176, 2177, 2240, 2241, 2288, 2289, 4096])
def test_cuda_partial_last_key_block(head_dim, len_k, dtype):
    # Without a mask the Hopper forward at D128 takes 128-key blocks at every length (tile_size.h, fwd_tile_shape), the
    # last one partial unless L_k is a multiple of 128 (2176 = 17 x 128): partial blocks of 1 to 127 keys, one and
    # several blocks, above and below 2048 keys (an earlier 176-key kernel's range).
    q, k, v = make_qkv(2, 4, 2, 130, len_k, head_dim, dtype, "cuda")
    run_and_check(q, k, v, causal=False)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize(
    "len_q,len_k",
    [(1023, 1024), (1024, 1023), (1024, 1024), (1025, 3000), (4100, 2100), (2100, 4100)],
)
def test_cuda_d64_causal_tile_switch(head_dim, len_q, len_k):
    # Under a causal mask the Hopper forward at D64 (and the buckets it serves) takes 192-row tiles once queries and
    # keys both reach 1024, 128-row tiles below (tile_size.h: fwd_tile_shape): both sides of the switch, and 192-row
    # tiles that see no key (Lq > Lk: the first 2000 rows).
    q, k, v = make_qkv(1, 4, 2, len_q, len_k, head_dim, torch.bfloat16, "cuda")
    run_and_check(q, k, v, causal=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize(
    "batch,heads,len_q,len_k",
    [(1, 4, 1030, 1030), (1, 4, 2048, 2048), (1, 4, 1100, 1037), (1, 4, 2900, 1500), (1, 4, 1500, 2900),
     (1, 4, 2200, 2500), (2, 16, 2048, 2048), (2, 16, 1030, 2200), (4, 32, 1024, 1024), (1, 4, 1000, 1000),
     (1, 4, 40, 1300), (2, 16, 1000, 1300), (8, 64, 40, 600), (1, 4, 2900, 3000), (1, 4, 1153, 1153),
     (1, 4, 1190, 1190), (1, 4, 1130, 1130), (1, 4, 1100, 1090)],
)
def test_cuda_consumer_skips(head_dim, causal, batch, heads, len_q, len_k, dtype):
    # With three consumers (D64 without a mask; under one only where Lq and Lk reach 1024) a Hopper consumer without
    # rows in its tile computes nothing (fwd_traits.h, kSkipRowlessConsumers: Lq mod 192 in 1..128, as at 40, 1000,
    # 1024, 1030, 2048 and 2900; at 40, 1000, 1024 and 2900 one consumer has rows in a head's part-empty tile). Without
    # a mask that tile is a head's last; under one it is its first, as the tiles end at Lq (kTilesEndAtLq, rounded to 16
    # rows), and starts at a negative row. There a consumer's rows cross row 0, and its O boxes before row 0 are
    # skipped: consumer 1's at 1030, consumer 0's at 1130 (one box) and 1100 / 1090, consumer 2's at 2900 / 3000, 1190
    # (one box) and 1153 (all but its last box; the last tile ends 15 rows past Lq); at 1100 / 1037 and 2900 / 1500
    # those rows see no key. At 40 and 1000 under a mask the two-consumer kernel runs, whose consumers all compute.
    # Under a causal mask a consumer also computes only the key blocks its own 64 rows see (kSkipUnseenBlocks: the
    # three-consumer D64 tiles, D256's 64- and 80-key blocks). Lq = Lk and bottom-right offsets both ways; D256 over
    # 2048 keys (causal) or 512 (not) takes 80-key blocks. The 2 x 16, 4 x 32 and 8 x 64 heads run several tiles per
    # CTA, so the pipeline counts carry across tiles with skipped blocks and rows; without a mask 4 x 32 heads at 1024
    # take a grid of 131 CTAs on a 132-SM H200 (tile_scheduler.h, static_grid).
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, dtype, "cuda")
    run_and_check(q, k, v, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [(-1, -1), (300, 0), (100, 40)], ids=["w-1_-1", "w300_0", "w100_40"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "batch,heads,len_q,len_k",
    [(1, 4, 1030, 1030), (1, 4, 1100, 1037), (1, 4, 1500, 2900), (1, 4, 2900, 1500), (2, 16, 1000, 1300),
     (8, 64, 40, 600)],
)
def test_cuda_softcap_three_consumers(batch, heads, len_q, len_k, causal, window, dtype):
    # D128 under softcap runs three consumers over 64-key blocks (tile_size.h): consumers without rows in a head's
    # part-empty tile (Lq mod 192 in 1..128: 1030, 2900, 1000, 40), causal tiles ending at Lq and so starting at a
    # negative row, consumers that skip the blocks past their rows, band edges inside 64-key blocks, and several tiles
    # per CTA (2 x 16 and 8 x 64 heads). Scale 2.0 peaks the scores, so the cap binds.
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, 128, dtype, "cuda")
    out, lse = fwd(q, k, v, causal, 2.0, list(window), 30.0)
    assert_attention_close(out, lse, q, k, v, causal, 2.0, window, 30.0, None)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("softcap", [30.0, 50.0], ids=["cap30", "cap50"])
@pytest.mark.parametrize("window", [(-1, -1), (300, 0)], ids=["w-1_-1", "w300_0"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("len_q,len_k", [(1030, 1030), (1500, 2900), (300, 700)])
def test_cuda_softcap_kernels(head_dim, causal, window, softcap, len_q, len_k, dtype):
    # D64 and D256 cap in kernels of their own (fwd_traits.h: CapMode), the tanh inside the exponentials' pass on
    # blocks without a mask: every tile (D64 causal: two consumers below 1024 rows, three above, in the kernel that
    # caps per call; D256: 64-key blocks on short keys, 80 on long), band edges, and both reference rules: bf16 up to
    # softcap 40 a fixed one (the D256 kernel then skips the block maximum), else references that move, the scores
    # rising along the keys from -20 to over 100 (log2 units before the cap), so that the optimistic D64 kernel turns
    # blocks back.
    scale = 1.0 / math.sqrt(head_dim)
    q, k, v = make_qkv(1, 4, 2, len_q, len_k, head_dim, torch.float32, "cuda")
    q, k = steer_scores(q, k, 0.05 * torch.arange(len_k, device="cuda") - 20.0, scale)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = fwd(q, k, v, causal, scale, list(window), softcap)
    assert_attention_close(out, lse, q, k, v, causal, scale, window, softcap, None)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("growth", [-0.05, 0.01, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("len_q,len_k", [(300, 1000), (2000, 2100)], ids=["short", "long"])
def test_cuda_growing_row_max(head_dim, growth, causal, len_q, len_k, dtype):
    # Scores that grow along the keys by `growth` (log2 units per key) in even rows and half that in odd ones, so the
    # row max rises on every key block, or never (growth < 0), and the rows of one warp move on different blocks. The
    # Hopper forward takes a key block's exponentials against the row's unmoved reference while each row's sum over a
    # thread's columns stays below 2^14 (softmax.h, ExpPolicy::kOptimistic): with growth 0.01 the blocks stand until the
    # scores have risen about 8.5 log2 units past the reference, at 0.05 (6.4 per 128-key block) about every other block
    # is turned back, at 0.3 and 1.0 every one; at 1.0 the exponentials of the 128-key blocks overflow to inf. fp16's P
    # holds at most 65504. Here the last key block dominates the rows without a mask: test_cuda_turned_back_key_blocks
    # puts the peak in an earlier one. "long" reaches the three-consumer causal D64 kernel, whose first tile of a head
    # starts at row -112 there (kTilesEndAtLq).
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, head_dim, torch.float32, "cuda")
    q, k = steer_scores(q, k, growth * torch.arange(len_k, device="cuda"), 1.0 / math.sqrt(head_dim))
    run_and_check(*(t.to(dtype) for t in (q, k, v)), causal)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("growth", [0.05, 1.0])
@pytest.mark.parametrize("sign", [1, -1], ids=["scale+", "scale-"])
@pytest.mark.parametrize(
    "head_dim,len_q,len_k",
    [(64, 2000, 2100), (128, 600, 1500), (128, 1900, 2100), (128, 600, 5000), (256, 300, 512), (256, 2000, 2100)],
)
def test_cuda_turned_back_key_blocks(head_dim, len_q, len_k, sign, growth, causal, dtype):
    # Scores that rise by `growth` log2 units per key up to 60% of the keys and fall after it, so a middle key block
    # dominates each row that sees it, and the blocks before it are turned back by the Hopper forward's optimistic
    # exponentials (softmax.h, ExpPolicy::kOptimistic: S computed again, then the max-based update; at growth 1.0 after
    # overflowing to inf). The shapes reach every kernel: D64 with three consumers, D128 (128-key blocks at every
    # length; causal at 5000 keys, where an earlier kernel took 176-key blocks), D256 with 64-key (512 keys without a
    # mask) and 80-key blocks; 24 heads give every CTA several tiles, so the held K stages and the next tiles' loads
    # interleave. A negative scale takes the negated scores through the same path.
    run_and_check(*turned_back_inputs(head_dim, len_q, len_k, sign, growth, dtype), causal, sign / math.sqrt(head_dim))


def turned_back_inputs(head_dim, len_q, len_k, sign, growth, dtype):
    """test_cuda_turned_back_key_blocks' q, k, v: 24 heads, scores peaking at 60% of the keys."""
    heads = 24
    q, k, v = make_qkv(1, heads, heads // 2, len_q, len_k, head_dim, torch.float32, "cuda")
    keys = torch.arange(len_k, device="cuda", dtype=torch.float32)
    peak = int(0.6 * len_k)
    q, k = steer_scores(q, k, growth * (peak - (keys - peak).abs()), sign / math.sqrt(head_dim))
    return tuple(t.to(dtype) for t in (q, k, v))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_turned_back_key_blocks_in_split_tiles(dtype):
    # The same scores through the stream-K tail (forced: by default the forward runs whole tiles), whose split tiles'
    # parts each turn blocks back and merge by their own maxima: at 2100 keys 360 tiles on 132 SMs, the last 228 split.
    cases = []
    for sign in (1, -1):
        for growth in (0.05, 1.0):
            cases.append((*turned_back_inputs(128, 1900, 2100, sign, growth, dtype), False, sign / math.sqrt(128)))
    results = run_isolated({"FLASHATTN_FWD_SCHEDULE": "stream-k"}, "cuda_kernels.schedule_runs", "forward_each", cases)
    for (q, k, v, causal, scale), (out, lse, _) in zip(cases, results):
        assert_attention_close(out, lse, q, k, v, causal, scale)


@pytest.mark.cuda
def test_cuda_non_default_stream():
    # Inputs are written on a side stream after a delay; the op must run on that (current) stream to see them.
    src = make_qkv(2, 4, 4, 300, 300, 64, torch.float16, "cuda")
    dst = [torch.randn_like(t) for t in src]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of spinning before the copies
        for d, s in zip(dst, src):
            d.copy_(s)
        out, lse = fwd(*dst, True)
    torch.cuda.current_stream().wait_stream(side)
    for t in (out, lse):  # allocated on the side stream, read on the current one
        t.record_stream(torch.cuda.current_stream())
    assert_attention_close(out, lse, *src, causal=True)


# (head_dim, batch, len_q, len_k, scale). Without a mask the Hopper forward's D128 kernel can split its last tiles' key
# blocks between neighbouring CTAs, which merge their parts (tile_scheduler.h: stream_k_tiles; fwd_epilogue.h:
# merge_split_tile); by default it runs whole tiles (batch-invariant), FLASHATTN_FWD_SCHEDULE=stream-k splits at any
# tile length. The heads make about 2.5 rounds of 128-row tiles on this GPU, so the last 1.5 rounds split. Keys: a
# partial last block of 102 (2150), 6 (2438), 24 (2200), 124 (2300) and 32 keys (4000, 32 blocks); D96, D120 and D80 in
# the D128 kernel; two batches with a negative scale; 2000 keys (16 blocks, the last of 80); 1037 (9 blocks), 300 (3)
# and 100 keys (1: no tile can be split, CTAs take one or two whole tiles). D256 (97 key blocks of 80) and D64 never
# split. GQA: two query heads per kv head.
STREAM_K_CASES = [
    (128, 1, 1100, 2150, None), (128, 1, 700, 2438, None), (128, 1, 300, 4000, None), (96, 1, 700, 2200, None),
    (120, 1, 1100, 2300, None), (128, 2, 700, 2200, -0.05), (128, 1, 1100, 1037, None), (128, 1, 1100, 2000, None),
    (128, 1, 700, 300, None), (128, 1, 700, 100, None), (80, 2, 300, 1000, -0.05), (256, 1, 300, 7700, None),
    (64, 1, 700, 2000, None),
]


def stream_k_shape(case):
    """(heads, tiles, tiles the forced split takes, whether the kernel can split) of a STREAM_K_CASES case here."""
    head_dim, batch, len_q, len_k, _ = case
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    m_blocks, n_blocks = -(-len_q // 128), -(-len_k // 128)
    heads = 2 * -(-5 * num_sms // (4 * m_blocks * batch))
    tiles = m_blocks * heads * batch
    in_split_kernel = 64 < head_dim <= 128
    return heads, tiles, stream_k_tiles(tiles, num_sms, n_blocks, 1) if in_split_kernel else 0, in_split_kernel


@pytest.fixture(scope="module")
def stream_k_runs():
    """Per (case, dtype): the inputs, and out, lse and allocations by default (this process), with the split forced
    and with whole tiles (a process each: the extension reads FLASHATTN_FWD_SCHEDULE once)."""
    inputs = {}
    for case in STREAM_K_CASES:
        head_dim, batch, len_q, len_k, scale = case
        heads = stream_k_shape(case)[0]
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, dtype, "cuda")
            inputs[case, dtype] = (q, k, v, False, scale)
    keys = list(inputs)
    runs = {"auto": forward_each([inputs[key] for key in keys])}
    for schedule in ("stream-k", "whole-tiles"):
        runs[schedule] = run_isolated({"FLASHATTN_FWD_SCHEDULE": schedule}, "cuda_kernels.schedule_runs",
                                      "forward_each", [inputs[key] for key in keys])
    return {key: (inputs[key], {name: results[i] for name, results in runs.items()}) for i, key in enumerate(keys)}


@pytest.mark.cuda
@pytest.mark.xdist_group("fwd_schedules")  # one worker computes the module's fixtures (a process per schedule) once
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", STREAM_K_CASES, ids=[f"d{c[0]}-b{c[1]}-q{c[2]}-k{c[3]}" for c in STREAM_K_CASES])
def test_cuda_stream_k_tail(stream_k_runs, case, dtype):
    # Checked against the reference under each schedule; the default runs whole tiles (bit for bit the same as
    # "whole-tiles"), the forced split allocates its workspace, and its merge adds the two parts in key order
    # whichever CTA finishes second, so it is as correct as the whole tiles.
    _, _, forced, in_split_kernel = stream_k_shape(case)
    if hopper_forward() and in_split_kernel and not forced:
        pytest.skip("the tiles make whole rounds on this GPU: nothing to split")
    (q, k, v, _, scale), runs = stream_k_runs[case, dtype]
    out, lse, auto_allocations = runs["auto"]
    assert_attention_close(out, lse, q, k, v, False, scale)
    forced_out, forced_lse, forced_allocations = runs["stream-k"]
    assert_attention_close(forced_out, forced_lse, q, k, v, False, scale)
    whole_out, whole_lse, whole_allocations = runs["whole-tiles"]
    assert torch.equal(out, whole_out) and torch.equal(lse, whole_lse)
    if hopper_forward():
        assert auto_allocations == whole_allocations
        assert forced_allocations == whole_allocations + (forced > 0)


# (batch, heads, len_q, len_k). On a 132-SM H200 with 128-row tiles (D128, D256): zigzag on 128 CTAs, zigzag on 132,
# zigzag with tiles that see no key, the counter. D64 takes 192-row tiles in every case but no-key-tiles: the counter
# in 8-blocks (each head's part-empty tile has two consumers without rows), 11-blocks and long-uneven, zigzag on 132 in
# uneven and long-11-blocks.
CAUSAL_CASES = {
    "8-blocks": (2, 16, 1024, 1024),
    "11-blocks": (2, 12, 1300, 1300),
    "no-key-tiles": (2, 12, 1300, 300),
    "uneven": (1, 16, 1300, 1700),
    "long-11-blocks": (2, 12, 2100, 2100),
    "long-uneven": (1, 16, 2100, 2500),
}


@pytest.fixture(scope="module")
def causal_runs():
    """Per (case, head dim): the inputs, and out, lse and allocations by default and with the counter forced (in a
    process of its own)."""
    inputs = {}
    for name, (batch, heads, len_q, len_k) in CAUSAL_CASES.items():
        for head_dim in (64, 128, 256):
            qkv = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, torch.bfloat16, "cuda")
            inputs[name, head_dim] = (*qkv, True, None)
    keys = list(inputs)
    auto = forward_each([inputs[key] for key in keys])
    counter = run_isolated({"FLASHATTN_FWD_SCHEDULE": "counter"}, "cuda_kernels.schedule_runs", "forward_each",
                           [inputs[key] for key in keys])
    return {key: (inputs[key], auto[i], counter[i]) for i, key in enumerate(keys)}


@pytest.mark.cuda
@pytest.mark.xdist_group("fwd_schedules")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", list(CAUSAL_CASES))
def test_cuda_causal_schedules_agree(causal_runs, case, head_dim):
    # On Hopper the causal tiles are handed out in static zigzag rounds or from a counter. A tile's result must not
    # depend on the CTA that computed it: both schedules give correct, bit-identical outputs over several rounds. (Where
    # zigzag rounds do not apply, half the cases on 132 SMs, the default is the counter: the two runs then show that it
    # gives the same bits twice, whichever CTA takes a tile.)
    (q, k, v, _, _), (out, lse, auto_allocations), (out_counter, lse_counter, counter_allocations) = causal_runs[
        case, head_dim]
    assert_attention_close(out, lse, q, k, v, causal=True)
    assert torch.equal(out, out_counter) and torch.equal(lse, lse_counter)
    if hopper_forward():  # the counter is one allocation (a zeroed int32), made only where the schedule uses it
        batch, heads, len_q, len_k = CAUSAL_CASES[case]
        block_m = causal_block_m(head_dim, len_q, len_k)
        num_m_blocks = -(-len_q // block_m)
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        zigzag = causal_zigzag_grid(num_m_blocks, num_m_blocks * heads * batch, num_sms) > 0
        assert counter_allocations - auto_allocations == (1 if zigzag else 0)


def portable_forward_cases():
    """Calls that run the portable forward (FLASHATTN_FWD_SM90=0, FLASHATTN_DECODE=0) in its buckets from D128, where
    GPUs with less shared memory than this one take fewer K/V tiles: (name of a flashattn_ext function, args,
    kwargs)."""
    cases = []
    for head_dim in (128, 160, 256):
        q, k, v = make_qkv(2, 4, 2, 200, 333, head_dim, torch.bfloat16, "cuda")
        cases.append(("flash_attn_with_lse", (q, k, v), dict(causal=True)))
        sinks = torch.randn(4, device="cuda")
        cases.append(("flash_attn_with_lse", (q, k, v), dict(window_size=(64, 17), softcap=20.0, sinks=sinks)))
        # A few queries against a paged cache of 15-row pages in random order (checked by the KV-cache tests).
        k_pages, v_pages = (torch.randn(44, 2, 15, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        table = torch.randperm(44, device="cuda").to(torch.int32).reshape(2, 22)
        lengths = torch.tensor([330, 17], dtype=torch.int32, device="cuda")
        cases.append(("flash_attn_with_kvcache", (q[:, :, :3], k_pages, v_pages),
                      dict(cache_seqlens=lengths, block_table=table, causal=True, return_lse=True)))
    return cases


@pytest.mark.cuda
def test_cuda_portable_forward_with_fewer_kv_tiles():
    # Double-buffered K and V (this GPU), one tile of each (sm_80 above D192, sm_86 / sm_89 from D128) and one shared
    # tile (sm_86 / sm_89 above D160): the same loads and GEMMs in another order, so the same bits; the first checked
    # against the reference.
    cases = portable_forward_cases()
    env = {"FLASHATTN_FWD_SM90": "0", "FLASHATTN_DECODE": "0"}
    runs = {tiles: run_isolated(dict(env, FLASHATTN_SM80_KV_TILES=str(tiles)), "cuda_kernels.schedule_runs",
                                "calls_each", cases) for tiles in (4, 2, 1)}
    for i, (name, args, kwargs) in enumerate(cases):
        out, lse = runs[4][0][i]
        if name == "flash_attn_with_lse":
            assert_attention_close(out, lse, *args, kwargs.get("causal", False), None,
                                   kwargs.get("window_size", (-1, -1)), kwargs.get("softcap", 0.0),
                                   kwargs.get("sinks"))
        else:
            assert out.isfinite().all()
        for tiles in (2, 1):
            assert torch.equal(runs[tiles][0][i][0], out) and torch.equal(runs[tiles][0][i][1], lse), (name, tiles)
    # The switch took: each forward kernel had less shared memory with each setting than with the one before.
    kernels = [name for name in runs[4][1] if "flash_fwd_kernel" in name]
    assert kernels
    for name in kernels:
        assert min(runs[4][1][name]) > max(runs[2][1][name]) and min(runs[2][1][name]) > max(runs[1][1][name]), name


@pytest.mark.cuda
def test_cuda_bad_schedule_switch():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="FLASHATTN_FWD_SCHEDULE must be one of auto, counter, whole-tiles"):
        run_isolated({"FLASHATTN_FWD_SCHEDULE": "static"}, "cuda_kernels.schedule_runs", "forward_each",
                     [(q, k, v, True, None)])


@pytest.mark.cuda
@pytest.mark.large
@pytest.mark.xdist_group("large")  # one worker runs the large tests, one after another
@pytest.mark.skipif(os.environ.get("FLASHATTN_TEST_LARGE") != "1", reason="set FLASHATTN_TEST_LARGE=1 (~20 GiB)")
@pytest.mark.parametrize(
    "batch,heads,len_q,len_k",
    [(65537, 8, 32, 32), (4, 32, 1, 131073)],  # > 2^31 elements in q/out; > 2^31 elements in k/v (decode)
    ids=["big-batch", "long-cache"],
)
def test_cuda_more_than_2_31_elements(batch, heads, len_q, len_k):
    head_dim = 128
    q, k, v = make_qkv(batch, heads, heads, len_q, len_k, head_dim, torch.bfloat16, "cuda")
    assert max(q.numel(), k.numel()) > 2**31
    out, lse = fwd(q, k, v, True)
    for b in (0, batch // 2, batch - 1):  # the last batch entries sit past the 2^31-element mark
        sl = slice(b, b + 1)
        assert_attention_close(out[sl], lse[sl], q[sl], k[sl], v[sl], causal=True)
