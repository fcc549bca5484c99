"""Reference attention, input makers and the accuracy rule shared by the tests.

The accuracy rule is FlashAttention's: measure how far PyTorch's own low-precision computation lands from a
high-precision reference, and allow our kernel at most ``ERROR_FACTOR`` times that, plus a small per-dtype floor.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from flashattn_ext.ops import _output_like

# Our max abs error vs the high-precision reference may be this many times PyTorch's own low-precision error...
ERROR_FACTOR = 3.0
# ...plus this floor. Small enough that a wrong scale, mask or head mapping still fails (test_checker_* proves it),
# large enough to absorb the rounding of the output itself when PyTorch happens to be exact (e.g. one key per row).
OUT_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
# lse is float32 on every dtype and computed from exactly upcast inputs, so it is held to fp32 accuracy
# (rtol = atol = value); fp64 inputs only lose the final rounding to float32.
LSE_TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reference is computed in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible_mask(len_q: int, len_k: int, causal: bool, device, window_size=(-1, -1)) -> Tensor:
    """(Lq, Lk) bool: query i sees key j. With shift = Lk - Lq: j >= i + shift - left where left >= 0, and
    j <= i + shift + right where right >= 0; causal sets right = 0 (bottom-right aligned)."""
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    left, right = window_size
    right = 0 if causal else right
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i + (len_k - len_q) - left
    if right >= 0:
        mask &= j <= i + (len_k - len_q) + right
    return mask


def rows_with_keys(len_q: int, len_k: int, causal: bool, device, window_size=(-1, -1)) -> Tensor:
    """(Lq,) bool: the query rows that see at least one key."""
    return visible_mask(len_q, len_k, causal, device, window_size).any(dim=-1)


def repeat_kv(t: Tensor, heads: int) -> Tensor:
    """GQA/MQA: expand (B, Hk, L, D) to (B, H, L, D) so that query head h reads kv head h // (H // Hk)."""
    heads_kv = t.shape[1]
    return t if heads_kv in (0, heads) else t.repeat_interleave(heads // heads_kv, dim=1)


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    upcast: bool = True,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Naive softmax(scale * q k^T) v, materialising the scores, with the window, softcap and sinks of flashattn.fwd.

    upcast=True computes in float32 (float64 for float64 inputs) and returns out in that dtype; upcast=False computes
    in the input dtype, like PyTorch's own low-precision path, and returns out in it. lse (natural log, (B, H, Lq)) is
    always reduced in the reference dtype from the scores of the chosen path. A row that sees no key (causal with
    Lq > Lk, a window, or Lk == 0) gets out = 0 and lse = -inf, or lse = its sink with sinks. Differentiable in
    q, k, v and sinks.
    """
    if upcast:
        acc = reference_dtype(q.dtype)
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
    heads, len_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    len_k = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k, v = repeat_kv(k, heads), repeat_kv(v, heads)

    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_mask(len_q, len_k, causal, q.device, window_size)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more column per row: the sink's logit, with no value row
        sink_col = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    lse = torch.logsumexp(scores.to(reference_dtype(scores.dtype)), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :len_k]
    else:  # softmax of an all -inf row is NaN; such a row attends to nothing.
        probs = probs.masked_fill(~visible.any(dim=-1)[:, None], 0.0)
    return torch.matmul(probs, v), lse


def sdpa_ref(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None, window_size=(-1, -1)
) -> Tensor:
    """torch SDPA with our semantics (bottom-right causal, GQA, windows as a boolean mask). Rows that see no key are
    unspecified (NaN or 0)."""
    len_q, len_k = q.shape[2], k.shape[2]
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    if tuple(window_size) != (-1, -1):
        mask = visible_mask(len_q, len_k, causal, q.device, window_size)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if causal and len_q != len_k:
        with warnings.catch_warnings():  # "will produce NaNs when seq_len_q > seq_len_kv": those rows are ignored
            warnings.simplefilter("ignore")
            mask = causal_lower_right(len_q, len_k)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def relative_error(x: Tensor, ref: Tensor) -> float:
    """||x - ref|| / ||ref||, over every element."""
    return ((x - ref).norm() / ref.norm()).item()


def flat_grads(model: torch.nn.Module) -> Tensor:
    """Every parameter's gradient, flattened into one float32 vector (parameters without one left out)."""
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def max_abs_error(x: Tensor, ref: Tensor, rows: Optional[Tensor] = None) -> float:
    """max |x - ref| over the query rows selected by the (Lq,) mask `rows` (all rows by default)."""
    diff = (x.to(ref.dtype) - ref).abs()
    if rows is not None:
        diff = diff[:, :, rows]
    return diff.max().item() if diff.numel() else 0.0


def assert_output_properties(out: Tensor, lse: Tensor, q: Tensor) -> None:
    """out: q's shape, dtype and device, finite; lse: float32 (B, H, Lq), contiguous, never NaN/+inf. (out's layout,
    which follows q's, is checked where the op's own out and q meet: test_fwd's layout tests.)"""
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and lse.device == q.device
    assert lse.is_contiguous()
    assert torch.isfinite(out).all(), "out has NaN or inf"
    assert not torch.isnan(lse).any() and not (lse == float("inf")).any(), "lse has NaN or +inf"


def assert_error_within(
    out: Tensor,
    ref: Tensor,
    low_precision: list[Tensor],
    rows: Optional[Tensor],
    what: str,
    floor: Optional[float] = None,
) -> None:
    """FlashAttention's rule on the rows `rows`: err(out) <= ERROR_FACTOR * max err(low_precision) + floor
    (floor: OUT_FLOOR of out's dtype unless given)."""
    floor = OUT_FLOOR[out.dtype] if floor is None else floor
    baseline = max((max_abs_error(x, ref, rows) for x in low_precision), default=0.0)
    err = max_abs_error(out, ref, rows)
    tol = ERROR_FACTOR * baseline + floor
    assert err <= tol, (
        f"{what}: max abs error {err:.3e} > {ERROR_FACTOR} x PyTorch low-precision error {baseline:.3e} "
        f"+ floor {floor:.1e}"
    )


# A low-precision path whose error exceeds this share of the largest reference output is no baseline: the naive path
# rounds the scores to the input dtype, and with scores in the hundreds (nearly one-hot rows) that alone moves its
# output by O(1), under which any output, zeros included, would pass.
MEANINGFUL_BASELINE = 0.125


def meaningful_baselines(low_precision: list[Tensor], ref: Tensor, rows: Optional[Tensor]) -> list[Tensor]:
    """The low-precision outputs whose error on `rows` stays within MEANINGFUL_BASELINE of the largest |ref| there,
    and ref rounded to their dtype (the output's own rounding: the least any kernel can do)."""
    picked = ref if rows is None else ref[:, :, rows]
    bound = MEANINGFUL_BASELINE * (picked.abs().max().item() if picked.numel() else 0.0)
    kept = [x for x in low_precision if max_abs_error(x, ref, rows) <= bound]
    return kept + [ref.to(low_precision[0].dtype)]


def truth_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the accuracy rule measures errors in: float32 for float16/bfloat16 inputs, float64 otherwise.

    float32 inputs are measured against float64 because PyTorch's float32 paths (naive and SDPA) share one GEMM:
    against a float32 reference they would show almost no error, leaving no honest baseline for the rule.
    """
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def assert_attention_close(
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> None:
    """Check out and lse of flashattn.fwd(q, k, v, causal, scale, window_size, softcap, sinks) against the references.

    out: vs the naive reference (attention_ref on inputs upcast to truth_dtype) and, without softcap and sinks, vs
    SDPA on the same upcast inputs, each within ERROR_FACTOR x the error of PyTorch's low-precision paths (naive and
    SDPA, in the input dtype; those that are a baseline at all: meaningful_baselines) + OUT_FLOOR. lse: vs logsumexp
    of the reference scores. Rows that see no key: out exactly 0 and lse exactly -inf, or exactly the sink (SDPA's
    output on those rows is ignored).
    """
    assert_output_properties(out, lse, q)
    len_q, len_k = q.shape[2], k.shape[2]
    keyed = rows_with_keys(len_q, len_k, causal, q.device, window_size)
    assert (out[:, :, ~keyed] == 0).all(), "rows without keys must be exactly 0"
    keyless_lse = float("-inf") if sinks is None else sinks.float()[None, :, None].expand_as(lse)[:, :, ~keyed]
    assert (lse[:, :, ~keyed] == keyless_lse).all(), "rows without keys must have lse = -inf (or the sink)"
    if out.numel() == 0 or not keyed.any():
        return

    mods = dict(window_size=window_size, softcap=softcap, sinks=sinks)
    hi = truth_dtype(q.dtype)
    q_hi, k_hi, v_hi = q.to(hi), k.to(hi), v.to(hi)
    ref_out, ref_lse = attention_ref(q_hi, k_hi, v_hi, causal, scale, **mods)
    low_out, low_lse = attention_ref(q, k, v, causal, scale, upcast=False, **mods)
    low_precision = [low_out]
    with_sdpa = softcap == 0 and sinks is None
    if with_sdpa:
        low_precision.append(sdpa_ref(q, k, v, causal, scale, window_size))
    low_precision = meaningful_baselines(low_precision, ref_out, keyed)
    assert_error_within(out, ref_out, low_precision, keyed, "out vs naive reference")
    if with_sdpa:
        sdpa_out = sdpa_ref(q_hi, k_hi, v_hi, causal, scale, window_size)
        assert_error_within(out, sdpa_out, low_precision, keyed, "out vs SDPA reference")

    tol = LSE_TOL[q.dtype]
    if softcap > 0:  # the kernels' tanh is approximate (as FlashAttention's): lse by the same rule as out
        assert_error_within(lse, ref_lse.float(), [low_lse.float()], keyed, "lse vs naive reference", floor=tol)
        return
    torch.testing.assert_close(
        lse[:, :, keyed], ref_lse[:, :, keyed].float(), rtol=tol, atol=tol, msg=lambda msg: f"lse vs reference: {msg}"
    )


# ---- gradients ----------------------------------------------------------------------------------------------------

# Gradients are not O(1) like out (dV sums over query rows, dQ/dK carry the scale), so their floor is relative:
# GRAD_FLOOR * max(1, max |reference gradient|). float64 gets a float32-sized floor on purpose: the saved lse is
# float32 by the op contract, so P = exp(S - lse) in the backward carries lse's rounding (~|lse| * 6e-8 relative)
# whatever the input dtype; PyTorch's float64 autograd has no such error and cannot serve as the baseline there.
GRAD_FLOOR = {torch.float64: 1e-5, torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def attention_grads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Optional[Tensor],
    dlse: Optional[Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    upcast: bool = True,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, ...]:
    """(dq, dk, dv), and dsinks with sinks, by autograd through attention_ref (same upcast rule), for the gradients
    dout of out and dlse of lse (either may be None: not used downstream). Gradients come back in the dtype the path
    computed in (dsinks in the reference dtype)."""
    if upcast:
        acc = reference_dtype(q.dtype)
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    inputs = (q, k, v)
    if sinks is not None:
        sinks = sinks.detach().to(reference_dtype(q.dtype)).requires_grad_()
        inputs += (sinks,)
    out, lse = attention_ref(q, k, v, causal, scale, upcast=False, window_size=window_size, softcap=softcap,
                             sinks=sinks)
    outputs, grads = [], []
    if dout is not None:
        outputs.append(out)
        grads.append(dout.to(out.dtype))
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    return torch.autograd.grad(outputs, inputs, grads, allow_unused=True, materialize_grads=True)


def assert_grad_properties(grads: tuple[Tensor, ...], q: Tensor, k: Tensor, v: Tensor) -> None:
    """dq, dk, dv: the shapes, dtype and device of q, k, v; finite. (Their layouts: assert_grad_layouts.)"""
    for name, grad, like in zip(("dq", "dk", "dv"), grads[:3], (q, k, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype and grad.device == like.device, name
        assert torch.isfinite(grad).all(), f"{name} has NaN or inf"


def assert_grad_layouts(grads: tuple[Tensor, ...], q: Tensor, k: Tensor, v: Tensor) -> None:
    """dq, dk, dv of the op's own call on q, k, v: in their layouts, as the fake implementation allocates them
    (flashattn_ext.ops._output_like)."""
    for name, grad, like in zip(("dq", "dk", "dv"), grads[:3], (q, k, v)):
        assert grad.stride() == _output_like(like).stride(), f"{name}: {grad.stride()} for an input of {like.stride()}"


def assert_grads_close(
    grads: tuple[Tensor, ...],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Optional[Tensor],
    dlse: Optional[Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    with_dsinks: bool = True,
) -> None:
    """Check (dq, dk, dv), and dsinks with sinks (unless with_dsinks is False: a packed call's dsinks sums over
    sequences), of flashattn for the output gradients (dout, dlse) against the references.

    Each gradient vs autograd through the naive reference on inputs upcast to truth_dtype, within ERROR_FACTOR x
    the error of autograd through the naive path in the input dtype + GRAD_FLOOR (relative, see above). dq of the
    rows that see no key must be exactly 0.
    """
    assert_grad_properties(grads, q, k, v)
    len_q, len_k = q.shape[2], k.shape[2]
    keyed = rows_with_keys(len_q, len_k, causal, q.device, window_size)
    assert (grads[0][:, :, ~keyed] == 0).all(), "dq of rows without keys must be exactly 0"
    if q.numel() == 0 or (k.numel() == 0 and sinks is None):
        return

    hi = truth_dtype(q.dtype)
    up = lambda t: None if t is None else t.to(hi)  # noqa: E731
    mods = dict(window_size=window_size, softcap=softcap, sinks=sinks)
    truth = attention_grads(up(q), up(k), up(v), up(dout), up(dlse), causal, scale, **mods)
    low_precision = attention_grads(q, k, v, dout, dlse, causal, scale, upcast=False, **mods)
    names = ("dq", "dk", "dv", "dsinks")[: len(truth) if with_dsinks else 3]
    assert len(grads) >= len(names), "dsinks missing"
    for name, grad, ref, low in zip(names, grads, truth, low_precision):
        floor = GRAD_FLOOR[grad.dtype] * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
        assert_error_within(grad, ref, [low], None, f"{name} vs naive reference", floor=floor)


def make_qkv(
    batch: int,
    heads: int,
    heads_kv: int,
    len_q: int,
    len_k: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
    layout: str = "contiguous",
) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh randn q (B, H, Lq, D), k and v (B, Hk, Lk, D) in one of these layouts:

    contiguous   plain (B, H, L, D) tensors
    seq_major    (B, L, H, D) tensors viewed as (B, H, L, D) through .transpose(1, 2)
    packed_qkv   transposed views of one packed (B, L, 3, H, D) tensor (needs Lq == Lk and H == Hk)
    padded_rows  (B, H, L, D + 24)[..., :D]: rows further apart than D
    """
    opts = dict(dtype=dtype, device=device)
    if layout == "contiguous":
        return (
            torch.randn(batch, heads, len_q, head_dim, **opts),
            torch.randn(batch, heads_kv, len_k, head_dim, **opts),
            torch.randn(batch, heads_kv, len_k, head_dim, **opts),
        )
    if layout == "seq_major":
        return (
            torch.randn(batch, len_q, heads, head_dim, **opts).transpose(1, 2),
            torch.randn(batch, len_k, heads_kv, head_dim, **opts).transpose(1, 2),
            torch.randn(batch, len_k, heads_kv, head_dim, **opts).transpose(1, 2),
        )
    if layout == "packed_qkv":
        assert len_q == len_k and heads == heads_kv, "packed_qkv needs Lq == Lk and H == Hk"
        qkv = torch.randn(batch, len_q, 3, heads, head_dim, **opts)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        return q, k, v
    if layout == "padded_rows":
        pad = 24
        return (
            torch.randn(batch, heads, len_q, head_dim + pad, **opts)[..., :head_dim],
            torch.randn(batch, heads_kv, len_k, head_dim + pad, **opts)[..., :head_dim],
            torch.randn(batch, heads_kv, len_k, head_dim + pad, **opts)[..., :head_dim],
        )
    raise ValueError(f"unknown layout {layout!r}")


def sinks_for_keys(heads: int, device="cpu") -> Tensor:
    """One float32 sink per head, from 2 to 6: near the lse of rows of tens to hundreds of keys (log 50 = 3.9, log 500
    = 6.2), so that each takes a share of its rows that a kernel ignoring or doubling it cannot hide in the tolerance."""
    return torch.linspace(2.0, 6.0, heads, device=device)


def with_sinks(mods: dict, heads: int, device="cpu") -> dict:
    """A copy of keyword arguments for the ops in which `sinks=True` stands for sinks_for_keys(heads, device)."""
    mods = dict(mods)
    if mods.get("sinks") is True:
        mods["sinks"] = sinks_for_keys(heads, device)
    return mods


def fwd_and_check(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None):
    """flashattn.fwd of q, k, v checked with assert_attention_close; returns (out, lse)."""
    out, lse = torch.ops.flashattn.fwd(q, k, v, causal, scale)
    assert_attention_close(out, lse, q, k, v, causal, scale)
    return out, lse


def align_trailing_keys(q: Tensor, k: Tensor, rows: int = 3) -> Tensor:
    """Key Lk - 1 - j set along query row Lq - 1 - j (j < rows; H == Hk), its score log(Lk) + 1/2 at the default
    scale against N(0, 1) ones: about half of that row, whose last visible key it is under the causal mask. A kernel
    that drops, doubles or misplaces a trailing key, or loses its dk / dv, then misses by far more than the tolerance;
    with random inputs such a key weighs ~1 / Lk in one row. Modifies k in place; returns it."""
    len_q, len_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    target = math.sqrt(head_dim) * (math.log(len_k) + 0.5)
    for j in range(min(rows, len_q, len_k)):
        query = q[:, :, len_q - 1 - j].float()
        k[:, :, len_k - 1 - j] = (query * target / query.square().sum(-1, keepdim=True)).to(k.dtype)
    return k


def steer_scores(q, k, profile, scale):
    """q and k (fp32) whose scores follow `profile` (per key, in log2 units of the softmax, i.e. after the scale) in
    the even query rows and half of it in the odd ones, over small noise: query column 0 is 1 or 0.5 on a 0.1-scaled
    rest, key column 0 the profile. Modifies k in place; returns (q, k)."""
    q = 0.1 * q
    q[..., 0::2, 0] = 1.0
    q[..., 1::2, 0] = 0.5
    k[..., 0] = profile / (scale * math.log2(math.e))
    return q, k


def poison_free_cuda_memory() -> None:
    """The caching allocator's cached blocks back to the driver, then 32 MiB of its small-block pool (allocations up to
    1 MiB) and a 512 MiB block filled with 0xFF bytes (NaN in fp16, bf16 and fp32) and freed: what a CUDA test allocates
    next starts as NaN, so an output or workspace a kernel leaves unwritten shows."""
    torch.cuda.empty_cache()
    blocks = [torch.full((2**20,), 255, dtype=torch.uint8, device="cuda") for _ in range(32)]
    blocks.append(torch.full((2**29,), 255, dtype=torch.uint8, device="cuda"))
    del blocks


def free_nan_blocks(numel: int, count: int = 8) -> None:
    """Leaves `count` freed float32 blocks of `numel` elements, NaN-filled, in the CUDA caching allocator, so that the
    next allocations of that size (a kernel's workspace) start dirty; checks on the host (no device temporary that
    would land on one) that one is handed back."""
    blocks = [torch.full((numel,), float("nan"), device="cuda") for _ in range(count)]
    del blocks
    assert torch.empty(numel, device="cuda").cpu().isnan().all(), "the caching allocator kept the NaN blocks"


def op_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None,
              window_size: tuple[int, int] = (-1, -1)):
    """(dout, out, lse, dlse) for calling flashattn.bwd directly: out and lse from flashattn.fwd (with the window the
    backward is given), random grads."""
    out, lse = torch.ops.flashattn.fwd(q, k, v, causal, scale, list(window_size))
    return torch.randn_like(out), out, lse, torch.randn_like(lse)


def leaves(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Fresh autograd leaves with the same values and strides (so the op sees strided views as they are)."""
    return tuple(t.detach().requires_grad_() for t in tensors)


def sample_inputs(device, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """Small (args, kwargs) samples of flashattn.fwd for opcheck and torch.compile tests."""

    def qkv(*shape, layout="contiguous"):
        return make_qkv(*shape, dtype=dtype, device=device, layout=layout)

    return [
        (qkv(2, 2, 2, 17, 17, 32), {}),
        (qkv(1, 4, 2, 9, 33, 64), {"causal": True}),  # GQA, Lq < Lk
        (qkv(1, 2, 1, 40, 24, 32), {"causal": True, "scale": 0.3}),  # MQA, Lq > Lk: rows without keys
        (qkv(2, 2, 2, 1, 70, 64, layout="seq_major"), {"scale": 0.125}),  # decode, strided views
        (qkv(1, 2, 2, 33, 33, 32, layout="packed_qkv"), {"causal": True}),
    ]
