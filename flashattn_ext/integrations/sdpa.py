"""flashattn_ext as PyTorch's SDPA flash backend: ``torch.nn.attention.activate_flash_attention_impl("flashattn_ext")``.

    import flashattn_ext                       # registers the provider; nothing changes yet
    torch.nn.attention.activate_flash_attention_impl("flashattn_ext")
    # from here on, scaled_dot_product_attention calls that pick the flash backend, and varlen_attn, run our kernels
    torch.nn.attention.restore_flash_attention_impl()   # back to PyTorch's own flash kernel

Importing flashattn_ext registers the provider with ``torch.nn.attention.register_flash_attention_impl`` (where the
installed torch has it) and never activates it. Activation installs CUDA kernels for the four dispatcher ops behind the
flash backend: ``aten::_scaled_dot_product_flash_attention`` and ``aten::_flash_attention_forward`` (dense and packed,
with window sizes) and their backwards. Each returns what aten's meta functions promise (outputs and gradients in the
inputs' layouts, lse (B, H, Lq) or (H, total_q), zero rng state), so torch.compile and CUDA graphs work as with
PyTorch's kernel. A row that sees no key has lse -inf (PyTorch's kernel writes +inf there; both backwards read either
as no keys). Code that calls aten's kernels without the dispatcher (AOTInductor, Inductor's ``cpp_wrapper``) runs
PyTorch's kernel, as with any provider.

Semantics are the flash backend's: ``is_causal`` aligned bottom-right where Lq != Lk (FlashAttention's rule; SDPA
routes causal calls with Lq != Lk elsewhere), GQA where kv has fewer heads, windows as (left, right) with -1
unbounded. What our kernels lack goes to PyTorch's flash kernel, taken from the dispatcher at activation: dropout, the
debug mask, ALiBi slopes, ``seqused_k``, dtypes other than fp16/bf16, head dims that are not multiples of 8 up to 256
(or whose bucket the build left out), rows that are not 16-byte aligned, and packed backwards past D128. A build
without CUDA kernels does not register the provider. :data:`calls`
counts, per op, the calls each side ran.
"""
from __future__ import annotations

import functools
import warnings
from collections import Counter
from typing import Optional

import torch

from ..ops import _grad_rows

NAME = "flashattn_ext"

__all__ = ["NAME", "calls", "register"]

#: ``calls[(op, "flashattn_ext" | "fallback")]``: how many calls of each op each side ran since activation.
calls: Counter = Counter()

_FORWARD = "_flash_attention_forward"
_BACKWARD = "_flash_attention_backward"
_SDPA_FORWARD = "_scaled_dot_product_flash_attention"
_SDPA_BACKWARD = "_scaled_dot_product_flash_attention_backward"
_OPS = (_FORWARD, _BACKWARD, _SDPA_FORWARD, _SDPA_BACKWARD)


class _Handle:
    """What activation installed; remove() (called by restore_flash_attention_impl) uninstalls it."""

    def __init__(self, library: torch.library.Library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)


def _install() -> _Handle:
    originals = {op: torch.library.get_kernel(f"aten::{op}", "CUDA") for op in _OPS}
    calls.clear()

    def run(op, ours, unsupported):
        def kernel(keyset, *args, **kwargs):
            reason = unsupported(*args, **kwargs)
            if reason is None:
                calls[(op, NAME)] += 1
                # aten's flash ops have no autocast rule, so autocast is still on here: our ops' own rule would cast
                # the inputs to its dtype (fp16 in, bf16 out under a bf16 autocast), which aten's kernel never does.
                with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                    return ours(*args, **kwargs)
            calls[(op, "fallback")] += 1
            return originals[op].call_boxed(keyset, *args, **kwargs)
        return kernel

    library = torch.library.Library("aten", "IMPL", "CUDA")  # noqa: TOR901 (the provider hook's purpose)
    with warnings.catch_warnings():  # the user asked for the override: torch's warning about it is noise here
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        library.impl(_FORWARD, run(_FORWARD, _forward, _forward_unsupported), "CUDA", with_keyset=True)
        library.impl(_BACKWARD, run(_BACKWARD, _backward, _backward_unsupported), "CUDA", with_keyset=True)
        library.impl(_SDPA_FORWARD, run(_SDPA_FORWARD, _sdpa_forward, _sdpa_forward_unsupported), "CUDA",
                     with_keyset=True)
        library.impl(_SDPA_BACKWARD, run(_SDPA_BACKWARD, _sdpa_backward, _sdpa_backward_unsupported), "CUDA",
                     with_keyset=True)
    return _Handle(library)


@functools.lru_cache(maxsize=None)
def _cuda_head_dims() -> frozenset:
    """The head-dim buckets this build's CUDA kernels hold (none in a CPU-only build)."""
    return frozenset(torch.ops.flashattn.cuda_head_dims())


def register() -> bool:
    """Register the provider with torch (done on import); False where this torch has no provider hook or this build
    has no CUDA kernels."""
    hook = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if hook is None or not _cuda_head_dims():
        return False
    hook(NAME, register_fn=_install)
    return True


# ---- what our kernels take -----------------------------------------------------------------------------------------


def _tensors_unsupported(*tensors: torch.Tensor) -> Optional[str]:
    query = tensors[0]
    if query.dtype not in (torch.float16, torch.bfloat16):
        return "dtype"
    head_dim = query.shape[-1]
    bucket = -(-head_dim // 32) * 32  # the kernels' head-dim bucket
    if head_dim % 8 != 0 or bucket not in _cuda_head_dims() or any(t.shape[-1] != head_dim for t in tensors[1:3]):
        return "head dim"
    for t in tensors:
        if t.data_ptr() % 16 != 0 or t.stride(-1) != 1 or any(
                t.stride(d) % 8 != 0 for d in range(t.dim() - 1) if t.shape[d] > 1):
            return "alignment"
    return None


def _forward_unsupported(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                         return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                         seqused_k=None, alibi_slopes=None):
    if dropout_p > 0 or return_debug_mask or alibi_slopes is not None or seqused_k is not None:
        return "arguments"
    if (cum_seq_q is None) != (cum_seq_k is None):
        return "arguments"
    return _tensors_unsupported(query, key, value)


def _backward_unsupported(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                          is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    if dropout_p > 0:
        return "arguments"
    if cum_seq_q is not None and cum_seq_q.numel() > 0 and query.shape[-1] > 128:
        return "packed backward"
    return _tensors_unsupported(query, key, value)


def _sdpa_forward_unsupported(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                              scale=None):
    if dropout_p > 0 or return_debug_mask:
        return "arguments"
    return _tensors_unsupported(query, key, value)


def _sdpa_backward_unsupported(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                               dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p > 0:
        return "arguments"
    return _tensors_unsupported(query, key, value)


# ---- our kernels, in aten's layouts ---------------------------------------------------------------------------------


def _like(result: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """`result` in the layout of torch.empty_like(template) (what aten's meta functions promise): as it is where the
    strides agree (our ops lay outputs out so: no copy), restrided where they differ only on dimensions of one element
    (which address nothing), else copied."""
    want = torch.empty_like(template, device="meta").stride()
    if result.stride() == want:
        return result
    if all(have == need for have, need, size in zip(result.stride(), want, template.shape) if size > 1):
        return result.as_strided(template.shape, want)
    return torch.empty_like(template).copy_(result)


def _window(left, right):
    """aten's window sizes as our op takes them: PyTorch's flash kernel reads any negative size as unbounded."""
    return [-1 if x is None or x < 0 else int(x) for x in (left, right)]


def _rng_state(device):
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


def _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
             scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None):
    window = _window(window_size_left, window_size_right)
    if cum_seq_q is not None:  # packed: (total, H, D)
        out, lse = torch.ops.flashattn.fwd_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                                  scale, window)
    else:  # dense: (B, S, H, D)
        out, lse = torch.ops.flashattn.fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                           is_causal, scale, window)
        out = out.transpose(1, 2)
    seed, offset = _rng_state(query.device)
    return _like(out, query), lse, seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)


def _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
              rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    window = _window(window_size_left, window_size_right)
    deterministic = torch.are_deterministic_algorithms_enabled()
    grad_out = _grad_rows(grad_out)
    if cum_seq_q is not None and cum_seq_q.numel() > 0:
        dq, dk, dv, _ = torch.ops.flashattn.bwd_varlen(grad_out, query, key, value, out, logsumexp, cum_seq_q,
                                                       cum_seq_k, max_q, max_k, is_causal, scale, None,
                                                       deterministic, window)
    else:
        t = [x.transpose(1, 2) for x in (grad_out, query, key, value, out)]
        dq, dk, dv, _ = torch.ops.flashattn.bwd(*t, logsumexp, is_causal, scale, None, deterministic, window)
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return _like(dq, query), _like(dk, key), _like(dv, value)


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = torch.ops.flashattn.fwd(query, key, value, is_causal, scale)
    seed, offset = _rng_state(query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return _like(out, query), lse, None, None, query.shape[2], key.shape[2], seed, offset, debug_mask


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *, scale=None):
    dq, dk, dv, _ = torch.ops.flashattn.bwd(_grad_rows(grad_out), query, key, value, out, logsumexp, is_causal, scale,
                                            None, torch.are_deterministic_algorithms_enabled())
    return _like(dq, query), _like(dk, key), _like(dv, value)
