"""The forward's contract on every device: flashattn.fwd against the naive reference and SDPA (reference.py has the
accuracy rule) over lengths, head dims, GQA, strides, scales, masks and empty inputs, and the checker's own test:
it rejects wrong attention."""
import math

import pytest
import torch

import flashattn_ext
from cases import HEAD_DIMS, LENGTH_PAIRS, TRAILING_LENGTHS
from flashattn_ext.ops import _output_like
from reference import (
    OUT_FLOOR,
    align_trailing_keys,
    assert_attention_close,
    assert_output_properties,
    make_qkv,
    reference_dtype,
    repeat_kv,
    visible_mask,
)
from reference import fwd_and_check as run_and_check

fwd = torch.ops.flashattn.fwd


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", LENGTH_PAIRS, ids=[f"q{a}-k{b}" for a, b in LENGTH_PAIRS])
def test_seq_lengths(device, dtype, causal, len_q, len_k):
    q, k, v = make_qkv(2, 2, 2, len_q, len_k, 64, dtype, device)
    run_and_check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", TRAILING_LENGTHS, ids=[f"q{a}-k{b}" for a, b in TRAILING_LENGTHS])
@pytest.mark.dtypes(cpu=[torch.float32])
def test_trailing_keys(device, dtype, causal, len_q, len_k):
    # The last rows' last keys carry half of those rows (align_trailing_keys): the bound of the last key block.
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, 64, dtype, device)
    run_and_check(q, align_trailing_keys(q, k), v, causal)


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


@pytest.mark.parametrize("len_q", [1, 3, 8])
def test_cpu_gqa_decode_same_bits_as_each_head_alone(len_q):
    # The CPU forward runs short GQA queries with every query head of a kv head in one work item (the keys converted
    # once for all): each head's rows have the bits of that head run alone. Window and sinks: per row, per head.
    q = torch.randn(2, 8, len_q, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 300, 64, dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.linspace(-1.0, 2.0, 8)
    out, lse = fwd(q, k, v, True, None, [100, 0], 0.0, sinks)
    for h in range(8):
        kv = slice(h // 4, h // 4 + 1)
        alone = fwd(q[:, h : h + 1], k[:, kv], v[:, kv], True, None, [100, 0], 0.0, sinks[h : h + 1])
        assert torch.equal(out[:, h : h + 1], alone[0]) and torch.equal(lse[:, h : h + 1], alone[1]), h


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
    # out in q's order of dimensions, as the fake implementation says: (B, L, H, D) memory for sequence-major q.
    assert out.stride() == _output_like(q).stride()
    if layout != "padded_rows":
        assert out.transpose(1, 2).is_contiguous()


LAYOUTS = ["contiguous", "seq_major", "heads_first", "packed_qkv", "size1_odd_stride", "expanded", "odd_strides",
           "empty_seq_major", "head_dim_36"]


def layout_query(layout, dtype, device):
    """A (B, H, Lq, D) query in `layout`, and the strides its outputs must have (None: q's own order's dense ones)."""
    batch, heads, len_q, head_dim = 2, 4, 9, 64
    shape = (batch, heads, len_q, head_dim)
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype, device=device), (heads * len_q * 64, len_q * 64, 64, 1)
    if layout in ("seq_major", "empty_seq_major"):
        rows = 0 if layout == "empty_seq_major" else batch
        q = torch.randn(rows, len_q, heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
        return q, (len_q * heads * 64, 64, heads * 64, 1) if rows else (heads * len_q * 64, len_q * 64, 64, 1)
    if layout == "heads_first":
        q = torch.randn(heads, batch, len_q, head_dim, dtype=dtype, device=device).transpose(0, 1)
        return q, (len_q * 64, batch * len_q * 64, 64, 1)
    if layout == "packed_qkv":  # not dense: dense strides in its order, (B, L, H, D)
        q = torch.randn(batch, len_q, 3, heads, head_dim, dtype=dtype, device=device)[:, :, 0].transpose(1, 2)
        return q, (len_q * heads * 64, 64, heads * 64, 1)
    if layout == "size1_odd_stride":  # a stride of a one-element dimension addresses nothing: kept
        q = torch.randn(batch * heads * head_dim, dtype=dtype, device=device)
        return q.as_strided((batch, heads, 1, head_dim), (heads * head_dim, head_dim, 7, 1)), None
    if layout == "odd_strides":  # padded rows of 72 elements: not dense, so dense strides in its order
        q = torch.randn(batch, heads, len_q, 72, dtype=dtype, device=device)[..., :head_dim]
        return q, (heads * len_q * 64, len_q * 64, 64, 1)
    if layout == "head_dim_36":  # sequence-major, strides no multiple of 8 (CPU only): contiguous
        q = torch.randn(batch, len_q, heads, 36, dtype=dtype, device=device).transpose(1, 2)
        return q, (heads * len_q * 36, len_q * 36, 36, 1)
    q = torch.randn(1, heads, len_q, head_dim, dtype=dtype, device=device).expand(batch, -1, -1, -1)
    return q, (heads * len_q * 64, len_q * 64, 64, 1)


def significant(t):
    """The strides of t's dimensions of more than one element (the others address nothing)."""
    return [s for n, s in zip(t.shape, t.stride()) if n > 1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_layout_follows_q(device, dtype, layout):
    # The layout rule of csrc/api/layouts.h, for the dense op and the KV-cache op alike; the fake implementation
    # (what torch.compile plans with) gives the same strides where they address anything.
    if layout == "head_dim_36" and device == "cuda":
        pytest.skip("CUDA takes head dims of multiples of 8")
    q, want = layout_query(layout, dtype, device)
    k, v = (torch.randn(q.shape[0], 2, 33, q.shape[3], dtype=dtype, device=device) for _ in range(2))
    out, lse = fwd(q, k, v, True)
    if want is not None:
        assert out.stride() == want
    assert significant(out) == significant(_output_like(q))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_out, _ = fwd(*(mode.from_tensor(t) for t in (q, k, v)), True)
    assert significant(fake_out) == significant(out)
    if q.numel():  # a fresh copy (.contiguous() keeps a one-element dimension's stride of 7, which SDPA refuses)
        assert_attention_close(out, lse, q.clone(memory_format=torch.contiguous_format), k, v, True)
    cached, _ = flashattn_ext.flash_attn_with_kvcache(q, k, v, causal=True, return_lse=True)
    assert cached.stride() == out.stride()
    torch.testing.assert_close(cached, out)


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
    assert out.stride() == _output_like(q).stride()
    # out in (B, L, H, D) memory as q: the caller's out.transpose(1, 2) is contiguous, no copy to view it back.
    assert out.stride() == (70 * 4 * 64, 64, 4 * 64, 1) and lse.stride() == (4 * 70, 70, 1)
    assert flashattn_ext.flash_attn(q, k, v, causal=True).equal(out)
    out2, lse2 = flashattn_ext.flash_attn_with_lse(q, k, v, causal=True)
    assert out2.equal(out) and lse2.equal(lse)


# ---- the accuracy rule must be able to fail --------------------------------------------------------------------


def buggy_attention(q, k, v, causal, scale, bug):
    """The reference (float64 for float64 inputs, else float32) with one deliberate bug ("none": without one), out cast
    to the input dtype and lse to float32 (what a broken kernel returns)."""
    len_q, len_k, heads = q.shape[2], k.shape[2], q.shape[1]
    qf, kf, vf = (t.to(reference_dtype(q.dtype)) for t in (q, k, v))
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
    return out.to(q.dtype), lse.float()


@pytest.mark.dtypes(cpu=list(OUT_FLOOR), cuda=[])
@pytest.mark.parametrize("bug", ["scale", "gqa_modulo", "top_left_mask", "mask_off_by_one", "lse_log2"])
def test_checker_rejects_bugs(device, dtype, bug):
    causal = bug != "gqa_modulo"
    q, k, v = make_qkv(1, 4, 2, 65, 97, 64, dtype, device)
    out, lse = buggy_attention(q, k, v, causal, 1 / 8, bug)
    with pytest.raises(AssertionError, match="lse|max abs error"):
        assert_attention_close(out, lse, q, k, v, causal, 1 / 8)


@pytest.mark.dtypes(cpu=list(OUT_FLOOR), cuda=[])
def test_checker_accepts_reference(device, dtype):
    # The bugs above are what fails the rule: the same code without one passes it.
    q, k, v = make_qkv(1, 4, 2, 65, 97, 64, dtype, device)
    out, lse = buggy_attention(q, k, v, True, 1 / 8, "none")
    assert_attention_close(out, lse, q, k, v, True, 1 / 8)


@pytest.mark.dtypes(cpu=[torch.float16, torch.bfloat16], cuda=[])
@pytest.mark.parametrize("scale", [1000.0, -1000.0], ids=["+1000", "-1000"])
def test_checker_holds_on_one_hot_rows(device, dtype, scale):
    # Scores in the thousands: the naive low-precision path rounds them to the input dtype and is off by O(1) there,
    # so the rule measures against the other baselines; a wrong output (stale rows, zeros) still fails it.
    q, k, v = make_qkv(1, 2, 2, 129, 200, 64, dtype, device)
    out, lse = buggy_attention(q, k, v, True, scale, "none")
    assert_attention_close(out, lse, q, k, v, True, scale)
    stale = torch.where(torch.arange(129, device=device)[:, None] % 2 == 0, out, out.roll(1, dims=2))
    for bad in (stale, torch.zeros_like(out)):
        with pytest.raises(AssertionError, match="max abs error"):
            assert_attention_close(bad, lse, q, k, v, True, scale)


# ---- CUDA only --------------------------------------------------------------------------------------------------


