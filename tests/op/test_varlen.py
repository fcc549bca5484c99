"""Packed variable-length sequences (flashattn.fwd_varlen / bwd_varlen): each sequence gives the same bits as the
dense op on it alone (itself checked against the fp64 reference in test_fwd / test_bwd / test_score_mods), plus a
direct reference check, gradients, compile, opcheck and the argument checks."""
import math
import os

import pytest
import torch

import flashattn_ext
from isolated import run_isolated
from reference import (
    assert_attention_close,
    assert_grads_close,
    attention_grads,
    free_nan_blocks,
    leaves,
    rows_with_keys,
    with_sinks,
)

fwd_varlen = torch.ops.flashattn.fwd_varlen
bwd_varlen = torch.ops.flashattn.bwd_varlen

# (Lq_b, Lk_b) per sequence: lengths 1, 7, 300, an empty sequence, Lq != Lk both ways, one longer sequence.
MIXED = [(1, 1), (7, 7), (300, 300), (0, 5), (65, 130), (129, 40), (4, 0), (600, 600)]
SHORT = [(1, 1), (7, 9), (0, 3), (33, 17), (50, 50)]


def cu_seqlens(lengths, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)


def packed_inputs(pairs, heads, heads_kv, head_dim, dtype, device="cpu", layout="contiguous"):
    """q (total_q, H, D), k, v (total_k, Hk, D) and the two cu_seqlens; 'strided' takes q, k, v as views of wider
    rows (stride(0) != H * D)."""
    total_q, total_k = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    pad = 8 if layout == "strided" else 0
    q = torch.randn(total_q, heads, head_dim + pad, dtype=dtype, device=device)[..., :head_dim]
    k = torch.randn(total_k, heads_kv, head_dim + pad, dtype=dtype, device=device)[..., :head_dim]
    v = torch.randn(total_k, heads_kv, head_dim + pad, dtype=dtype, device=device)[..., :head_dim]
    return q, k, v, cu_seqlens([p[0] for p in pairs], device), cu_seqlens([p[1] for p in pairs], device)


def dense(t):
    """(L, H, D) rows of one sequence as the dense op's (1, H, L, D)."""
    return t.transpose(0, 1).unsqueeze(0)


def sequences(cu_q, cu_k):
    for b in range(cu_q.numel() - 1):
        yield b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


MODS = {  # a non-default scale rides on two of them (positive and negative)
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(31, 0)),
    "two-sided": dict(window_size=(20, 10), scale=0.3),
    "left-only": dict(window_size=(40, -1)),
    "softcap-sinks": dict(causal=True, softcap=5.0, sinks=True, scale=-0.2),
}


def mods_for(name, heads, device="cpu"):
    return with_sinks(MODS[name], heads, device)


@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16], cuda=[])
def test_forward_matches_dense_per_sequence(device, dtype, layout, mods):
    q, k, v, cu_q, cu_k = packed_inputs(MIXED, 4, 2, 32, dtype, device, layout)
    kwargs = mods_for(mods, 4, device)
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, q.shape[0])
    assert lse.dtype == torch.float32
    for _, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.stop == rows_q.start:
            continue
        ref_out, ref_lse = flashattn_ext.flash_attn_with_lse(
            dense(q[rows_q]), dense(k[rows_k]), dense(v[rows_k]), **kwargs
        )
        assert torch.equal(out[rows_q], ref_out[0].transpose(0, 1))
        assert torch.equal(lse[:, rows_q], ref_lse[0])


@pytest.mark.parametrize("mods", ["causal", "window", "softcap-sinks"])
def test_forward_against_reference(mods):
    q, k, v, cu_q, cu_k = packed_inputs(SHORT, 4, 1, 16, torch.float64)
    kwargs = mods_for(mods, 4)
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, **kwargs)
    for _, rows_q, rows_k in sequences(cu_q, cu_k):
        assert_attention_close(dense(out[rows_q]).contiguous(), lse[None, :, rows_q].contiguous(), dense(q[rows_q]),
                               dense(k[rows_k]), dense(v[rows_k]), **kwargs)


def packed_grads_for_random_outputs(q, k, v, cu_q, cu_k, kwargs):
    """(dq, dk, dv[, dsinks]) of the packed op for random gradients of out and lse, and those (dout, dlse); the
    sinks in kwargs (if any) become a leaf."""
    inputs = leaves(q, k, v)
    if kwargs.get("sinks") is not None:
        kwargs["sinks"] = kwargs["sinks"].requires_grad_()
        inputs += (kwargs["sinks"],)
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(*inputs[:3], cu_q, cu_k, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    return torch.autograd.grad((out, lse), inputs, (dout, dlse)), dout, dlse


@pytest.mark.parametrize("mods", list(MODS))
def test_grads_match_dense_per_sequence(mods):
    q, k, v, cu_q, cu_k = packed_inputs(MIXED, 4, 2, 16, torch.float32)
    kwargs = mods_for(mods, 4)
    sinks = kwargs.get("sinks")
    grads, dout, dlse = packed_grads_for_random_outputs(q, k, v, cu_q, cu_k, kwargs)
    dsinks = torch.zeros(4)
    for _, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.stop == rows_q.start:  # no query: its keys' gradients are 0
            assert (grads[1][rows_k] == 0).all() and (grads[2][rows_k] == 0).all()
            continue
        qs, ks, vs = leaves(dense(q[rows_q]), dense(k[rows_k]), dense(v[rows_k]))
        seq_inputs = (qs, ks, vs) + ((sinks,) if sinks is not None else ())
        o, l = flashattn_ext.flash_attn_with_lse(qs, ks, vs, **kwargs)
        seq_grads = torch.autograd.grad((o, l), seq_inputs, (dense(dout[rows_q]), dlse[None, :, rows_q]))
        assert torch.equal(grads[0][rows_q], seq_grads[0][0].transpose(0, 1))
        assert torch.equal(grads[1][rows_k], seq_grads[1][0].transpose(0, 1))
        assert torch.equal(grads[2][rows_k], seq_grads[2][0].transpose(0, 1))
        if sinks is not None:
            dsinks += seq_grads[3]
    if sinks is not None:
        torch.testing.assert_close(grads[3], dsinks)


def test_grads_against_reference():
    q, k, v, cu_q, cu_k = packed_inputs(SHORT, 2, 2, 8, torch.float64)
    kwargs = dict(causal=True, window_size=(9, 0))
    q, k, v = leaves(q, k, v)
    out = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, **kwargs)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for _, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        grads = tuple(dense(g[r]).contiguous() for g, r in ((dq, rows_q), (dk, rows_k), (dv, rows_k)))
        assert_grads_close(grads, dense(q[rows_q]).detach(), dense(k[rows_k]).detach(), dense(v[rows_k]).detach(),
                           dense(dout[rows_q]), None, **kwargs)


def test_gradcheck():
    q, k, v, cu_q, cu_k = packed_inputs([(3, 4), (0, 2), (5, 3)], 2, 1, 4, torch.float64)
    q, k, v = leaves(q, k, v)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True, window_size=(2, 1)),
        (q, k, v),
    )


def test_batch_invariance():
    # A sequence's result does not depend on what else is packed with it.
    q, k, v, cu_q, cu_k = packed_inputs([(40, 50)], 2, 2, 16, torch.float32)
    alone = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True)
    q2, k2, v2, cu_q2, cu_k2 = packed_inputs([(13, 7), (40, 50), (5, 90)], 2, 2, 16, torch.float32)
    q2[13:53], k2[7:57], v2[7:57] = q, k, v
    together = flashattn_ext.flash_attn_varlen(q2, k2, v2, cu_q2, cu_k2, causal=True)
    assert torch.equal(together[13:53], alone)


def test_max_seqlen_is_only_a_hint():
    q, k, v, cu_q, cu_k = packed_inputs(SHORT, 2, 2, 16, torch.float32)
    a = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True)
    b = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, 1, 1, causal=True)
    assert torch.equal(a, b)


def test_compile_fullgraph():
    q, k, v, cu_q, cu_k = packed_inputs(SHORT, 2, 1, 16, torch.float32)
    q, k, v = leaves(q, k, v)

    def f(q, k, v):
        return flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True, window_size=(8, 0)).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_opcheck():
    q, k, v, cu_q, cu_k = packed_inputs(SHORT, 4, 2, 16, torch.float32)
    sinks = torch.linspace(-1, 1, 4)
    kwargs = dict(causal=True, window_size=[5, 0], softcap=3.0, sinks=sinks)
    torch.library.opcheck(fwd_varlen.default, (q, k, v, cu_q, cu_k), kwargs)
    out, lse = fwd_varlen(q, k, v, cu_q, cu_k, None, None, True, None, [5, 0], 3.0, sinks)
    torch.library.opcheck(bwd_varlen.default, (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k), kwargs)


def _bad(cu_q=None, cu_k=None, q=None):
    qq, k, v, cq, ck = packed_inputs([(3, 3), (4, 4)], 2, 2, 8, torch.float32)
    return (qq if q is None else q), k, v, (cq if cu_q is None else cu_q), (ck if cu_k is None else cu_k)


@pytest.mark.parametrize(
    "args,message",
    [
        (_bad(cu_q=torch.tensor([0, 3, 7])), "cu_seqlens_q must be int32"),
        (_bad(cu_q=torch.tensor([1, 3, 7], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
        (_bad(cu_k=torch.tensor([0, 5, 4], dtype=torch.int32)), "cu_seqlens_k must be non-decreasing"),
        (_bad(cu_q=torch.tensor([0, 3, 6], dtype=torch.int32)), r"cu_seqlens_q\[-1\] must equal the packed length 7"),
        (_bad(cu_q=torch.tensor([0, 7], dtype=torch.int32)), "must have the same length B \\+ 1"),
        (_bad(cu_q=torch.zeros(2, 2, dtype=torch.int32)), r"cu_seqlens_q must have shape \(B \+ 1,\)"),
        (_bad(q=torch.randn(1, 7, 2, 8)), r"q must have 3 dimensions \(total_q, H, D\)"),
    ],
    ids=["dtype", "start", "decreasing", "last", "lengths", "2d", "q-4d"],
)
def test_bad_arguments(args, message):
    with pytest.raises(RuntimeError, match=message):
        fwd_varlen(*args)


@pytest.mark.parametrize(
    "rows,kwargs,message",
    [
        (3, {}, "with no sequences .* q and k must have no rows"),
        (0, dict(softcap=-3.0), "softcap must be 0"),
        (0, dict(window_size=[-4, -4]), "window_size entries must be >= 0"),
    ],
    ids=["rows", "softcap", "window"],
)
def test_bad_arguments_without_sequences(device, rows, kwargs, message):
    """cu_seqlens of one entry (no sequences): checked as any other call."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(rows, 2, 8, dtype=dtype, device=device)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=message):
        flashattn_ext.flash_attn_varlen(q, q, q, cu, cu, **kwargs)


# ---- CUDA: one launch over every sequence ---------------------------------------------------------------------------


def per_sequence(t, rows):
    """Rows of one sequence of a packed (total, H, D) tensor as a contiguous dense (1, H, L, D) one."""
    return dense(t[rows]).contiguous()


@pytest.mark.cuda
@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_forward_against_reference(dtype, head_dim, mods):
    q, k, v, cu_q, cu_k = packed_inputs(MIXED, 4, 2, head_dim, dtype, "cuda", "strided")
    kwargs = mods_for(mods, 4, "cuda")
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert_packed_close(out, lse, q, k, v, cu_q, cu_k, kwargs)


def assert_packed_close(out, lse, q, k, v, cu_q, cu_k, kwargs):
    """The packed forward's out and lse, each sequence against the reference."""
    for _, rows_q, rows_k in sequences(cu_q, cu_k):
        assert_attention_close(per_sequence(out, rows_q), lse[None, :, rows_q].contiguous(), per_sequence(q, rows_q),
                               per_sequence(k, rows_k), per_sequence(v, rows_k), **kwargs)


def assert_packed_grads_close(q, k, v, cu_q, cu_k, kwargs):
    """The packed backward for random gradients of out and lse: each sequence's dq, dk, dv against the reference,
    dsinks against the sum of the sequences' fp64 shares."""
    sinks = kwargs.get("sinks")
    grads, dout, dlse = packed_grads_for_random_outputs(q, k, v, cu_q, cu_k, kwargs)
    dsinks = torch.zeros(q.shape[1], device=q.device)
    for _, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.stop == rows_q.start:  # no query: its keys' gradients are 0
            assert (grads[1][rows_k] == 0).all() and (grads[2][rows_k] == 0).all()
            continue
        seq = tuple(per_sequence(t, r).detach() for t, r in ((q, rows_q), (k, rows_k), (v, rows_k)))
        seq_grads = tuple(per_sequence(g, r) for g, r in ((grads[0], rows_q), (grads[1], rows_k), (grads[2], rows_k)))
        seq_dout, seq_dlse = per_sequence(dout, rows_q), dlse[None, :, rows_q].contiguous()
        mods = dict(kwargs, sinks=None if sinks is None else sinks.detach())
        assert_grads_close(seq_grads, *seq, seq_dout, seq_dlse, **mods, with_dsinks=False)
        if sinks is not None:  # the sequence's share of dsinks, from the fp64 reference
            up = (t.double() for t in seq + (seq_dout, seq_dlse))
            dsinks += attention_grads(*up, **dict(mods, sinks=sinks.detach().double()))[3].float()
    if sinks is not None:
        torch.testing.assert_close(grads[3], dsinks, rtol=2e-2, atol=2e-2 * max(1.0, dsinks.abs().max().item()))


@pytest.mark.cuda
@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_grads_against_reference(head_dim, mods):
    q, k, v, cu_q, cu_k = packed_inputs(MIXED, 4, 2, head_dim, torch.bfloat16, "cuda", "strided")
    assert_packed_grads_close(q, k, v, cu_q, cu_k, mods_for(mods, 4, "cuda"))


def forward_checked(pairs, head_dim, mods, seed=0):
    """The packed forward over `pairs` (bf16, H4 / Hk2, strided rows), each sequence checked against the reference.
    Run in a process of its own to pick a kernel (FLASHATTN_FWD_SM90)."""
    torch.manual_seed(seed)
    q, k, v, cu_q, cu_k = packed_inputs(pairs, 4, 2, head_dim, torch.bfloat16, "cuda", "strided")
    kwargs = mods_for(mods, 4, "cuda")
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, **kwargs)
    assert_packed_close(out, lse, q, k, v, cu_q, cu_k, kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("mods", ["plain", "causal", "softcap-sinks"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_forward_each_kernel(head_dim, mods):
    # The portable kernel and, on Hopper, the TMA one (strict: it must take the call), both against the reference.
    pairs = MIXED + [(1000, 1000), (130, 1500)]
    run_isolated({"FLASHATTN_FWD_SM90": "0"}, "op.test_varlen", "forward_checked", pairs, head_dim, mods)
    if torch.cuda.get_device_capability() == (9, 0):
        run_isolated({"FLASHATTN_FWD_SM90": "strict"}, "op.test_varlen", "forward_checked", pairs, head_dim, mods)


def grads_checked(pairs, head_dim, mods, seed=0):
    """The packed backward over `pairs` (bf16, H4 / Hk2, strided rows) against the reference
    (assert_packed_grads_close). Run in a process of its own to pick a kernel (FLASHATTN_BWD_SM90)."""
    torch.manual_seed(seed)
    q, k, v, cu_q, cu_k = packed_inputs(pairs, 4, 2, head_dim, torch.bfloat16, "cuda", "strided")
    assert_packed_grads_close(q, k, v, cu_q, cu_k, mods_for(mods, 4, "cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "head_dim,mods", [(d, m) for d in (64, 128, 192, 256) for m in ("plain", "causal", "window", "softcap-sinks")])
def test_cuda_backward_each_kernel(head_dim, mods):
    # The portable backward (up to D128) and, on Hopper, the TMA one (strict: it must take the call; above D128 the
    # only one), both against the reference.
    pairs = MIXED + [(1000, 1000), (130, 1500)]
    if head_dim <= 128:
        run_isolated({"FLASHATTN_BWD_SM90": "0"}, "op.test_varlen", "grads_checked", pairs, head_dim, mods)
    if torch.cuda.get_device_capability() == (9, 0):
        run_isolated({"FLASHATTN_BWD_SM90": "strict"}, "op.test_varlen", "grads_checked", pairs, head_dim, mods)


@pytest.mark.cuda
def test_cuda_nan_in_other_sequences_never_reaches_gradients():
    # As the forward's test below, for the gradients: a sequence packed between sequences full of NaN (inputs and
    # output gradients) gets its gradients as alone (dQ's additions come in any order: equal within rounding).
    q, k, v, cu_q, cu_k = packed_inputs([(200, 300)], 4, 2, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    alone = packed_grads(q, k, v, cu_q, cu_k, dout, causal=True)
    q2, k2, v2, cu_q2, cu_k2 = packed_inputs([(77, 55), (200, 300), (300, 33)], 4, 2, 128, torch.bfloat16, "cuda")
    dout2 = torch.full_like(q2, float("nan"))
    for t in (q2, k2, v2):
        t.fill_(float("nan"))
    q2[77:277], k2[55:355], v2[55:355], dout2[77:277] = q, k, v, dout
    together = packed_grads(q2, k2, v2, cu_q2, cu_k2, dout2, causal=True)
    for got, want in zip((together[0][77:277], together[1][55:355], together[2][55:355]), alone):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("nan_in", ["neighbours", "middle"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_nan_in_other_sequences_never_leaks(causal, nan_in):
    # Three sequences (tails shorter than a key block and a query tile), those named by nan_in full of NaN: every
    # other sequence's rows are the same bits as alone. TMA reads of a sequence stop at its last row (NaN neighbours
    # never reach the middle one), and so do its stores (the NaN middle one's rows never land in its neighbours).
    pairs = [(77, 55), (200, 300), (300, 33)]
    q, k, v, cu_q, cu_k = packed_inputs(pairs, 4, 2, 128, torch.bfloat16, "cuda")
    alone = []
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        one = [0, rows_q.stop - rows_q.start], [0, rows_k.stop - rows_k.start]
        cu = tuple(torch.tensor(c, dtype=torch.int32, device="cuda") for c in one)
        alone.append(flashattn_ext.flash_attn_varlen_with_lse(q[rows_q], k[rows_k], v[rows_k], *cu, causal=causal))
        if (b == 1) == (nan_in == "middle"):
            for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k)):
                t[rows] = float("nan")
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, causal=causal)
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        if (b == 1) != (nan_in == "middle"):
            assert torch.equal(out[rows_q], alone[b][0]) and torch.equal(lse[:, rows_q], alone[b][1])
        else:  # a NaN sequence: each of its rows that sees a key is NaN
            keyed = rows_with_keys(rows_q.stop - rows_q.start, rows_k.stop - rows_k.start, causal, q.device)
            assert out[rows_q][keyed].isnan().all() and lse[:, rows_q][:, keyed].isnan().all()


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_cuda_many_sequences(head_dim, causal):
    # More sequences than the Hopper preparation sorts (they then run in packed order), most of them a few rows long,
    # and some longer ones: every sequence checked against the reference on a sample.
    torch.manual_seed(0)
    lengths = torch.randint(0, 9, (2600,)).tolist()
    lengths[::400] = [700] * len(lengths[::400])
    q, k, v, cu_q, cu_k = packed_inputs([(n, n) for n in lengths], 4, 4, head_dim, torch.bfloat16, "cuda")
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, causal=causal)
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        if b % 97 == 0 or rows_q.stop - rows_q.start == 700:
            assert_attention_close(per_sequence(out, rows_q), lse[None, :, rows_q].contiguous(),
                                   per_sequence(q, rows_q), per_sequence(k, rows_k), per_sequence(v, rows_k),
                                   causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_several_tiles_per_cta(head_dim, causal):
    # Thousands of tiles on a persistent grid of one CTA per SM, longest sequences first: each CTA carries its
    # pipeline, turns and staged O from one sequence's tile to another's. Forward and gradients (D256: on Hopper)
    # against the reference, sequence by sequence.
    torch.manual_seed(1)
    lengths = torch.randint(1, 2000, (12,)).tolist()
    pairs = [(n, n if causal else max(1, n // 2 + 17)) for n in lengths]
    q, k, v, cu_q, cu_k = packed_inputs(pairs, 16, 4, head_dim, torch.bfloat16, "cuda")
    grad = head_dim <= 128 or hopper_backward()
    q, k, v = leaves(q, k, v) if grad else (q, k, v)
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, causal=causal)
    if grad:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    for _, rows_q, rows_k in sequences(cu_q, cu_k):
        seq = tuple(per_sequence(t, r).detach() for t, r in ((q, rows_q), (k, rows_k), (v, rows_k)))
        assert_attention_close(per_sequence(out, rows_q).detach(), lse[None, :, rows_q].contiguous().detach(), *seq,
                               causal=causal)
        if grad:
            seq_grads = tuple(per_sequence(g, r) for g, r in ((grads[0], rows_q), (grads[1], rows_k),
                                                               (grads[2], rows_k)))
            assert_grads_close(seq_grads, *seq, per_sequence(dout, rows_q), None, causal=causal)


@pytest.mark.cuda
def test_cuda_dirty_workspace():
    # The packed backward's float32 dQ workspace (H, total_q, D), handed NaN memory: the same gradients as from clean.
    q, k, v, cu_q, cu_k = packed_inputs(MIXED, 4, 2, 64, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    clean = packed_grads(q, k, v, cu_q, cu_k, dout, causal=True)
    free_nan_blocks(q.numel())
    dirty = packed_grads(q, k, v, cu_q, cu_k, dout, causal=True)
    for a, b in zip(clean, dirty):
        assert not b.isnan().any()
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_cuda_batch_invariance():
    # A sequence's forward bits do not depend on what else is packed with it.
    q, k, v, cu_q, cu_k = packed_inputs([(200, 300)], 4, 2, 128, torch.bfloat16, "cuda")
    alone = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, causal=True)
    q2, k2, v2, cu_q2, cu_k2 = packed_inputs([(130, 70), (200, 300), (5, 900)], 4, 2, 128, torch.bfloat16, "cuda")
    q2[130:330], k2[70:370], v2[70:370] = q, k, v
    together = flashattn_ext.flash_attn_varlen_with_lse(q2, k2, v2, cu_q2, cu_k2, causal=True)
    assert torch.equal(together[0][130:330], alone[0])
    assert torch.equal(together[1][:, 130:330], alone[1])


@pytest.mark.cuda
def test_cuda_graph_replays_new_lengths():
    # Lengths live on the device only: a graph captured once replays correctly after cu_seqlens change in place.
    q, k, v, cu_q, cu_k = packed_inputs([(100, 100), (60, 60), (96, 96)], 4, 4, 64, torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    for lengths in ([30, 200, 26], [256, 0, 0], [1, 1, 254]):
        cu_q.copy_(cu_seqlens(lengths, "cuda"))
        cu_k.copy_(cu_q)
        graph.replay()
        torch.testing.assert_close(out, flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True),
                                   rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_bad_cu_seqlens_never_fault():
    # Values that break the rules cannot be checked without a synchronisation: they give wrong rows, never a fault,
    # forward and backward.
    q, k, v, _, _ = packed_inputs([(7, 7)], 2, 2, 64, torch.bfloat16, "cuda")
    for bad in ([0, 1000, 7], [0, -5, 7], [0, 3, 2], [5, 2, 1]):
        cu = torch.tensor(bad, dtype=torch.int32, device="cuda")
        out = flashattn_ext.flash_attn_varlen(q, k, v, cu, cu, causal=True)
        out_, lse = fwd_varlen(q, k, v, cu, cu, causal=True)
        grads = bwd_varlen(torch.randn_like(out_), q, k, v, out_, lse, cu, cu, causal=True)
        torch.cuda.synchronize()
        assert out.shape == q.shape and grads[0].shape == q.shape


def hopper_backward():
    """Whether this process's packed backward above D128 has a kernel: Hopper's, unless FLASHATTN_BWD_SM90=0."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and os.environ.get("FLASHATTN_BWD_SM90", "1") != "0")


def ordered_head_dims():
    """Head dims of the ordered packed backward's kernels: 64 and 128 (Hopper's D64 / D128 kernel, the portable one
    elsewhere), 192 (Hopper's D256 kernel; only Hopper takes it)."""
    return [64, 128, pytest.param(192, marks=pytest.mark.skipif(
        not hopper_backward(), reason="the packed backward above D128 runs on Hopper"))]


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", ordered_head_dims())
def test_cuda_bad_cu_seqlens_never_hang_the_ordered_backward(head_dim, deterministic_algorithms):
    # The ordered dQ waits for each key block's turn; cu_seqlens that break the rules could leave a turn unreached,
    # so such calls add dQ unordered (the host flags them on the device) instead of waiting forever.
    q, k, v, _, _ = packed_inputs([(128, 400)], 2, 2, head_dim, torch.bfloat16, "cuda")
    for bad_k in ([64, 128], [0, 300, 100, 400], [0, 300, 100]):  # not from 0, decreasing, not ending at 400
        cu_k = torch.tensor(bad_k, dtype=torch.int32, device="cuda")
        cu_q = torch.linspace(0, 128, len(bad_k)).to(torch.int32).cuda()
        out, lse = fwd_varlen(q, k, v, cu_q, cu_k)
        grads = bwd_varlen(torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, deterministic=True)
        torch.cuda.synchronize()
        assert grads[0].shape == q.shape


def forward_with_keyless_tail(head_dim):
    """A packed forward whose last tiles see no key (for run_isolated, whose timeout ends a hang), checked against the
    reference."""
    q, k, v, cu_q, cu_k = packed_inputs([(300, 300), (6000, 0), (200, 700)], 16, 16, head_dim, torch.bfloat16, "cuda")
    out, lse = fwd_varlen(q, k, v, cu_q, cu_k)
    assert_packed_close(out, lse, q, k, v, cu_q, cu_k, {})
    return out, lse


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_forward_many_tiles_without_keys_in_a_row(head_dim):
    # A sequence without keys ranks last: its 47 tiles per head end the schedule, so a CTA's producer takes several of
    # them in a row right after its last tile with keys, whose consumers may still wait for that tile's last loads.
    out, lse = run_isolated({}, "op.test_varlen", "forward_with_keyless_tail", head_dim, timeout=180)
    assert (out[300:6300] == 0).all() and (lse[:, 300:6300] == -math.inf).all()


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_no_keys_anywhere_sink_gradient(device, dtype):
    # Every sequence without keys: out 0, lse the sink, and the sinks' gradient is what flows into lse.
    q, k, v, cu_q, cu_k = packed_inputs([(3, 0), (5, 0)], 2, 1, 64, dtype, device)
    q, k, v = leaves(q, k, v)
    sinks = torch.tensor([0.5, -1.0], device=device, requires_grad=True)
    out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, sinks=sinks)
    assert (out == 0).all() and torch.equal(lse, sinks.detach()[:, None].expand(2, 8))
    dlse = torch.randn_like(lse)
    dq, dsinks = torch.autograd.grad((out, lse), (q, sinks), (torch.randn_like(out), dlse))
    assert (dq == 0).all()
    torch.testing.assert_close(dsinks, dlse.sum(-1))


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_no_queries_loss_backward(device, dtype):
    # A rank's empty share of a packed batch: the loss's gradient (out.sum(): every stride 0) gives zero gradients.
    q, k, v, cu_q, cu_k = packed_inputs([(0, 5)], 2, 1, 64, dtype, device)
    q, k, v = leaves(q, k, v)
    flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True).sum().backward()
    assert q.grad.shape == q.shape and (k.grad == 0).all() and (v.grad == 0).all()


@pytest.mark.cuda
def test_cuda_backward_refuses_what_it_lacks():
    # Above D128 only the Hopper kernel takes packed sequences.
    if torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("Hopper takes every packed backward")
    q, k, v, cu_q, cu_k = packed_inputs(SHORT, 2, 2, 192, torch.bfloat16, "cuda")
    out, lse = fwd_varlen(q, k, v, cu_q, cu_k)
    for deterministic in (False, True):
        with pytest.raises(RuntimeError, match="head dims above 128 only on Hopper"):
            bwd_varlen(torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, deterministic=deterministic)


def packed_grads(q, k, v, cu_q, cu_k, dout, **kwargs):
    q, k, v = leaves(q, k, v)
    out = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, **kwargs)
    return torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", ordered_head_dims())
@pytest.mark.parametrize("mods", ["plain", "causal", "window", "left-only"])
def test_cuda_deterministic_backward(mods, head_dim, deterministic_algorithms):
    # dQ added in key-block order: every run the same bits, a sequence's gradients the same bits whatever else is
    # packed with it, and the values those of the default (unordered) backward.
    kwargs = mods_for(mods, 4, "cuda")
    q, k, v, cu_q, cu_k = packed_inputs([(700, 900)], 4, 2, head_dim, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    alone = [packed_grads(q, k, v, cu_q, cu_k, dout, **kwargs) for _ in range(3)]
    for run in alone[1:]:
        assert all(torch.equal(a, b) for a, b in zip(alone[0], run))
    q2, k2, v2, cu_q2, cu_k2 = packed_inputs([(130, 70), (700, 900), (5, 300)], 4, 2, head_dim, torch.bfloat16,
                                             "cuda")
    q2[130:830], k2[70:970], v2[70:970] = q, k, v
    dout2 = torch.randn_like(q2)
    dout2[130:830] = dout
    together = packed_grads(q2, k2, v2, cu_q2, cu_k2, dout2, **kwargs)
    assert torch.equal(together[0][130:830], alone[0][0])
    assert torch.equal(together[1][70:970], alone[0][1]) and torch.equal(together[2][70:970], alone[0][2])
    torch.use_deterministic_algorithms(False)
    unordered = packed_grads(q, k, v, cu_q, cu_k, dout, **kwargs)
    for a, b in zip(alone[0], unordered):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def deterministic_packed_grads(pairs, head_dim, mods):
    """The deterministic packed backward's (dq, dk, dv) twice (for run_isolated, under the caller's switches)."""
    torch.manual_seed(0)
    q, k, v, cu_q, cu_k = packed_inputs(pairs, 4, 2, head_dim, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    torch.use_deterministic_algorithms(True)
    kwargs = mods_for(mods, 4, "cuda")
    return [packed_grads(q, k, v, cu_q, cu_k, dout, **kwargs) for _ in range(2)]


@pytest.mark.cuda
@pytest.mark.parametrize("mods", ["causal", "window", "left-only"])
def test_cuda_deterministic_backward_each_kernel(mods):
    # On Hopper the packed ordered dQ runs in the TMA kernel (strict: it must take the call), its key blocks highest
    # first under a right edge; the portable kernel's stays under FLASHATTN_BWD_SM90=0. Each gives the same bits
    # twice; the two add in different orders, so their bits differ while both are right.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's ordered dQ")
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    pairs = MIXED + [(1000, 1000), (130, 1500)]
    hopper = run_isolated(dict(env, FLASHATTN_BWD_SM90="strict"), "op.test_varlen", "deterministic_packed_grads",
                          pairs, 128, mods)
    portable = run_isolated(dict(env, FLASHATTN_BWD_SM90="0"), "op.test_varlen", "deterministic_packed_grads", pairs,
                            128, mods)
    for first, second in (hopper, portable):
        assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(hopper[0][0], portable[0][0]), "dq came from the same kernel twice"
    for a, b in zip(hopper[0], portable[0]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.dtypes(cpu=[torch.bfloat16], cuda=[torch.bfloat16])
def test_autocast(device, dtype):
    # fp32 q and k (after a QK-norm autocast ran in fp32) with a bf16 v run in bf16, as the dense op does.
    q, k, v, cu_q, cu_k = packed_inputs(SHORT, 2, 2, 16, torch.float32, device)
    v = v.to(dtype)
    with torch.autocast(device, dtype=dtype):
        out = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert out.dtype == dtype
    want = flashattn_ext.flash_attn_varlen(q.to(dtype), k.to(dtype), v, cu_q, cu_k, causal=True)
    assert torch.equal(out, want)
