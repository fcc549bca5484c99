"""Python face of the flashattn ops: user-facing functions and fake (meta) implementations (autograd and autocast
are registered in C++: csrc/autograd.cpp, csrc/autocast.cpp)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "flash_attn", "flash_attn_with_lse", "flash_attn_varlen", "flash_attn_varlen_with_lse", "flash_attn_with_kvcache"
]


def _pair(window_size) -> list:
    """window_size as the ops take it (a list; they check its length and entries)."""
    try:
        return list(window_size)
    except TypeError:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}") from None


def flash_attn_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Like :func:`flash_attn`, but also returns ``lse`` (float32, (B, H, Lq)): the natural-log logsumexp
    of each row of (capped) scores and its sink (``-inf`` exactly for a row that sees no key and has no sink; NaN for
    a row whose softmax is NaN). Both outputs are differentiable."""
    return torch.ops.flashattn.fwd(q, k, v, causal, scale, _pair(window_size), softcap, sinks)


def flash_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Exact attention ``softmax(scale * q @ k.T) @ v`` without materialising the score matrix.

    Args:
        q: (B, H, Lq, D) queries.
        k: (B, Hk, Lk, D) keys; ``H % Hk == 0`` (GQA/MQA): query head ``h`` reads kv head ``h // (H // Hk)``.
        v: (B, Hk, Lk, D) values.
        causal: bottom-right aligned causal mask: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``
            (equal to SDPA's ``is_causal`` when ``Lq == Lk``). A query row that sees no key returns zeros
            (SDPA returns NaN there).
        scale: multiplier of the scores; defaults to ``1 / sqrt(D)``. Any finite value with
            ``|scale| * log2(e)`` within float32 (about 2.36e38); a scale too small for a normal float32 (even 0)
            gives the uniform softmax.
        window_size: ``(left, right)`` sliding window, inclusive: with ``shift = Lk - Lq``, query ``i`` sees key
            ``j`` iff ``i + shift - left <= j <= i + shift + right``; ``-1`` leaves that side unbounded. With
            ``causal`` the right side is 0. A query row that sees no key returns zeros.
        softcap: if > 0, scores are capped as ``softcap * tanh(scale * q.k / softcap)`` (Gemma 2).
        sinks: optional float32 (H,) tensor, one learnable logit per query head that joins each row's softmax
            denominator without a value row (gpt-oss): rows are scaled by ``sum / (sum + exp(sink))``; a row that sees
            no key returns zeros with ``lse = sink``. Differentiable.

    Any strides with ``stride(-1) == 1`` are used as given (no copy), e.g. transposed views of a packed
    (B, L, 3, H, D) tensor; ``out`` (and in the backward ``dq``, ``dk``, ``dv``) comes in the memory order of its input
    (``torch.empty_like``'s layout; contiguous where its strides would not be multiples of 8 elements): (B, L, H, D)
    memory for such views. CUDA supports float16 and bfloat16 with ``D`` a multiple of 8 up to 256; CPU supports
    float32, float64, float16 and bfloat16 with any ``D``. Under ``torch.autocast`` q, k and v are cast to the autocast
    dtype first (float64 is left alone), as SDPA's are.

    A NaN reaches every row that sees it (a NaN in a query row, or in a key the row sees, makes that row's output and
    lse NaN); infinite scores follow softmax. A sequence's result is the same bits whatever else is in the batch.

    Differentiable with respect to q, k, v and sinks. The backward is deterministic (bitwise-identical gradients across
    runs, and across batches) when ``torch.use_deterministic_algorithms(True)`` is in effect.

    Returns:
        out: (B, H, Lq, D), the dtype of ``q``.
    """
    return torch.ops.flashattn.fwd(q, k, v, causal, scale, _pair(window_size), softcap, sinks)[0]


def flash_attn_varlen_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Like :func:`flash_attn_varlen`, but also returns ``lse``: float32 (H, total_q), each row's logsumexp as in
    :func:`flash_attn_with_lse`. Both outputs are differentiable."""
    return torch.ops.flashattn.fwd_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, _pair(window_size), softcap,
        sinks,
    )


def flash_attn_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention over packed sequences of different lengths (FlashAttention's ``flash_attn_varlen_func``).

    Args:
        q: (total_q, H, D) the queries of every sequence, one after the other.
        k, v: (total_k, Hk, D) their keys and values; ``H % Hk == 0``.
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on the tensors' device, from 0, non-decreasing, ending at
            total_q / total_k: sequence ``b`` is rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q and
            ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1`` of k and v. Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: optional hints (the results never depend on them).
        causal, scale, window_size, softcap, sinks: as in :func:`flash_attn`, per sequence (bottom-right causal
            with each sequence's own L_q and L_k).

    Every rule of :func:`flash_attn` holds per sequence, and a sequence's result is the same bits whatever else is
    packed with it. Any strides with ``stride(-1) == 1``; out (and the gradients) come contiguous. Differentiable in
    q, k, v and sinks (on CUDA the backward takes head dims up to 128, above that on Hopper only; with deterministic
    algorithms its gradients are bitwise reproducible and the same whatever else is packed). On CUDA the lengths are
    read on the device only (no host synchronisation; CUDA graphs replay with new lengths), so cu_seqlens values are
    not checked there: ones that break the rules give wrong rows, never an access outside the tensors.

    Returns:
        out: (total_q, H, D), the dtype of ``q``.
    """
    return flash_attn_varlen_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_size, softcap, sinks
    )[0]


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    cache_seqlens: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    num_splits: int = 0,
    return_lse: bool = False,
    cache_leftpad: Optional[Tensor] = None,
):
    """Attention of new queries against a KV cache, forward only: a few (decoding; on CUDA up to 16 rows take the
    split-KV decode path) or a chunk of a prompt (on Hopper, the TMA forward).

    Args:
        q: (B, H, Lq, D) queries, the last Lq positions of each sequence.
        k_cache, v_cache: a dense cache (B, Hk, Lmax, D), or a paged one (num_pages, Hk, page_size, D) read through
            ``block_table`` (int32 (B, max_pages): entry b's pages in order). A (num_pages, page_size, Hk, D) cache
            passes as ``.transpose(1, 2)`` (any strides with stride(-1) == 1).
        k, v: optional (B, Hk, Lnew, D) new keys and values, written into the caches (in place) at positions
            ``cache_seqlens[b] ..``; attention then runs over ``cache_seqlens[b] + Lnew`` keys. The caches may then
            share no memory (with each other, with k or v, or within one, as an expanded tensor does).
        cache_seqlens: int32 (B,) valid lengths before the append (default: the whole cache less Lnew). Whatever lies
            past a valid length (garbage, NaN) never reaches the output. ``cache_seqlens`` itself is not changed.
        causal, scale, window_size, softcap, sinks: as in :func:`flash_attn`, per batch entry (bottom-right causal).
        num_splits: on CUDA, the number of key splits (0: chosen from the shape and the GPU's SM count, never from
            the batch size or the lengths, so results are batch-invariant): the decode path's (Lq <= 16) and, on
            Hopper, the query chunks'; ignored elsewhere. At most 64 and the number of key blocks: larger values are
            clamped.
        return_lse: also return lse (float32, (B, H, Lq)).
        cache_leftpad: int32 (B,), a dense cache only: entry b's keys start at ``cache_leftpad[b]`` (a left-padded
            batch, as batched generation pads prompts; default 0). Its keys are then ``cache_leftpad[b] ..
            cache_seqlens[b] + Lnew``, bottom-right causal among them; the rows before are never read.

    On CUDA the lengths, left paddings and the block table are read on the device only (no host synchronisation; a
    captured CUDA graph replays with new lengths), so their values are not checked there: out-of-range ones give
    wrong rows (new rows past the cache are not written; pages are clamped into it), never an access outside the
    tensors; the CPU checks them. Returns out (B, H, Lq, D) in q's memory order (as :func:`flash_attn`), or
    (out, lse).
    """
    out, lse = torch.ops.flashattn.fwd_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, _pair(window_size), softcap, sinks,
        num_splits, cache_leftpad,
    )
    return (out, lse) if return_lse else out


_CUDA_REFUSAL = None


def _refuse_cuda_tensors():
    """In a build without CUDA kernels, a call on CUDA tensors raises this instead of the dispatcher's "Could not run
    'flashattn::fwd' with arguments from the 'CUDA' backend"."""
    global _CUDA_REFUSAL

    def refuse(*args, **kwargs):
        raise RuntimeError(
            "flashattn_ext was built without CUDA kernels (FLASHATTN_BUILD_CUDA=0, no nvcc, or a torch without CUDA at "
            "build time; `pip install -v` shows the build's reason): rebuild it where the CUDA toolkit is installed"
        )

    _CUDA_REFUSAL = torch.library.Library("flashattn", "IMPL")  # noqa: TOR901 (kept for the process's life)
    for op in ("fwd", "bwd", "fwd_varlen", "bwd_varlen", "fwd_kvcache"):
        _CUDA_REFUSAL.impl(op, refuse, "CUDA")


def _grad_rows(grad: Tensor) -> Tensor:
    """A gradient with contiguous rows, as the backward ops take it (autograd's kernel does the same in C++): autograd
    may hand over an expanded one (the gradient of out.sum(), every stride 0); PyTorch's own flash backward makes it
    contiguous too."""
    return grad if grad.stride(-1) == 1 or grad.shape[-1] == 1 else grad.contiguous()


# ---- fake (meta) implementations: shapes only, for torch.compile and opcheck -----------------------------------


def _output_like(t):
    """An output in the layout of input `t`, as the kernels allocate it (csrc/api/layouts.h): torch.empty_like's strides
    where the kernels can take them (over the dimensions of more than one element: the last 1, the others multiples
    of 8), else (and for an empty tensor) contiguous. A size known only at run time (an unbacked one under
    torch.compile: a length from .item() or a boolean mask) is taken as non-empty and above one, and a stride whose
    alignment cannot be decided as unaligned, so that tracing never guards on data."""
    try:  # imported here: the fake kernels run under tracing, which has loaded it (an import at ours costs 0.3 s)
        from torch.fx.experimental.symbolic_shapes import guard_or_false as if_known_true
        from torch.fx.experimental.symbolic_shapes import guard_or_true as unless_known_false
    except ImportError:  # an older torch: plain bools (a data-dependent length then fails to trace)
        if_known_true = unless_known_false = bool
    out = torch.empty_like(t)
    last = t.dim() - 1
    if unless_known_false(t.numel() > 0) and all(
            if_known_true(s == 1 if d == last else s % 8 == 0)
            for d, (n, s) in enumerate(zip(t.shape, out.stride())) if unless_known_false(n > 1)):
        return out
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@torch.library.register_fake("flashattn::fwd")
def _fwd_fake(q, k, v, causal=False, scale=None, window_size=(-1, -1), softcap=0.0, sinks=None):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "flashattn.fwd: q, k, v must be 4-D")
    batch, heads, len_q, head_dim = q.shape
    torch._check(k.shape[0] == batch and v.shape[0] == batch, lambda: "flashattn.fwd: batch sizes differ")
    torch._check(k.shape[3] == head_dim and v.shape[3] == head_dim, lambda: "flashattn.fwd: head dims differ")
    torch._check(k.shape[1] == v.shape[1] and k.shape[2] == v.shape[2], lambda: "flashattn.fwd: k/v shapes differ")
    lse = torch.empty((batch, heads, len_q), dtype=torch.float32, device=q.device)
    return _output_like(q), lse


@torch.library.register_fake("flashattn::bwd")
def _bwd_fake(
    dout, q, k, v, out, lse, causal=False, scale=None, dlse=None, deterministic=False, window_size=(-1, -1),
    softcap=0.0, sinks=None,
):
    torch._check(dout.shape == q.shape and out.shape == q.shape, lambda: "flashattn.bwd: dout/out must match q")
    return (
        _output_like(q),
        _output_like(k),
        _output_like(v),
        torch.empty((q.shape[1] if sinks is not None else 0,), dtype=torch.float32, device=q.device),
    )


@torch.library.register_fake("flashattn::fwd_varlen")
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     scale=None, window_size=(-1, -1), softcap=0.0, sinks=None):
    torch._check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, lambda: "flashattn.fwd_varlen: q, k, v must be 3-D")
    torch._check(k.shape == v.shape, lambda: "flashattn.fwd_varlen: k and v shapes differ")
    torch._check(cu_seqlens_q.shape == cu_seqlens_k.shape, lambda: "flashattn.fwd_varlen: cu_seqlens lengths differ")
    total_q, heads, head_dim = q.shape
    out = torch.empty((total_q, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.register_fake("flashattn::bwd_varlen")
def _bwd_varlen_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     causal=False, scale=None, dlse=None, deterministic=False, window_size=(-1, -1), softcap=0.0,
                     sinks=None):
    torch._check(dout.shape == q.shape and out.shape == q.shape, lambda: "flashattn.bwd_varlen: dout/out must match q")
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
        torch.empty((q.shape[1] if sinks is not None else 0,), dtype=torch.float32, device=q.device),
    )


@torch.library.register_fake("flashattn::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False,
                      scale=None, window_size=(-1, -1), softcap=0.0, sinks=None, num_splits=0, cache_leftpad=None):
    torch._check(q.dim() == 4, lambda: "flashattn.fwd_kvcache: q must be 4-D")
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return _output_like(q), lse
