"""Sliding windows, softcap and sinks: forward and gradients against the fp64/fp32 naive reference on every device
(reference.py's accuracy rule), the rows they leave without keys, and their argument checks."""
import math
import re

import pytest
import torch

import flashattn_ext
from isolated import run_isolated
from reference import (
    assert_attention_close,
    assert_grads_close,
    attention_ref,
    leaves,
    make_qkv,
    rows_with_keys,
    steer_scores,
)

fwd = torch.ops.flashattn.fwd
bwd = torch.ops.flashattn.bwd

WINDOWS = [(0, 0), (16, 0), (127, 0), (64, 64), (-1, 32), (300, -1)]
WINDOW_IDS = [f"w{left}_{right}" for left, right in WINDOWS]
# The gradient tests' keys are too few for (300, -1) to bind: a left-only window that does.
GRAD_WINDOWS = WINDOWS + [(50, -1)]
GRAD_WINDOW_IDS = WINDOW_IDS + ["w50_-1"]
# (Lq, Lk): equal odd lengths, Lq < Lk (decode-like and long), Lq > Lk (rows without keys under causal windows).
LENGTHS = [(97, 97), (7, 300), (257, 129), (1, 65), (1025, 1025)]
LENGTH_IDS = [f"q{a}-k{b}" for a, b in LENGTHS]


def make_sinks(heads, device, low=-1.0, high=3.0):
    return torch.empty(heads, device=device).uniform_(low, high)


def sinks_near_lse(lse):
    """A sink per head within 1 of the median lse of its rows that see keys: a share of each row's mass that a kernel
    ignoring or doubling the sink cannot hide in the tolerance, whatever the scores' scale."""
    keyed = torch.where(lse.isfinite(), lse, float("nan")).transpose(0, 1).reshape(lse.shape[1], -1)
    median = keyed.nanmedian(dim=1).values.float()
    return median + torch.empty_like(median).uniform_(-1.0, 1.0)


def run_fwd(q, k, v, causal=False, scale=None, window_size=(-1, -1), softcap=0.0, sinks=None):
    out, lse = fwd(q, k, v, causal, scale, list(window_size), softcap, sinks)
    assert_attention_close(out, lse, q, k, v, causal, scale, window_size, softcap, sinks)
    return out, lse


def run_grads(q, k, v, causal=False, scale=None, window_size=(-1, -1), softcap=0.0, sinks=None, with_lse=True):
    q, k, v = leaves(q, k, v)
    inputs = (q, k, v)
    if sinks is not None:
        sinks = sinks.detach().requires_grad_()
        inputs += (sinks,)
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal, scale, window_size, softcap, sinks)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_lse else None
    outputs, grads_out = (out, lse) if with_lse else (out,), (dout, dlse) if with_lse else (dout,)
    grads = torch.autograd.grad(outputs, inputs, grads_out)
    assert_grads_close(grads, q, k, v, dout, dlse, causal, scale, window_size, softcap, sinks)
    return grads


# ---- windows ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("len_q,len_k", LENGTHS, ids=LENGTH_IDS)
@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16])
def test_window_forward(device, dtype, causal, window, len_q, len_k):
    q, k, v = make_qkv(1, 4, 2, len_q, len_k, 64, dtype, device)
    run_fwd(q, k, v, causal, None, window)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("window", [(16, 0), (64, 64), (300, -1)], ids=["w16_0", "w64_64", "w300_-1"])
@pytest.mark.dtypes(cpu=[torch.float32])
def test_window_head_dims(device, dtype, window, head_dim):
    q, k, v = make_qkv(2, 2, 1, 333, 400, head_dim, dtype, device, layout="seq_major")
    run_fwd(q, k, v, False, None, window)


@pytest.mark.parametrize("len_q,len_k", [(97, 97), (257, 129), (7, 300)], ids=["q97-k97", "q257-k129", "q7-k300"])
@pytest.mark.parametrize("window", GRAD_WINDOWS, ids=GRAD_WINDOW_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_window_grads(device, dtype, causal, window, len_q, len_k):
    q, k, v = make_qkv(2, 4, 2, len_q, len_k, 64, dtype, device)
    run_grads(q, k, v, causal, None, window)


@pytest.mark.parametrize("head_dim", [32, 128, 256])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.float16, torch.bfloat16])
def test_window_grads_head_dims(device, dtype, head_dim):
    q, k, v = make_qkv(1, 2, 2, 300, 300, head_dim, dtype, device)
    run_grads(q, k, v, True, None, (100, 0))


MANY_BLOCK_WINDOWS = [(0, 0), (100, 0), (64, 64), (300, -1), (-1, 40)]


@pytest.mark.parametrize("len_k", [1500, 1420], ids=["k1500", "k1420"])
@pytest.mark.parametrize("window", MANY_BLOCK_WINDOWS, ids=[f"w{left}_{right}" for left, right in MANY_BLOCK_WINDOWS])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16])
def test_window_grads_many_key_blocks(device, dtype, head_dim, window, len_k):
    # 192 key blocks of 128 keys, more than a GPU's SMs: a persistent backward CTA runs several, and the band's steps
    # that see none of a warpgroup's keys (the first or last of a block) come after other blocks' steps. Lk 1420: the
    # band shifted off the blocks' boundaries by 80 keys, and under (0, 0) the first 80 rows see no key.
    q, k, v = make_qkv(2, 16, 8, 1500, len_k, head_dim, dtype, device)
    run_grads(q, k, v, False, None, window)


@pytest.mark.parametrize("len_q,len_k", [(257, 129), (70, 300)], ids=["q257-k129", "q70-k300"])
@pytest.mark.parametrize("window", GRAD_WINDOWS, ids=GRAD_WINDOW_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16])
def test_window_grads_d256(device, dtype, causal, window, len_q, len_k):
    # Every window at D256 (on Hopper its split backward's options variant), Lq != Lk both ways.
    q, k, v = make_qkv(1, 2, 1, len_q, len_k, 256, dtype, device)
    run_grads(q, k, v, causal, None, window)


def test_window_equal_to_causal_is_causal():
    # (-1, 0) is the causal mask, and a window wider than the sequence is no mask: bitwise the plain results.
    q, k, v = make_qkv(1, 2, 2, 70, 90, 32, torch.float32, "cpu")
    assert torch.equal(fwd(q, k, v, False, None, [-1, 0])[0], fwd(q, k, v, True)[0])
    assert torch.equal(fwd(q, k, v, True, None, [89, 5])[0], fwd(q, k, v, True)[0])
    assert torch.equal(fwd(q, k, v, False, None, [89, 69])[0], fwd(q, k, v)[0])


@pytest.mark.parametrize("window", [(88, -1), (-1, 68), (88, 68)], ids=["w88_-1", "w-1_68", "w88_68"])
def test_window_one_key_short_of_every_key(device, dtype, window):
    # Lq 70, Lk 90: left 89 and right 69 leave every row every key (they run the plain kernels); one less hides key 0
    # from the last row, or key 89 from the first. Those keys dominate the rows that lose them, so a kernel that
    # ignores the bound fails by far more than the tolerance.
    q, k, v = make_qkv(1, 2, 2, 70, 90, 64, dtype, device)
    k[:, :, 0] = 2 * q[:, :, 69]
    k[:, :, 89] = 2 * q[:, :, 0]
    out, _ = run_fwd(q, k, v, False, None, window)
    plain, _ = fwd(q, k, v)
    for row, bound in ((69, window[0]), (0, window[1])):
        if bound >= 0:
            assert (out[:, :, row] - plain[:, :, row]).abs().amax() > 0.1
    run_grads(q, k, v, False, None, window)


def test_window_rows_without_keys_cpu():
    # Lq > Lk with a window (0, 0): the first Lq - Lk rows see no key; their out is 0, lse -inf, dq 0.
    q, k, v = make_qkv(1, 1, 1, 20, 8, 16, torch.float64, "cpu")
    out, lse = run_fwd(q, k, v, False, None, (0, 0))
    keyed = rows_with_keys(20, 8, False, "cpu", (0, 0))
    assert keyed.sum() == 8 and not keyed[:12].any()
    run_grads(q, k, v, False, None, (0, 0))


@pytest.mark.parametrize("window", [(3, 2), (0, -1), (-1, 1)], ids=["w3_2", "w0_-1", "w-1_1"])
def test_window_gradcheck(window):
    q, k, v = leaves(*make_qkv(1, 2, 1, 9, 11, 4, torch.float64, "cpu"))
    assert torch.autograd.gradcheck(lambda q, k, v: flashattn_ext.flash_attn(q, k, v, window_size=window), (q, k, v))


# ---- softcap ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [1.0, 30.0], ids=["cap1", "cap30"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16])
def test_softcap_forward(device, dtype, head_dim, causal, softcap):
    q, k, v = make_qkv(2, 4, 2, 200, 333, head_dim, dtype, device)
    # Peaked scores (scale 2.0): the cap changes the softmax a lot.
    run_fwd(q, k, v, causal, 2.0, (-1, -1), softcap)


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_softcap_peaked_profile(device, dtype):
    # Scores far past the cap in both directions: without the cap one key would take the whole row.
    scale = 0.125
    q, k, v = make_qkv(1, 2, 2, 64, 256, 64, torch.float32, device)
    profile = torch.linspace(-200, 200, 256, device=device)
    q, k = steer_scores(q, k, profile, scale)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, _ = run_fwd(q, k, v, False, scale, (-1, -1), 5.0)
    plain = fwd(q, k, v, False, scale)[0]
    assert (out.float() - plain.float()).abs().max() > 0.1, "the cap must change a peaked softmax"


@pytest.mark.parametrize("softcap", [40.0, 41.0], ids=["cap40", "cap41"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.float16, torch.bfloat16])
def test_softcap_rows_far_below_the_cap(device, dtype, head_dim, softcap):
    # Every capped score far below the cap (-40 to -19 at cap 40): exponentials against a reference at the cap are
    # near 2^-100, and they still weigh the keys.
    scale = 0.125
    q, k, v = make_qkv(1, 2, 2, 64, 256, head_dim, torch.float32, device)
    q, k = steer_scores(q, k, torch.linspace(-175, -55, 256, device=device), scale)
    run_fwd(q.to(dtype), k.to(dtype), v.to(dtype), False, scale, (-1, -1), softcap)


@pytest.mark.parametrize("softcap,scale", [(1e31, 0.125), (1e38, 2.0), (2e38, 0.125), (1e20, 1e-19)],
                         ids=["cap1e31", "cap1e38", "cap2e38", "ratio-denormal"])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_softcap_too_large_to_bind(device, dtype, softcap, scale):
    # Caps past 1e30 (CUDA's fast division gives scale / softcap = 0 past 2^126; its denormal products flush), near
    # float32's largest (softcap * log2(e)), or whose scale / softcap is denormal: none binds on a real score, and
    # the softmax is the uncapped one (was uniform, or NaN, on CUDA).
    q, k, v = make_qkv(1, 2, 2, 65, 97, 64, dtype, device)
    q = q * (0.125 / scale) ** 0.5  # scores of the same size at every scale
    k = k * (0.125 / scale) ** 0.5
    out, _ = run_fwd(q, k, v, False, scale, (-1, -1), softcap)
    assert torch.allclose(out.float(), fwd(q, k, v, False, scale)[0].float(), atol=2e-2)
    # The gradients are the uncapped ones (the references' own backward through softcap * tanh(s / softcap) overflows
    # float32 at such caps: softcap * dout).
    dout = torch.randn_like(out)

    def grads(cap):
        leaf = leaves(q, k, v)
        return torch.autograd.grad(flashattn_ext.flash_attn(*leaf, scale=scale, softcap=cap), leaf, dout)

    for got, want in zip(grads(softcap), grads(0.0)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("softcap", [1.0, 30.0], ids=["cap1", "cap30"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.float16, torch.bfloat16])
def test_softcap_grads(device, dtype, causal, softcap, head_dim):
    q, k, v = make_qkv(2, 4, 2, 157, 200, head_dim, dtype, device)
    run_grads(q, k, v, causal, 2.0, (-1, -1), softcap)


def test_softcap_gradcheck():
    q, k, v = leaves(*make_qkv(1, 2, 1, 9, 11, 4, torch.float64, "cpu"))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flashattn_ext.flash_attn(q, k, v, scale=3.0, softcap=1.5), (q, k, v)
    )


# ---- sinks --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("len_q,len_k", [(97, 97), (1, 513), (200, 70)], ids=["q97-k97", "q1-k513", "q200-k70"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16])
def test_sinks_forward(device, dtype, causal, len_q, len_k):
    q, k, v = make_qkv(2, 4, 1, len_q, len_k, 64, dtype, device)
    run_fwd(q, k, v, causal, None, (-1, -1), 0.0, make_sinks(4, device))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.float16, torch.bfloat16])
def test_sinks_grads(device, dtype, causal):
    q, k, v = make_qkv(2, 4, 2, 200, 170, 64, dtype, device)  # causal: rows 0..29 see no key, only their sink
    grads = run_grads(q, k, v, causal, None, (-1, -1), 0.0, make_sinks(4, device))
    assert grads[3].dtype == torch.float32 and grads[3].shape == (4,)


def test_sinks_gradcheck():
    q, k, v = leaves(*make_qkv(1, 2, 1, 9, 6, 4, torch.float64, "cpu"))
    sinks = make_sinks(2, "cpu").double().requires_grad_()

    def f(q, k, v, sinks):
        out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, True, None, (2, 0), 0.0, sinks.float())
        return out, lse.double()

    # lse is float32: a central difference over 2 * eps needs eps = 1e-3 and atol = 2e-3 (as test_bwd's lse check).
    assert torch.autograd.gradcheck(f, (q, k, v, sinks), eps=1e-3, atol=2e-3)


def test_sinks_only_rows_without_keys():
    # Lk == 0: every row sees only its sink: out 0, lse = sink, and dsinks = sum of dlse.
    q, k, v = make_qkv(2, 3, 3, 5, 0, 8, torch.float32, "cpu")
    sinks = make_sinks(3, "cpu")
    out, lse = fwd(q, k, v, False, None, [-1, -1], 0.0, sinks)
    assert (out == 0).all() and torch.equal(lse, sinks[None, :, None].expand_as(lse))
    dlse = torch.randn_like(lse)
    _, _, _, dsinks = bwd(torch.randn_like(out), q, k, v, out, lse, False, None, dlse, False, [-1, -1], 0.0, sinks)
    torch.testing.assert_close(dsinks, dlse.sum((0, 2)))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 40))],
                         ids=["full", "causal", "window"])
def test_sinks_of_rows_whose_scores_are_all_minus_inf(device, causal, window):
    # Entry 0: every score is -inf (a key column of -inf against a positive query column), so no key weighs anything:
    # out 0 and lse = the sink, exactly, as for a row without keys (and as the decode path's split fold gives);
    # without a sink, NaN, as softmax gives. Entry 1 is plain.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(2, 4, 2, 70, 130, 64, dtype, device)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[0, :, :, 0] = float("-inf")
    sinks = make_sinks(4, device)
    out, lse = fwd(q, k, v, causal, None, list(window), 0.0, sinks)
    assert (out[0] == 0).all() and torch.equal(lse[0], sinks[:, None].expand_as(lse[0]))
    assert out[1].isfinite().all() and lse[1].isfinite().all()
    out, lse = fwd(q, k, v, causal, None, list(window), 0.0, None)
    assert out[0].isnan().all() and lse[0].isnan().all()


def test_sinks_minus_infinity_is_no_sink():
    q, k, v = make_qkv(1, 2, 2, 40, 30, 16, torch.float32, "cpu")
    sinks = torch.full((2,), float("-inf"))
    with_sinks = fwd(q, k, v, True, None, [-1, -1], 0.0, sinks)
    plain = fwd(q, k, v, True)
    assert torch.equal(with_sinks[0], plain[0]) and torch.equal(with_sinks[1], plain[1])



def test_sinks_of_minus_infinity_ignore_dlse_of_rows_without_keys(device):
    # Causal with Lq > Lk: the first rows see no key; a sink of -inf leaves their lse -inf. An infinite dlse there (as
    # logaddexp's gradient of two -inf values gives) adds nothing to dsinks (0 * inf would be NaN).
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(1, 2, 2, 40, 30, 64, dtype, device)
    sinks = torch.tensor([float("-inf"), 1.0], device=device)
    out, lse = fwd(q, k, v, True, None, [-1, -1], 0.0, sinks)
    assert lse[0, 0, :10].isneginf().all()
    dlse = torch.zeros_like(lse)
    dlse[0, 0, :10] = float("inf")
    grads = bwd(torch.randn_like(out), q, k, v, out, lse, True, None, dlse, False, [-1, -1], 0.0, sinks)
    assert grads[3][0] == 0 and grads[3].isfinite().all()


# ---- combinations -------------------------------------------------------------------------------------------------

COMBOS = {
    # id: (causal, window, softcap, with sinks)
    "window-softcap": (True, (64, 0), 20.0, False),
    "window-sinks": (False, (32, 32), 0.0, True),
    "softcap-sinks": (True, (-1, -1), 5.0, True),
    "all": (True, (127, 0), 30.0, True),
    "all-two-sided": (False, (16, 100), 2.0, True),
}


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("len_q,len_k", [(300, 300), (129, 260), (260, 129)], ids=["q300", "q129-k260", "q260-k129"])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_combinations(device, dtype, combo, len_q, len_k):
    causal, window, softcap, with_sinks = COMBOS[combo]
    q, k, v = make_qkv(1, 4, 2, len_q, len_k, 128, dtype, device)
    plain, lse = fwd(q, k, v, causal, 1.5, list(window), softcap)
    sinks = sinks_near_lse(lse) if with_sinks else None
    out, _ = run_fwd(q, k, v, causal, 1.5, window, softcap, sinks)
    if with_sinks:
        assert (out - plain).abs().amax() > 0.1, "the sinks must weigh in the rows"
    run_grads(q, k, v, causal, 1.5, window, softcap, sinks)


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16])
def test_combinations_deterministic(device, dtype, combo, deterministic_algorithms):
    causal, window, softcap, with_sinks = COMBOS[combo]
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, dtype, device)
    sinks = make_sinks(4, device) if with_sinks else None
    out, lse = fwd(q, k, v, causal, None, list(window), softcap, sinks)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    first = bwd(dout, q, k, v, out, lse, causal, None, dlse, True, list(window), softcap, sinks)
    second = bwd(dout, q, k, v, out, lse, causal, None, dlse, True, list(window), softcap, sinks)
    unordered = bwd(dout, q, k, v, out, lse, causal, None, dlse, False, list(window), softcap, sinks)
    assert_grads_close(first, q, k, v, dout, dlse, causal, None, window, softcap, sinks)
    for a, b, c in zip(first, second, unordered):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=2e-2, atol=2e-2)


DETERMINISTIC_MODS = {  # id: (causal, window, softcap)
    "causal-window": (True, (127, 0), 0.0),
    "two-sided": (False, (64, 200), 0.0),
    "left-only": (False, (300, -1), 0.0),
    "softcap": (True, (-1, -1), 30.0),
}


@pytest.mark.parametrize("mods", list(DETERMINISTIC_MODS))
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize(
    "shape", [(2, 8, 2, 1000, 1100), (1, 4, 4, 1500, 700), (1, 2, 1, 300, 2300)], ids=["gqa", "lq-gt-lk", "lq-lt-lk"]
)
@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16])
def test_deterministic_options_many_key_blocks(device, dtype, mods, head_dim, shape, deterministic_algorithms):
    # Up to 36 key blocks add into a dQ block, from the band's first to its last (on Hopper in the kernels' fixed
    # order: highest first under a right edge): every run the same bits, and the gradients right.
    causal, window, softcap = DETERMINISTIC_MODS[mods]
    batch, heads, heads_kv, len_q, len_k = shape
    q, k, v = leaves(*make_qkv(batch, heads, heads_kv, len_q, len_k, head_dim, dtype, device))
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal, None, window, softcap)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    runs = [torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), retain_graph=True) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b), "two deterministic backward runs differ"
    assert_grads_close(runs[0], q, k, v, dout, dlse, causal, None, window, softcap)


@pytest.mark.parametrize("window,softcap", [((100, 0), 0.0), ((-1, -1), 20.0)], ids=["window", "softcap"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=["d128", "d256"])
@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16])
def test_deterministic_options_take_the_hopper_kernel(device, dtype, head_dim, window, softcap):
    # Deterministic windows and softcap run the Hopper kernels' ordered dQ, not the portable kernel's or the chunked
    # backward: the paths add in different orders, so their bits differ while all are right.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's ordered dQ")
    q, k, v = make_qkv(1, 4, 2, 700, 900, head_dim, dtype, device)
    out, _ = fwd(q, k, v, False, None, list(window), softcap)
    dout, dlse = torch.randn_like(out), torch.randn(out.shape[:3], device=device)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    args = (q, k, v, dout, dlse, False, window, softcap)
    hopper = run_isolated(dict(env, FLASHATTN_BWD_SM90="strict"), "op.test_bwd", "deterministic_gradients", *args)
    other = run_isolated(dict(env, FLASHATTN_BWD_SM90="0"), "op.test_bwd", "deterministic_gradients", *args)
    assert not torch.equal(hopper[0], other[0]), "dq came from the same path twice"
    for a, b in zip(hopper, other):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_reference_agrees_with_sdpa_mask():
    # The reference's sink column equals an explicit softmax over [scores, sink] (guards the checker itself).
    q, k, v = make_qkv(1, 2, 2, 5, 7, 4, torch.float64, "cpu")
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out, lse = attention_ref(q, k, v, sinks=sinks)
    scores = q @ k.transpose(-1, -2) / 2.0
    full = torch.cat([scores, sinks[None, :, None, None].expand(1, 2, 5, 1)], -1)
    torch.testing.assert_close(out, torch.softmax(full, -1)[..., :7] @ v)
    torch.testing.assert_close(lse, torch.logsumexp(full, -1))


# ---- compile, opcheck and bad arguments ---------------------------------------------------------------------------


def test_compile_fullgraph_with_mods(device):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float32 if device == "cpu" else torch.bfloat16, device)
    sinks = make_sinks(2, device).requires_grad_()
    q, k, v = leaves(q, k, v)

    def f(q, k, v, sinks):
        return flashattn_ext.flash_attn(q, k, v, True, None, (16, 0), 10.0, sinks).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    want = torch.autograd.grad(f(q, k, v, sinks), (q, k, v, sinks))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_opcheck_with_mods(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(1, 4, 2, 33, 40, 32, dtype, device)
    sinks = make_sinks(4, device)
    kwargs = dict(causal=True, window_size=[8, 0], softcap=5.0, sinks=sinks)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (q, k, v), kwargs)
    # Everything requiring grad, the sinks too: the autograd kernel's registration and the traced backward.
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashattn.fwd.default, leaves, dict(kwargs, sinks=sinks.clone().requires_grad_()))
    out, lse = fwd(q, k, v, True, None, [8, 0], 5.0, sinks)
    args = (torch.randn_like(out), q, k, v, out, lse)
    torch.library.opcheck(
        torch.ops.flashattn.bwd.default, args, dict(causal=True, window_size=[8, 0], softcap=5.0, sinks=sinks)
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(window_size=[-2, 0]), "window_size entries must be >= 0, or -1"),
        (dict(window_size=[0, 0, 0]), "window_size must be"),
        (dict(softcap=-1.0), "softcap must be 0 \\(off\\) or a positive float32"),
        (dict(softcap=math.inf), "softcap must be 0 \\(off\\) or a positive float32"),
        (dict(softcap=math.nan), "softcap must be 0 \\(off\\) or a positive float32"),
        (dict(softcap=1e39), "softcap must be 0 \\(off\\) or a positive float32"),  # inf in float32
        (dict(softcap=3e38), "softcap must be 0 \\(off\\) or a positive float32"),  # softcap * log2(e): inf
        (dict(softcap=1e-46), "softcap must be 0 \\(off\\) or a positive float32"),  # 0 (off) in float32
        (dict(sinks=torch.zeros(3)), r"sinks must have shape \(H,\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), "sinks must be float32"),
    ],
    ids=["window-neg", "window-len", "softcap-neg", "softcap-inf", "softcap-nan", "softcap-huge", "softcap-log2e",
         "softcap-tiny",
         "sinks-shape", "sinks-dtype"],
)
def test_bad_mods(device, kwargs, message):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(1, 4, 2, 8, 8, 32, dtype, device)
    if "sinks" in kwargs:
        kwargs = dict(kwargs, sinks=kwargs["sinks"].to(device))
    with pytest.raises(RuntimeError, match=message):
        fwd(q, k, v, **kwargs)


@pytest.mark.parametrize("window_size", [None, 3])
def test_window_not_a_pair(window_size):
    q, k, v = make_qkv(1, 4, 2, 8, 8, 32, torch.float32, "cpu")
    with pytest.raises(TypeError, match=re.escape(f"window_size must be a pair (left, right), got {window_size}")):
        flashattn_ext.flash_attn(q, k, v, window_size=window_size)


@pytest.mark.cuda
def test_sinks_on_the_wrong_device():
    q, k, v = make_qkv(1, 4, 2, 8, 8, 32, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="sinks must be on q's device"):
        fwd(q, k, v, sinks=torch.zeros(4))
