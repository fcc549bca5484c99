"""Forward correctness of flashattn.fwd against the naive reference and SDPA (see reference.py for the rule)."""
import math
import os

import pytest
import torch

import flashattn_ext
from reference import (
    OUT_FLOOR,
    assert_attention_close,
    assert_error_within,
    assert_output_properties,
    attention_ref,
    make_qkv,
    repeat_kv,
    rows_with_keys,
    visible_mask,
)

fwd = torch.ops.flashattn.fwd

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
CUDA_HEAD_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]  # the buckets of the CUDA kernels
# Non-bucket dims (120: bucket 128 with a partly empty second 64-column tile); 1 and 5 run on CPU only.
HEAD_DIMS = CUDA_HEAD_DIMS + [40, 72, 120, 200] + [1, 5]


def run_and_check(q, k, v, causal=False, scale=None):
    out, lse = fwd(q, k, v, causal, scale)
    assert_attention_close(out, lse, q, k, v, causal, scale)
    return out, lse


def steer_scores(q, k, profile, scale):
    """q and k (fp32) whose scores follow `profile` (per key, in log2 units of the softmax, i.e. after the scale) in
    the even query rows and half of it in the odd ones, over small noise: query column 0 is 1 or 0.5 on a 0.1-scaled
    rest, key column 0 the profile. Modifies k in place; returns (q, k)."""
    q = 0.1 * q
    q[..., 0::2, 0] = 1.0
    q[..., 1::2, 0] = 0.5
    k[..., 0] = profile / (scale * math.log2(math.e))
    return q, k


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", LENGTH_PAIRS, ids=[f"q{a}-k{b}" for a, b in LENGTH_PAIRS])
def test_seq_lengths(device, dtype, causal, len_q, len_k):
    q, k, v = make_qkv(2, 2, 2, len_q, len_k, 64, dtype, device)
    run_and_check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_head_dims(device, dtype, causal, head_dim):
    if device == "cuda" and head_dim % 8:
        pytest.skip("CUDA needs head dim % 8 == 0 (test_errors checks the message)")
    q, k, v = make_qkv(1, 2, 2, 97, 129, head_dim, dtype, device)
    run_and_check(q, k, v, causal)
    q, k, v = make_qkv(1, 2, 2, 129, 97, head_dim, dtype, device)
    run_and_check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_kv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("len_q,len_k", [(65, 65), (1, 97), (97, 63)], ids=["q65-k65", "q1-k97", "q97-k63"])
def test_grouped_kv_heads(device, dtype, causal, heads_kv, len_q, len_k):
    q, k, v = make_qkv(2, 4, heads_kv, len_q, len_k, 64, dtype, device)
    run_and_check(q, k, v, causal)


def test_gqa_head_mapping(device, dtype):
    # Query head h must read kv head h // (H / Hk): give each kv head a constant, distinct value vector.
    q, k, _ = make_qkv(1, 6, 3, 5, 9, 32, dtype, device)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=dtype, device=device).view(1, 3, 1, 1).expand(1, 3, 9, 32).contiguous()
    out, _ = fwd(q, k, v)
    expected = torch.tensor([1, 1, 2, 2, 3, 3], dtype=dtype, device=device).view(1, 6, 1, 1).expand_as(out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["packed_qkv", "seq_major", "padded_rows"])
def test_strided_inputs(device, dtype, causal, layout):
    len_k = 97 if layout == "packed_qkv" else 130
    q, k, v = make_qkv(2, 3, 3, 97, len_k, 64, dtype, device, layout=layout)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out, _ = run_and_check(q, k, v, causal)
    # Same numbers as with contiguous copies of the inputs (the kernel indexes with the strides it is given).
    out_contiguous, _ = fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal)
    torch.testing.assert_close(out, out_contiguous)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", [(129, 129), (65, 97)], ids=["q129-k129", "q65-k97"])
def test_peaked_softmax(device, dtype, causal, len_q, len_k):
    # Scores with a standard deviation of ~30: nearly one-hot rows, large running-max jumps between key blocks.
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, 64, dtype, device)
    q, k = q * 10, k * 3
    run_and_check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [0.25, 2.0, -0.5])
def test_custom_scale(device, dtype, causal, scale):
    q, k, v = make_qkv(1, 2, 2, 65, 97, 64, dtype, device)
    out, lse = run_and_check(q, k, v, causal, scale)
    out_default, _ = fwd(q, k, v, causal)
    assert not torch.equal(out, out_default), "the scale argument was ignored"


def test_default_scale_is_inverse_sqrt_head_dim(device, dtype):
    q, k, v = make_qkv(1, 2, 2, 33, 47, 64, dtype, device)
    out_default, lse_default = fwd(q, k, v)
    out_explicit, lse_explicit = fwd(q, k, v, False, 1.0 / math.sqrt(64))
    torch.testing.assert_close(out_default, out_explicit, rtol=0, atol=0)
    torch.testing.assert_close(lse_default, lse_explicit, rtol=0, atol=0)


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence(device, dtype, causal):
    # A few thousand keys: many key blocks per query block. One head on CPU to keep the suite fast.
    batch, heads = (1, 1) if device == "cpu" else (2, 4)
    q, k, v = make_qkv(batch, heads, heads, 2049, 2049, 64, dtype, device)
    run_and_check(q, k, v, causal)


@pytest.mark.parametrize("len_q,len_k", [(129, 65), (40, 1)], ids=["q129-k65", "q40-k1"])
def test_rows_without_keys(device, dtype, len_q, len_k):
    # Causal with Lq > Lk: query i sees keys j <= i + Lk - Lq, so rows i < Lq - Lk see nothing.
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, 64, dtype, device)
    out, lse = run_and_check(q, k, v, causal=True)
    blind = len_q - len_k
    assert (out[:, :, :blind] == 0).all() and (lse[:, :, :blind] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, blind:]).all() and (out[:, :, blind:].abs().sum(-1) > 0).all()
    # The first row that sees a key sees exactly key 0: its output is v[0].
    torch.testing.assert_close(out[:, :, blind], v[:, :, 0])


@pytest.mark.parametrize(
    "batch,heads,len_q", [(0, 2, 16), (2, 0, 16), (2, 2, 0)], ids=["batch0", "heads0", "len_q0"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_inputs(device, dtype, batch, heads, len_q, causal):
    heads_kv = heads  # heads == 0 needs Hk == 0 too (Hk must divide H)
    q, k, v = make_qkv(batch, heads, heads_kv, len_q, 24, 64, dtype, device)
    out, lse = fwd(q, k, v, causal)
    assert out.shape == (batch, heads, len_q, 64) and out.dtype == dtype and out.device == q.device
    assert lse.shape == (batch, heads, len_q) and lse.dtype == torch.float32 and lse.device == q.device


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_keys(device, dtype, causal):
    q, k, v = make_qkv(2, 2, 2, 17, 0, 64, dtype, device)
    out, lse = fwd(q, k, v, causal)
    assert_output_properties(out, lse, q)
    assert (out == 0).all()
    assert (lse == float("-inf")).all()


def test_output_properties(device, dtype):
    q, k, v = make_qkv(2, 4, 2, 70, 90, 64, dtype, device, layout="seq_major")
    out, lse = fwd(q, k, v, True)
    assert_output_properties(out, lse, q)
    assert out.stride() == (4 * 70 * 64, 70 * 64, 64, 1) and lse.stride() == (4 * 70, 70, 1)
    assert flashattn_ext.flash_attn(q, k, v, causal=True).equal(out)
    out2, lse2 = flashattn_ext.flash_attn_with_lse(q, k, v, causal=True)
    assert out2.equal(out) and lse2.equal(lse)


# ---- the accuracy rule must be able to fail --------------------------------------------------------------------


def buggy_attention(q, k, v, causal, scale, bug):
    """The float32 reference with one deliberate bug, out cast to the input dtype (what a broken kernel returns)."""
    len_q, len_k, heads = q.shape[2], k.shape[2], q.shape[1]
    qf, kf, vf = q.float(), k.float(), v.float()
    if bug == "scale":  # 10% off
        scale = 1.1 * scale
    if bug == "gqa_modulo":  # query head h reads kv head h % Hk instead of h // (H / Hk)
        kf, vf = kf.repeat(1, heads // kf.shape[1], 1, 1), vf.repeat(1, heads // vf.shape[1], 1, 1)
    else:
        kf, vf = repeat_kv(kf, heads), repeat_kv(vf, heads)
    i = torch.arange(len_q, device=q.device)[:, None]
    j = torch.arange(len_k, device=q.device)[None, :]
    visible = visible_mask(len_q, len_k, causal, q.device)
    if bug == "top_left_mask":  # SDPA's is_causal alignment instead of bottom-right
        visible = j <= i
    if bug == "mask_off_by_one":  # the diagonal key is masked too
        visible = j < i + (len_k - len_q)
    scores = (qf @ kf.transpose(-2, -1) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    if bug == "lse_log2":  # base-2 logsumexp
        lse = lse / math.log(2)
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ vf
    return out.to(q.dtype), lse


@pytest.mark.dtypes(cpu=list(OUT_FLOOR), cuda=[])
@pytest.mark.parametrize("bug", ["scale", "gqa_modulo", "top_left_mask", "mask_off_by_one", "lse_log2"])
def test_checker_rejects_bugs(device, dtype, bug):
    causal = bug != "gqa_modulo"
    q, k, v = make_qkv(1, 4, 2, 65, 97, 64, dtype, device)
    out, lse = buggy_attention(q, k, v, causal, 1 / 8, bug)
    with pytest.raises(AssertionError, match="lse|max abs error"):
        assert_attention_close(out, lse, q, k, v, causal, 1 / 8)


# ---- CUDA only --------------------------------------------------------------------------------------------------


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
    # issued (fwd_kernel.h, release_staged_o). D256 (64-key blocks at these lengths) stages the second consumer's O
    # in the V stage of the tile's last block (kLastOInV), which the producer reloads only once that O has left, also
    # where the next tile's one block lies in the other stage; D128 (128-key blocks at these lengths) and D64 causal
    # have a buffer per consumer.
    q, k, v = make_qkv(4, 16, 8, 1000, len_k, head_dim, torch.bfloat16, "cuda")
    run_and_check(q, k, v, causal)


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
    # causal mask: launch.h, sm90_d256_short_max_keys), 80-key blocks above, with the first consumer's O staged in
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
    # D128 takes 128-key blocks at every length (launch.h, sm90_fwd_block_n). Until v25 it switched to 176-key blocks
    # above 4096 keys under a causal mask (above 2048 without one before v24): both sides of those lengths, several
    # tiles per CTA, and rows that see no key.
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, torch.bfloat16, "cuda")
    run_and_check(q, k, v, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [128, 120])
@pytest.mark.parametrize("len_k", [1, 64, 65, 128, 129, 176, 177, 2113, 2176, 2177, 2240, 2241, 2288, 2289, 4096])
def test_cuda_partial_last_key_block(head_dim, len_k, dtype):
    # Without a mask the Hopper forward at D128 takes 128-key blocks at every length (launch.h, sm90_fwd_block_n), the
    # last one partial unless L_k is a multiple of 128 (2176 = 17 x 128): partial blocks of 1 to 127 keys, one and
    # several blocks, above and below 2048 keys (the 176-key kernel's range before v24).
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
    # keys both reach 1024, 128-row tiles below (launch.h: sm90_causal_block_m): both sides of the switch, and 192-row
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
    # rows in its tile computes nothing (fwd_kernel.h, kSkipRowlessConsumers: Lq mod 192 in 1..128, as at 40, 1000,
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
    # take a grid of 131 CTAs on a 132-SM H200 (launch.h, sm90_static_grid).
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, dtype, "cuda")
    run_and_check(q, k, v, causal=causal)


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
    # thread's columns stays below 2^14 (fwd_kernel.h, kOptimisticExp): with growth 0.01 the blocks stand until the
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
    # exponentials (fwd_kernel.h, kOptimisticExp: S computed again, then the max-based update; at growth 1.0 after
    # overflowing to inf). The shapes reach every kernel: D64 with three consumers, D128 (128-key blocks at every
    # length; causal at 5000 keys, where 176-key blocks ran until v25) and the stream-K tail (12 key blocks or more; at
    # 2100 keys 360 tiles on 132 SMs, the last 228 split), D256 with 64-key (512 keys without a mask) and 80-key blocks;
    # 24 heads give every CTA several tiles, so the held K stages and the next tiles' loads interleave. A negative scale
    # takes the negated scores through the same path.
    heads = 24
    q, k, v = make_qkv(1, heads, heads // 2, len_q, len_k, head_dim, torch.float32, "cuda")
    scale = sign / math.sqrt(head_dim)
    keys = torch.arange(len_k, device="cuda", dtype=torch.float32)
    peak = int(0.6 * len_k)
    q, k = steer_scores(q, k, growth * (peak - (keys - peak).abs()), scale)
    run_and_check(*(t.to(dtype) for t in (q, k, v)), causal, scale)


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


def fwd_with_schedule(monkeypatch, schedule, q, k, v, causal, scale=None):
    """flashattn.fwd under FLASHATTN_FWD_SCHEDULE=schedule: out, lse and how many allocations the call made."""
    monkeypatch.setenv("FLASHATTN_FWD_SCHEDULE", schedule)
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    out, lse = fwd(q, k, v, causal, scale)
    return out, lse, torch.cuda.memory_stats()["allocation.all.allocated"] - before


STREAM_K_MIN_BLOCKS = 12  # csrc/cuda/launch.h kSm90StreamKMinBlocks


def stream_k_tiles(num_tiles, grid, num_n_blocks, min_blocks):
    """csrc/cuda/launch.h sm90_stream_k_tiles: how many of the last tiles the non-causal Hopper forward splits."""
    rounds, rest = divmod(num_tiles, grid)
    if num_n_blocks < min_blocks or rounds < 2 or rest == 0 or rest * 8 > grid * 7:
        return 0
    return num_tiles - (rounds - 1) * grid


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "head_dim,batch,len_q,len_k,scale",
    [(128, 1, 1100, 2150, None), (128, 1, 700, 2438, None), (128, 1, 300, 4000, None), (96, 1, 700, 2200, None),
     (120, 1, 1100, 2300, None), (128, 2, 700, 2200, -0.05), (128, 1, 1100, 1037, None), (128, 1, 1100, 2000, None),
     (128, 1, 700, 300, None), (128, 1, 700, 100, None), (80, 2, 300, 1000, -0.05), (256, 1, 300, 7700, None),
     (64, 1, 700, 2000, None)],
)
def test_cuda_stream_k_tail(monkeypatch, head_dim, batch, len_q, len_k, scale, dtype):
    # Without a mask the Hopper forward's D128 kernel can split its last tiles' key blocks between neighbouring CTAs,
    # which merge their parts (launch.h: sm90_stream_k_tiles; fwd_kernel.h: StaticSchedule, merge_split_tile), where a
    # tile has at least 12 key blocks of 128 and batch invariance is given up (FLASHATTN_BATCH_INVARIANT=0, read once:
    # test_robustness.py); FLASHATTN_FWD_SCHEDULE=stream-k splits them at any length. The heads make about 2.5 rounds
    # of 128-row tiles on this GPU, so the last 1.5 rounds split. Keys: a partial last block of 102 (2150), 6 (2438),
    # 24 (2200), 124 (2300) and 32 keys (4000, 32 blocks); D96, D120 and D80 in the D128 kernel; two batches with a
    # negative scale; 2000 keys (16 blocks, the last of 80); 1037 (9 blocks), 300 (3) and 100 keys (1: no tile can be
    # split, CTAs take one or two whole tiles). D256 (97 key blocks of 80) and D64 never split. GQA: two query heads
    # per kv head. Checked against the reference under each schedule; the default runs whole tiles (bit for bit the
    # same as "whole-tiles"), the forced split allocates its workspace, and its merge adds the two parts in key order
    # whichever CTA finishes second, so two runs agree bit for bit.
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    m_blocks = -(-len_q // 128)
    n_blocks = -(-len_k // 128)  # launch.h sm90_fwd_block_n(128, false, len_k)
    heads = 2 * -(-5 * num_sms // (4 * m_blocks * batch))
    in_split_kernel = 64 < head_dim <= 128  # launch.h sm90_fwd_stream_k
    tiles = m_blocks * heads * batch
    forced = stream_k_tiles(tiles, num_sms, n_blocks, 1) if in_split_kernel else 0
    hopper = torch.cuda.get_device_capability() == (9, 0) and os.environ.get("FLASHATTN_FWD_SM90", "1") != "0"
    if hopper and in_split_kernel and not forced:
        pytest.skip(f"{tiles} tiles make whole rounds on {num_sms} SMs: nothing to split")
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, dtype, "cuda")
    out, lse, auto_allocations = fwd_with_schedule(monkeypatch, "auto", q, k, v, False, scale)
    assert_attention_close(out, lse, q, k, v, False, scale)
    forced_out, forced_lse, forced_allocations = fwd_with_schedule(monkeypatch, "stream-k", q, k, v, False, scale)
    assert_attention_close(forced_out, forced_lse, q, k, v, False, scale)
    again_out, again_lse, _ = fwd_with_schedule(monkeypatch, "stream-k", q, k, v, False, scale)
    assert torch.equal(forced_out, again_out) and torch.equal(forced_lse, again_lse)
    whole_out, whole_lse, whole_allocations = fwd_with_schedule(monkeypatch, "whole-tiles", q, k, v, False, scale)
    assert torch.equal(out, whole_out) and torch.equal(lse, whole_lse)
    if hopper:
        assert auto_allocations == whole_allocations
        assert forced_allocations == whole_allocations + (forced > 0)


def causal_block_m(head_dim, len_q, len_k):
    """csrc/cuda/launch.h sm90_causal_block_m: query rows per causal tile of the Hopper forward."""
    return 192 if head_dim <= 64 and len_q >= 1024 and len_k >= 1024 else 128


def causal_zigzag_grid(num_m_blocks, num_tiles, num_sms):
    """csrc/cuda/launch.h sm90_causal_zigzag_grid: the grid of the static causal schedule, 0 for the counter."""
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


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "batch,heads,len_q,len_k",
    [
        (2, 16, 1024, 1024),
        (2, 12, 1300, 1300),
        (2, 12, 1300, 300),
        (1, 16, 1300, 1700),
        (2, 12, 2100, 2100),
        (1, 16, 2100, 2500),
    ],
    # On a 132-SM H200 with 128-row tiles (D128, D256): zigzag on 128 CTAs, zigzag on 132, zigzag with tiles that see
    # no key, the counter. D64 takes 192-row tiles in every case but no-key-tiles: the counter in 8-blocks (each
    # head's part-empty tile has two consumers without rows), 11-blocks and long-uneven, zigzag on 132 in uneven and
    # long-11-blocks.
    ids=["8-blocks", "11-blocks", "no-key-tiles", "uneven", "long-11-blocks", "long-uneven"],
)
def test_cuda_causal_schedules_agree(monkeypatch, head_dim, batch, heads, len_q, len_k):
    # On Hopper the causal tiles are handed out in static zigzag rounds or from a counter. A tile's result must not
    # depend on the CTA that computed it: both schedules give correct, bit-identical outputs over several rounds.
    q, k, v = make_qkv(batch, heads, heads // 2, len_q, len_k, head_dim, torch.bfloat16, "cuda")
    out, lse, auto_allocations = fwd_with_schedule(monkeypatch, "auto", q, k, v, True)
    assert_attention_close(out, lse, q, k, v, causal=True)
    out_counter, lse_counter, counter_allocations = fwd_with_schedule(monkeypatch, "counter", q, k, v, True)
    assert torch.equal(out, out_counter) and torch.equal(lse, lse_counter)
    monkeypatch.setenv("FLASHATTN_FWD_SCHEDULE", "static")
    try:
        fwd(q, k, v, True)
        hopper = False  # the variable is read only where the causal Hopper forward runs
    except RuntimeError as error:
        assert "FLASHATTN_FWD_SCHEDULE must be auto, counter, whole-tiles or stream-k" in str(error)
        hopper = True
    if hopper:  # the counter is one allocation more (a zeroed int32); "auto" allocates it only where it uses it
        block_m = causal_block_m(head_dim, len_q, len_k)
        num_m_blocks = -(-len_q // block_m)
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        zigzag = causal_zigzag_grid(num_m_blocks, num_m_blocks * heads * batch, num_sms) > 0
        assert counter_allocations - auto_allocations == (1 if zigzag else 0)


@pytest.mark.cuda
@pytest.mark.large
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
