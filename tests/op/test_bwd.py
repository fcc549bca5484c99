"""Gradients of flashattn (flashattn.bwd through the autograd registration) against autograd through the naive
reference, with the forward's accuracy rule (reference.py: assert_grads_close), plus gradcheck in float64."""
import pytest
import torch

import flashattn_ext
from cases import HEAD_DIMS, LENGTH_PAIRS, TRAILING_LENGTHS
from isolated import run_isolated
from reference import (
    GRAD_FLOOR,
    align_trailing_keys,
    assert_grad_layouts,
    assert_grad_properties,
    assert_grads_close,
    attention_grads,
    free_nan_blocks,
    leaves,
    make_qkv,
    op_inputs,
    repeat_kv,
    visible_mask,
)

fwd = torch.ops.flashattn.fwd
bwd = torch.ops.flashattn.bwd


def flash_grads(q, k, v, causal=False, scale=None, with_lse=False):
    """(dq, dk, dv) of flash_attn for a random dout, or of flash_attn_with_lse for a random (dout, dlse).

    torch.autograd.grad returns the op's own gradient tensors (.grad of a strided leaf could be a re-laid-out copy).
    Returns (grads, dout, dlse); dlse is None without with_lse (then None reaches flashattn.bwd).
    """
    q, k, v = leaves(q, k, v)
    if with_lse:
        out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal, scale)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    else:
        out = flashattn_ext.flash_attn(q, k, v, causal, scale)
        dout, dlse = torch.randn_like(out), None
        grads = torch.autograd.grad(out, (q, k, v), dout)
    return grads, dout, dlse


def run_and_check(q, k, v, causal=False, scale=None, with_lse=False):
    grads, dout, dlse = flash_grads(q, k, v, causal, scale, with_lse)
    assert_grads_close(grads, q, k, v, dout, dlse, causal, scale)
    return grads


# ---- gradcheck (float64, CPU): finite differences of our forward against our backward ----------------------------

GRADCHECK_CASES = {
    # id: (B, H, Hk, Lq, Lk, D, causal, scale, layout)
    "basic": (1, 2, 2, 6, 9, 4, False, None, "contiguous"),
    "causal": (2, 1, 1, 6, 9, 4, True, None, "contiguous"),
    "multi-block-causal": (1, 1, 1, 40, 70, 3, True, None, "contiguous"),  # crosses the 32-row and 64-key tiles
    "lq-gt-lk-causal": (1, 2, 2, 9, 4, 4, True, None, "contiguous"),  # rows 0..4 see no key
    "lq-gt-lk": (1, 2, 2, 9, 4, 4, False, None, "contiguous"),
    "gqa": (1, 4, 2, 5, 8, 4, True, None, "contiguous"),
    "mqa": (2, 4, 1, 5, 8, 4, False, None, "contiguous"),
    "scale": (1, 2, 2, 5, 8, 4, False, 0.7, "contiguous"),
    "negative-scale": (1, 2, 2, 5, 8, 4, True, -0.6, "contiguous"),
    "seq-major": (1, 2, 2, 6, 9, 4, True, None, "seq_major"),
    "padded-rows": (1, 2, 1, 6, 9, 4, False, None, "padded_rows"),
    "d5": (1, 2, 2, 7, 7, 5, True, None, "contiguous"),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck(case):
    batch, heads, heads_kv, len_q, len_k, head_dim, causal, scale, layout = GRADCHECK_CASES[case]
    q, k, v = leaves(*make_qkv(batch, heads, heads_kv, len_q, len_k, head_dim, torch.float64, "cpu", layout))
    assert torch.autograd.gradcheck(lambda q, k, v: flashattn_ext.flash_attn(q, k, v, causal, scale), (q, k, v))


@pytest.mark.parametrize("case", ["basic", "multi-block-causal", "lq-gt-lk-causal", "gqa", "negative-scale"])
def test_gradcheck_with_lse(case):
    # Both outputs feed the result, so the lse gradient (dlse) is checked too. lse is float32 even for float64
    # inputs: its rounding (~5e-7) over a central difference of 2 * eps needs eps = 1e-3 and atol = 2e-3.
    batch, heads, heads_kv, len_q, len_k, head_dim, causal, scale, layout = GRADCHECK_CASES[case]
    q, k, v = leaves(*make_qkv(batch, heads, heads_kv, len_q, len_k, head_dim, torch.float64, "cpu", layout))

    def fn(q, k, v):
        out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal, scale)
        # Rows without keys have lse = -inf, whose finite differences are NaN: give them a constant instead.
        return out, torch.where(torch.isfinite(lse), lse, 0.0).double()

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-3)


# ---- gradients against the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", LENGTH_PAIRS, ids=[f"q{a}-k{b}" for a, b in LENGTH_PAIRS])
def test_seq_lengths(device, dtype, causal, len_q, len_k):
    q, k, v = make_qkv(2, 2, 2, len_q, len_k, 64, dtype, device)
    run_and_check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", TRAILING_LENGTHS, ids=[f"q{a}-k{b}" for a, b in TRAILING_LENGTHS])
@pytest.mark.dtypes(cpu=[torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_trailing_keys(device, dtype, causal, len_q, len_k, head_dim):
    # The last rows' last keys carry half of those rows (align_trailing_keys), so their dk and dv are among the
    # largest: a backward that loses the last key block's gradients, or a key of it, fails.
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, head_dim, dtype, device)
    run_and_check(q, align_trailing_keys(q, k), v, causal, with_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_head_dims(device, dtype, causal, head_dim):
    if device == "cuda" and head_dim % 8:
        pytest.skip("CUDA needs head dim % 8 == 0")
    q, k, v = make_qkv(1, 2, 2, 97, 129, head_dim, dtype, device)
    run_and_check(q, k, v, causal, with_lse=True)
    q, k, v = make_qkv(1, 2, 2, 129, 97, head_dim, dtype, device)
    run_and_check(q, k, v, causal, with_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.dtypes(cpu=[])  # the CPU backward is covered at these sizes by the tests above
def test_head_dims_across_many_blocks(device, dtype, causal, head_dim):
    # The head dims of the Hopper backward kernels, with GQA and several key and query blocks of ragged length,
    # Lq > Lk and Lq < Lk: their multi-step pipelines, the GQA walk and the diagonal masks.
    q, k, v = make_qkv(1, 4, 2, 300, 513, head_dim, dtype, device)
    run_and_check(q, k, v, causal, with_lse=True)
    q, k, v = make_qkv(2, 2, 1, 1025, 200, head_dim, dtype, device)
    run_and_check(q, k, v, causal, with_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_kv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("len_q,len_k", [(65, 65), (1, 97), (97, 63)], ids=["q65-k65", "q1-k97", "q97-k63"])
def test_grouped_kv_heads(device, dtype, causal, heads_kv, len_q, len_k):
    q, k, v = make_qkv(2, 4, heads_kv, len_q, len_k, 64, dtype, device)
    run_and_check(q, k, v, causal, with_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [0.25, 2.0, -0.5])
def test_custom_scale(device, dtype, causal, scale):
    q, k, v = make_qkv(1, 2, 2, 65, 97, 64, dtype, device)
    run_and_check(q, k, v, causal, scale, with_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["packed_qkv", "seq_major", "padded_rows"])
def test_strided_inputs(device, dtype, causal, layout):
    len_k = 97 if layout == "packed_qkv" else 130
    q, k, v = make_qkv(2, 3, 3, 97, len_k, 64, dtype, device, layout=layout)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    grads, dout, _ = flash_grads(q, k, v, causal)
    assert_grads_close(grads, q, k, v, dout, None, causal)
    assert_grad_layouts(grads, q, k, v)  # sequence-major grads for sequence-major inputs: no copy to view them back
    # Same numbers as with contiguous copies (the kernels index with the strides they are given).
    q_c, k_c, v_c = leaves(q.contiguous(), k.contiguous(), v.contiguous())
    expected = torch.autograd.grad(flashattn_ext.flash_attn(q_c, k_c, v_c, causal), (q_c, k_c, v_c), dout)
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    for grad, want in zip(grads, expected):
        torch.testing.assert_close(grad, want, **exact)


def test_grads_follow_each_input_layout(device, dtype):
    # dk follows k and dv follows v, each its own: k sequence-major, v heads-first, q contiguous (GQA, so that dq and
    # dk differ in shape too).
    batch, heads, heads_kv, len_q, len_k, head_dim = 2, 4, 2, 70, 90, 64
    q = torch.randn(batch, heads, len_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, len_k, heads_kv, head_dim, dtype=dtype, device=device).transpose(1, 2)
    v = torch.randn(heads_kv, batch, len_k, head_dim, dtype=dtype, device=device).transpose(0, 1)
    grads, dout, _ = flash_grads(q, k, v, True)
    assert_grad_layouts(grads, q, k, v)
    assert grads[1].stride() == (len_k * heads_kv * 64, 64, heads_kv * 64, 1)
    assert grads[2].stride() == (len_k * 64, batch * len_k * 64, 64, 1)
    q_c, k_c, v_c = leaves(q, k.contiguous(), v.contiguous())
    expected = torch.autograd.grad(flashattn_ext.flash_attn(q_c, k_c, v_c, True), (q_c, k_c, v_c), dout)
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    for grad, want in zip(grads, expected):
        torch.testing.assert_close(grad, want, **exact)


def test_strided_op_arguments(device, dtype):
    # flashattn.bwd called directly with dout, out, lse and dlse all strided views: read as given (dlse too).
    q, k, v = make_qkv(2, 4, 2, 70, 90, 64, dtype, device, layout="seq_major")
    dout, out, lse, dlse = op_inputs(q, k, v, True)
    strided = {
        "dout": dout.transpose(1, 2).contiguous().transpose(1, 2),
        "out": out.transpose(1, 2).contiguous().transpose(1, 2),
        "lse": lse.transpose(1, 2).contiguous().transpose(1, 2),
        "dlse": torch.stack([dlse, torch.zeros_like(dlse)], dim=-1)[..., 0],  # stride(-1) == 2
    }
    assert not any(t.is_contiguous() for t in strided.values())
    got = bwd(strided["dout"], q, k, v, strided["out"], strided["lse"], True, None, strided["dlse"])
    expected = bwd(dout, q, k, v, out, lse, True, None, dlse)
    assert_grad_properties(got, q, k, v)
    assert_grad_layouts(got, q, k, v)
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    for grad, want in zip(got, expected):
        torch.testing.assert_close(grad, want, **exact)


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence(device, dtype, causal):
    batch, heads = (1, 1) if device == "cpu" else (2, 4)
    q, k, v = make_qkv(batch, heads, heads, 2049, 2049, 64, dtype, device)
    run_and_check(q, k, v, causal, with_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256], ids=["d40", "d64", "d128", "d256"])
def test_dirty_workspace(device, dtype, causal, head_dim):
    # dQ is summed across key blocks in a float32 workspace (B, H, Lq, D) that the preprocessing zeroes: handed NaN
    # memory by the caching allocator, the gradients stay right.
    if device == "cpu":
        pytest.skip("the CPU backward has no workspace")
    q, k, v = make_qkv(2, 3, 3, 97, 300, head_dim, dtype, device)
    dout, out, lse, dlse = op_inputs(q, k, v, causal)
    free_nan_blocks(q.numel())
    grads = bwd(dout, q, k, v, out, lse, causal, None, dlse)
    assert_grads_close(grads[:3], q, k, v, dout, dlse, causal)


@pytest.mark.parametrize("len_q,len_k", [(129, 65), (40, 1)], ids=["q129-k65", "q40-k1"])
def test_rows_without_keys(device, dtype, len_q, len_k):
    # Causal with Lq > Lk: rows i < Lq - Lk see no key. Their dq is exactly 0, and whatever gradient arrives for
    # them (even an infinite dlse) must not reach dk/dv or turn into NaN.
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, 64, dtype, device)
    grads = run_and_check(q, k, v, causal=True, with_lse=True)
    blind = len_q - len_k
    assert (grads[0][:, :, :blind] == 0).all() and (grads[0][:, :, blind:].abs().sum(-1) > 0).all()

    dout, out, lse, dlse = op_inputs(q, k, v, True)
    clean = bwd(dout, q, k, v, out, lse, True, None, dlse)
    dout[:, :, :blind] = 1e4 * torch.randn_like(dout[:, :, :blind])
    dlse[:, :, :blind] = float("inf")
    dirty = bwd(dout, q, k, v, out, lse, True, None, dlse)
    assert_grad_properties(dirty, q, k, v)
    for grad, want in zip(dirty, clean):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_minus_inf_lse_rows_contribute_nothing(device, dtype):
    # The op's contract: P = exp(S - lse) is 0 on a row whose lse is -inf, even if the row sees keys (a caller may
    # pass such an lse directly). Those rows get dq = 0, and dk/dv equal the gradients without them.
    q, k, v = make_qkv(1, 2, 2, 70, 90, 64, dtype, device)
    dout, out, lse, dlse = op_inputs(q, k, v)
    dropped = torch.zeros(70, dtype=torch.bool, device=device)
    dropped[[0, 31, 32, 50]] = True
    lse = lse.clone()
    lse[:, :, dropped] = float("-inf")
    dq, dk, dv, _ = bwd(dout, q, k, v, out, lse, False, None, dlse)
    assert_grad_properties((dq, dk, dv), q, k, v)
    assert (dq[:, :, dropped] == 0).all()
    kept = ~dropped
    dq_kept, dk_kept, dv_kept, _ = bwd(
        dout[:, :, kept], q[:, :, kept], k, v, out[:, :, kept], lse[:, :, kept], False, None, dlse[:, :, kept]
    )
    for grad, want in zip((dq[:, :, kept], dk, dv), (dq_kept, dk_kept, dv_kept)):
        torch.testing.assert_close(grad, want)


def test_expanded_dout(device, dtype):
    # out.sum().backward() hands the backward a dout of stride 0 everywhere (an expanded scalar).
    q, k, v = leaves(*make_qkv(1, 4, 2, 33, 70, 64, dtype, device))
    flashattn_ext.flash_attn(q, k, v, causal=True).sum().backward()
    grads = (q.grad, k.grad, v.grad)
    assert_grads_close(grads, q, k, v, torch.ones(q.shape, dtype=dtype, device=device), None, causal=True)
    q2, k2, v2 = leaves(q, k, v)
    out = flashattn_ext.flash_attn(q2, k2, v2, causal=True)
    expected = torch.autograd.grad(out, (q2, k2, v2), torch.ones_like(out))
    for grad, want in zip(grads, expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_only_lse_used(device, dtype, causal):
    # out is unused: autograd passes no dout, the backward runs with dout = 0 and the lse gradient alone.
    q, k, v = leaves(*make_qkv(1, 2, 2, 65, 97, 64, dtype, device))
    _, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal)
    dlse = torch.randn_like(lse)
    grads = torch.autograd.grad(lse, (q, k, v), dlse)
    assert_grads_close(grads, q, k, v, None, dlse, causal)
    assert (grads[2] == 0).all(), "lse does not depend on v: dv must be 0"


def test_needs_input_grad(device, dtype):
    # Only k requires a gradient: q and v get none, and k's is the one a call with every gradient gives.
    q, k, v = make_qkv(1, 2, 2, 17, 33, 64, dtype, device)
    dout = torch.randn_like(q)
    inputs = leaves(q, k, v)
    _, want_dk, _ = torch.autograd.grad(flashattn_ext.flash_attn(*inputs), inputs, dout)
    k = k.detach().requires_grad_()
    flashattn_ext.flash_attn(q, k, v).backward(dout)
    assert q.grad is None and v.grad is None
    torch.testing.assert_close(k.grad, want_dk)


@pytest.mark.parametrize(
    "batch,heads,len_q,len_k",
    [(0, 2, 16, 24), (2, 0, 16, 24), (2, 2, 0, 24), (2, 2, 16, 0)],
    ids=["batch0", "heads0", "len_q0", "len_k0"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_inputs(device, dtype, batch, heads, len_q, len_k, causal):
    q, k, v = make_qkv(batch, heads, heads, len_q, len_k, 64, dtype, device)
    dout, out, lse, dlse = op_inputs(q, k, v, causal)
    grads = bwd(dout, q, k, v, out, lse, causal, None, dlse)
    assert_grad_properties(grads, q, k, v)
    assert all((g == 0).all() for g in grads)
    # Through autograd as well (Lk == 0: out = 0 and lse = -inf, every gradient 0).
    q, k, v = leaves(q, k, v)
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal)
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.ones_like(out), torch.ones_like(lse)))
    assert_grad_properties(grads, q, k, v)
    assert all((g == 0).all() for g in grads)
    # A loss's gradient: that of out.sum() is expanded (every stride 0), also where out is empty.
    flashattn_ext.flash_attn(q, k, v, causal).sum().backward()
    assert all(t.grad.shape == t.shape and (t.grad == 0).all() for t in (q, k, v))


def test_direct_op_matches_autograd(device, dtype):
    # The dispatcher op with explicit defaults gives what autograd gives (both gradients, dlse included).
    q, k, v = make_qkv(2, 4, 2, 45, 77, 64, dtype, device)
    grads, dout, dlse = flash_grads(q, k, v, causal=True, with_lse=True)
    out, lse = fwd(q, k, v, True)
    direct = bwd(dout, q, k, v, out, lse, causal=True, scale=None, dlse=dlse, deterministic=False)
    for grad, want in zip(direct, grads):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


# ---- determinism, double backward ---------------------------------------------------------------------------------


@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16], cuda=[torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads_kv", [4, 1], ids=["mha", "mqa"])  # MQA: many query heads add into one dk/dv
def test_deterministic(device, dtype, heads_kv, deterministic_algorithms):
    q, k, v = leaves(*make_qkv(2, 4, heads_kv, 300, 300, 64, dtype, device))
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    first = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), retain_graph=True)
    second = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert_same_bits(first, second)


@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize(
    "shape",
    [(2, 8, 2, 1000, 1100), (1, 4, 4, 1500, 700), (1, 2, 1, 300, 2300), (37, 2, 1, 260, 300)],
    ids=["gqa", "lq-gt-lk", "lq-lt-lk", "many-pairs"],
)
def test_deterministic_many_key_blocks(device, dtype, causal, head_dim, shape, deterministic_algorithms):
    # Many key blocks add into each dQ block (up to 18 of 128 keys, 36 of 64 at D256), where an unordered addition
    # would change bits from run to run: with deterministic algorithms every run gives the same bits, and the gradients
    # are right (Hopper: the kernels' ordered dQ, causal with the key blocks reversed; elsewhere the chunked backward).
    # many-pairs: 37 (batch, kv head) pairs, whose key blocks start in turn in groups (Hopper, without a mask), the last
    # group smaller.
    batch, heads, heads_kv, len_q, len_k = shape
    q, k, v = leaves(*make_qkv(batch, heads, heads_kv, len_q, len_k, head_dim, dtype, device))
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal=causal)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    runs = [torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), retain_graph=True) for _ in range(4)]
    for run in runs[1:]:
        assert_same_bits(runs[0], run)
    assert_grads_close(runs[0], q, k, v, dout, dlse, causal, None)


def assert_same_bits(first, second):
    """Two runs' (dq, dk, dv) are the same bits; else which gradient differs, in how many elements and rows."""
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        differ = a != b
        if differ.any():
            rows = differ.any(-1).nonzero()[:, -1]
            raise AssertionError(f"two backward runs differ: {name} in {int(differ.sum())} elements, rows "
                                 f"{int(rows.min())}..{int(rows.max())} of {a.shape[-2]}")


def deterministic_gradients(q, k, v, dout, dlse, causal, window=(-1, -1), softcap=0.0):
    """flashattn.bwd's gradients with deterministic algorithms (for run_isolated, under the caller's switches)."""
    torch.use_deterministic_algorithms(True)
    out, lse = fwd(q, k, v, causal, None, list(window), softcap)
    return bwd(dout, q, k, v, out, lse, causal, None, dlse, True, list(window), softcap)


@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=["d128", "d256"])
def test_deterministic_takes_the_hopper_kernel(device, dtype, causal, head_dim):
    # On Hopper deterministic algorithms run the fused kernels (strict: or raise), not the chunked backward: the two
    # add in different orders, so their bits differ while both are right.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's ordered dQ")
    q, k, v = make_qkv(1, 4, 2, 700, 900, head_dim, dtype, device)
    out, _ = fwd(q, k, v, causal)
    dout, dlse = torch.randn_like(out), torch.randn(out.shape[:3], device=device)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    fused = run_isolated(dict(env, FLASHATTN_BWD_SM90="strict"), "op.test_bwd", "deterministic_gradients", q, k, v,
                         dout, dlse, causal)
    chunked = run_isolated(dict(env, FLASHATTN_CUDA_BWD="chunked"), "op.test_bwd", "deterministic_gradients", q, k, v,
                           dout, dlse, causal)
    assert not torch.equal(fused[0], chunked[0]), "dq came from the same path twice"
    for a, b in zip(fused, chunked):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[])
def test_cpu_deterministic_across_thread_counts(device, dtype):
    # No atomics and a fixed summation order per output element: the thread count does not change a bit.
    q, k, v = make_qkv(1, 4, 2, 200, 300, 64, dtype, device)
    dout, out, lse, dlse = op_inputs(q, k, v, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = bwd(dout, q, k, v, out, lse, True, None, dlse)
    finally:
        torch.set_num_threads(threads)
    multi = bwd(dout, q, k, v, out, lse, True, None, dlse)
    for a, b in zip(single, multi):
        assert torch.equal(a, b)


def test_double_backward_raises(device):
    dtype = torch.float64 if device == "cpu" else torch.float16
    q, k, v = leaves(*make_qkv(1, 2, 2, 8, 8, 32, dtype, device))
    out = flashattn_ext.flash_attn(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (dq.sum() + dk.sum() + dv.sum()).backward()


# ---- the accuracy rule must be able to fail --------------------------------------------------------------------


def buggy_grads(q, k, v, dout, dlse, causal, scale, bug):
    """float32 autograd gradients of attention with one deliberate bug, cast to the input dtype."""
    f = lambda t: t.float()  # noqa: E731
    if bug == "scale":  # 10% off
        return tuple(g.to(q.dtype) for g in attention_grads(f(q), f(k), f(v), f(dout), f(dlse), causal, 1.1 * scale))
    if bug == "dlse_ignored":
        return tuple(g.to(q.dtype) for g in attention_grads(f(q), f(k), f(v), f(dout), None, causal, scale))
    if bug == "dlse_sign":
        return tuple(g.to(q.dtype) for g in attention_grads(f(q), f(k), f(v), f(dout), -f(dlse), causal, scale))

    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    qf = f(q).requires_grad_()
    kr, vr = (repeat_kv(f(t), heads).detach().requires_grad_() for t in (k, v))  # gradients per query head
    len_q, len_k = q.shape[2], k.shape[2]
    visible = visible_mask(len_q, len_k, causal, q.device)
    if bug == "mask_off_by_one":  # the diagonal key is masked too
        i, j = torch.arange(len_q, device=q.device)[:, None], torch.arange(len_k, device=q.device)[None, :]
        visible = j < i + (len_k - len_q)
    scores = (qf @ kr.transpose(-2, -1) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ vr
    dq, dkr, dvr = torch.autograd.grad((out, lse), (qf, kr, vr), (f(dout), f(dlse)))
    if bug == "gqa_first_head_only":  # dk/dv of a kv head taken from the first query head of its group only
        dk, dv = dkr[:, ::group].contiguous(), dvr[:, ::group].contiguous()
    else:
        dk, dv = dkr.unflatten(1, (-1, group)).sum(2), dvr.unflatten(1, (-1, group)).sum(2)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


@pytest.mark.dtypes(cpu=list(GRAD_FLOOR), cuda=[])
@pytest.mark.parametrize("bug", ["scale", "dlse_ignored", "dlse_sign", "mask_off_by_one", "gqa_first_head_only"])
def test_grad_checker_rejects_bugs(device, dtype, bug):
    q, k, v = make_qkv(1, 4, 2, 65, 97, 64, dtype, device)
    dout, _, _, dlse = op_inputs(q, k, v, True, 1 / 8)
    grads = buggy_grads(q, k, v, dout, dlse, True, 1 / 8, bug)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_grads_close(grads, q, k, v, dout, dlse, True, 1 / 8)


def test_grad_checker_accepts_reference(device, dtype):
    # The counterpart: the same construction without a bug passes (so the rejections above are the bugs).
    q, k, v = make_qkv(1, 4, 2, 65, 97, 64, dtype, device)
    dout, _, _, dlse = op_inputs(q, k, v, True, 1 / 8)
    assert_grads_close(buggy_grads(q, k, v, dout, dlse, True, 1 / 8, "none"), q, k, v, dout, dlse, True, 1 / 8)


# ---- CUDA only --------------------------------------------------------------------------------------------------


