"""Hugging Face transformers integration: ``attn_implementation="fa_ext"``.

    import flashattn_ext.integrations.transformers as fa_hf
    fa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa_ext")
    # or: model.set_attn_implementation("fa_ext")

The name has no "flash" in it: transformers 5 takes every attention implementation whose name contains "flash" for a
FlashAttention package (or hub kernel) to import, and refuses the model when there is none.

register() adds :func:`attention_forward` to transformers' ``AttentionInterface`` and :func:`padding_mask` to
``AttentionMaskInterface`` (FlashAttention's: no mask without padding, else the 2-D padding mask). The attention
function takes what transformers passes, (B, H, S, D) inputs, and returns (B, S, H, D) and no weights. It handles: no
mask (the dense op, bottom-right causal, which is what generation with a KV cache needs; a static cache's keys are cut
to the valid ones that ``position_ids`` tell, on the device); padding masks (unpadded to packed sequences and padded
back; under a causal mask or a window the queries are the keys' last positions, without either, as in a decoder's
cross-attention, every query row stays and only the keys are unpadded; a static cache's keys cut to the mask's width, as
transformers' own FlashAttention path does; a left-padded batch decoding over a KV cache (on Hopper also a chunk of any
length), without gradients, reads the cache in place from each row's first real key); packed batches (``cu_seq_lens_q``
/ ``cu_seq_lens_k`` from ``DataCollatorWithFlattening``, or ``position_ids`` where a sequence starts at each row's start
and wherever a position is not the one before plus 1: read on the host once per forward; under torch.compile in a batch
of one row only); ``sliding_window``, ``softcap``, ``s_aux`` (sinks), GQA, ``scaling`` and ``is_causal``. On CUDA fp32
inputs run in the autocast dtype (else bf16) and the output comes back in the inputs' dtype. Dropout > 0 in training, a
position bias added to the scores (T5), chunked attention over more keys than a chunk and a model's own overlays on the
mask (e.g. bidirectional image tokens) raise ValueError. transformers is imported lazily.

Padded and packed batches run as packed sequences in one call. On CUDA the packed backward takes head dims above 128
only on Hopper; elsewhere a batch that needs their gradients goes through one dense call per sequence instead, which
reads the sequence lengths on the host (one synchronisation per layer).
"""
from __future__ import annotations

import os
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..ops import flash_attn, flash_attn_varlen, flash_attn_with_kvcache

NAME = "fa_ext"

__all__ = ["NAME", "attention_forward", "padding_mask", "register"]


def register() -> None:
    """Register ``"fa_ext"`` (:data:`NAME`) with transformers' attention and attention-mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[Tensor] = None, config=None, use_vmap: bool = False,
                 **kwargs) -> Optional[Tensor]:
    """transformers' FlashAttention mask (None without padding, else the 2-D padding mask), refusing the patterns
    it cannot carry, which transformers refuses only for implementations named "flash": chunked attention over more
    keys than a chunk, and a model's own overlays on the mask (bidirectional image tokens or blocks: an `or_masks`
    union, or the or_mask_function / and_mask_function that transformers builds element by element, use_vmap)."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and kv_length + kv_offset > chunk:
        raise ValueError(f"{NAME}: chunked attention (attention_chunk_size={chunk}) over {kv_length + kv_offset} keys "
                         "is not supported; use another attn_implementation")
    if use_vmap or getattr(mask_function, "__qualname__", "").startswith("or_masks."):
        raise ValueError(f"{NAME}: the model overlays its own pattern on the attention mask (e.g. bidirectional "
                         "image tokens), which is not supported; use another attn_implementation")
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                mask_function if mask_function is not None else causal_mask_function, attention_mask,
                                **kwargs)


def _window(sliding_window: Optional[int], causal: bool) -> Tuple[int, int]:
    """transformers' sliding window as (left, right): causal keeps kv > q - W (left W - 1); bidirectional
    |q - kv| <= W."""
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _target_dtype(query: Tensor) -> Optional[torch.dtype]:
    """CUDA takes fp16 / bf16: fp32 inputs (a model kept in fp32) run in the autocast dtype, else bf16."""
    if query.device.type != "cuda" or query.dtype in (torch.float16, torch.bfloat16):
        return None
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16


def _cu_seqlens(lengths: Tensor) -> Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


_readings: list = []  # the last few readings of masks or position ids on the host (see _read_once)
_KEPT_READINGS = 8  # a forward's masks (full and sliding-window layers have one each), up to two readings of each


def _read_once(source: Tensor, args: tuple, read):
    """read(source, *args), kept for the next calls with the same tensor, unchanged, read and args: the layers of one
    forward pass the same mask or position ids, so their values go to the host once per forward, not once per layer
    (not under torch.compile, which traces each call)."""
    if torch.compiler.is_compiling():
        return read(source, *args)
    for ref, version, last_read, last_args, value in _readings:
        if ref() is source and version == source._version and last_read is read and last_args == args:
            return value
    value = read(source, *args)
    _readings.insert(0, (weakref.ref(source), source._version, read, args, value))
    del _readings[_KEPT_READINGS:]
    return value


def _packed_by_positions(position_ids: Tensor, batch: int, length: int) -> Optional[Tensor]:
    """cu_seqlens (int32) over the batch's rows of `length` tokens taken one after another, where some row packs
    several sequences, as its position ids tell them (a sequence starts at each row's start and wherever a position is
    not the one before plus 1, as transformers' masks read them); None where no row does. Reads the positions on the
    host."""
    positions = position_ids.reshape(-1, length)
    if positions.shape[0] not in (1, batch):  # not one row of positions per batch row (e.g. multimodal axes)
        return None
    positions = positions.expand(batch, length)
    inner = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(inner.any()):
        return None
    starts = torch.nn.functional.pad(inner, (1, 0), value=True).reshape(-1).nonzero().view(-1)
    return torch.cat([starts, starts.new_tensor([batch * length])]).to(torch.int32)


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_DECODE_MAX_LEN_Q = 16  # the longest query of the CUDA decode path (shorter ones read a KV cache through it)


# Whether this build holds the Hopper kernels: read once here, a constant where torch.compile traces the calls below.
_BUILT_HOPPER_KERNELS = torch.ops.flashattn.cuda_hopper_kernels()


def _hopper_kernels(device: torch.device, switch: str) -> bool:
    """Whether calls on `device` may run the Hopper kernels: a Hopper GPU, a build that holds them, and the switch
    (FLASHATTN_FWD_SM90 or FLASHATTN_BWD_SM90) not "0"."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) and _BUILT_HOPPER_KERNELS
            and os.environ.get(switch) != "0")


def _reads_cache_in_place(query: Tensor, len_q: int) -> bool:
    """Whether len_q query rows over a left-padded KV cache read it in place (flash_attn_with_kvcache) rather than
    gather its real rows for the packed kernels: the decode path's few rows, and on Hopper chunks of any length (its
    TMA forward; without it the portable KV-cache kernel is slower than the gather and the packed one)."""
    return len_q <= _DECODE_MAX_LEN_Q or _hopper_kernels(query.device, "FLASHATTN_FWD_SM90")


def _packed_backward_takes(q: Tensor) -> bool:
    """Whether the CUDA packed backward takes q's head dim: up to 128 everywhere, above on Hopper's kernel only."""
    return q.shape[-1] <= 128 or _hopper_kernels(q.device, "FLASHATTN_BWD_SM90")


def _per_sequence_calls(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a packed batch runs as one dense call per sequence: on CUDA, where its backward needs what the packed
    one lacks."""
    return q.device.type == "cuda" and _needs_grad(q, k, v) and not _packed_backward_takes(q)


def _packed_call(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs) -> Tensor:
    """flash_attn_varlen on (total, H, D) tensors, or one dense call per sequence (lengths read on the host) where
    _per_sequence_calls says so."""
    if not _per_sequence_calls(q, k, v):
        return flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        rows_q, rows_k = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        if rows_q.stop == rows_q.start:
            continue
        seq = [t[rows].transpose(0, 1).unsqueeze(0) for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        out[rows_q] = flash_attn(*seq, **kwargs)[0].transpose(0, 1)
    return out


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers' attention function: query (B, H, Sq, D), key and value (B, Hk, Sk, D); returns (B, Sq, H, D)."""
    if dropout > 0.0 and module.training:
        raise ValueError(
            f"{NAME}: attention dropout ({dropout}) is not supported; set the model's attention_dropout to 0"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dtype, target = query.dtype, _target_dtype(query)
    if target is not None:
        query, key, value = query.to(target), key.to(target), value.to(target)
    out = _attention(query, key, value, attention_mask, causal, scaling, sliding_window, softcap, s_aux, **kwargs)
    return out.to(dtype), None


def _attention(query, key, value, attention_mask, causal, scaling, sliding_window, softcap, s_aux, **kwargs) -> Tensor:
    """attention_forward's work on inputs of a dtype the device takes: (B, Sq, H, D)."""
    if kwargs.get("position_bias") is not None:  # T5's relative position bias, added to the scores
        raise ValueError(f"{NAME}: a position bias added to the scores is not supported; use another "
                         "attn_implementation")
    options = dict(
        causal=bool(causal),
        scale=scaling,
        window_size=_window(sliding_window, bool(causal)),
        softcap=float(softcap) if softcap else 0.0,
        sinks=s_aux.float() if s_aux is not None else None,
    )
    batch, heads, len_q, head_dim = query.shape
    heads_kv, len_k = key.shape[1], key.shape[2]

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    # Packed rows (without a KV cache); under torch.compile in a batch of one row only, as before rows were read
    # (the reading is a data-dependent branch, which a compiled batch of several rows would have to break on).
    if (cu_q is None and attention_mask is None and position_ids is not None and 1 < len_q == len_k
            and (batch == 1 or not torch.compiler.is_compiling())):
        cu_q = cu_k = _read_once(position_ids, (batch, len_q), _packed_by_positions)
    if cu_q is not None:  # packed sequences in the rows taken one after another: (B * S, H, D)
        cu_k = cu_q if cu_k is None else cu_k
        rows = [t.transpose(1, 2).reshape(-1, t.shape[1], head_dim) for t in (query, key, value)]
        out = _packed_call(*rows, cu_q.to(torch.int32), cu_k.to(torch.int32), kwargs.get("max_length_q"),
                           kwargs.get("max_length_k"), **options)
        return out.reshape(batch, len_q, heads, head_dim)

    if attention_mask is None:
        if causal and len_k > len_q and position_ids is not None:
            # A KV cache; a static one holds slots not written yet past the valid keys, whose count the last query's
            # position tells (the dense op would see them). Read on the device, or on the host for a backward.
            last = position_ids.reshape(-1, position_ids.shape[-1])[:, -1]
            valid = (last + 1).clamp(max=len_k).to(torch.int32).expand(batch).contiguous()
            if not _needs_grad(query, key, value, options["sinks"]):
                return flash_attn_with_kvcache(query, key, value, cache_seqlens=valid, **options).transpose(1, 2)
            len_k = int(valid.max())
            key, value = key[:, :, :len_k], value[:, :, :len_k]
        # the dense op; with a KV cache the queries are the last rows (bottom-right)
        return flash_attn(query, key, value, **options).transpose(1, 2)

    # A 2-D padding mask (B, Sk) of the keys; under a causal mask (or a window) the queries are its last Sq positions.
    # Unpad, attend, pad back.
    if attention_mask.dim() != 2:
        raise ValueError(f"{NAME}: expected a 2-D padding mask (register() installs its mask function), got "
                         f"shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[1] < len_k:  # a static cache: the slots past the mask's width are not written yet
        len_k = attention_mask.shape[1]
        key, value = key[:, :, :len_k], value[:, :, :len_k]
    # Without a causal mask or a window no query depends on its position: every query row stays (a cross-attention's
    # queries are not the keys' positions), and only the keys are unpadded.
    all_queries = not causal and options["window_size"] == (-1, -1)
    if not causal and not all_queries and len_q != len_k:
        raise ValueError(f"{NAME}: a bidirectional sliding window over a padding mask needs as many queries as keys "
                         f"(self-attention), got {len_q} and {len_k}")
    if len_k > len_q and _reads_cache_in_place(query, len_q) and not _needs_grad(query, key, value, options["sinks"]):
        # Decoding (or a chunk) over a KV cache of left-padded sequences (batched generation): read in place from each
        # entry's first real key.
        leftpad = _read_once(attention_mask, (len_q, len_k), _left_padding)
        if leftpad is not None:
            return flash_attn_with_kvcache(query, key, value, cache_leftpad=leftpad, **options).transpose(1, 2)
    (rows_q, index_q, cu_q), (rows_k, _, cu_k) = _read_once(attention_mask, (len_q, len_k, all_queries), _unpadding)
    # The real rows only, gathered straight from the (B, H, S, D) views: one copy of them, not of the whole cache.
    q = query.transpose(1, 2)[rows_q]
    k, v = key.transpose(1, 2)[rows_k], value.transpose(1, 2)[rows_k]
    packed = _packed_call(q, k, v, cu_q, cu_k, None, None, **options)
    out = packed.new_zeros(batch * len_q, heads, head_dim).index_copy(0, index_q, packed)
    return out.view(batch, len_q, heads, head_dim)


def _left_padding(attention_mask: Tensor, len_q: int, len_k: int) -> Optional[Tensor]:
    """Where each row of the key mask (its last len_k positions) is padding, then real keys only, the queries (the last
    len_q positions) among them: the padding's length per row (int32, on the mask's device); else None. Reads the mask
    on the host (one synchronisation)."""
    mask_k = attention_mask[:, -len_k:].bool()
    real = mask_k.sum(1)
    first = len_k - real
    positions = torch.arange(len_k, device=mask_k.device)
    left_padded = (mask_k == (positions[None, :] >= first[:, None])).all() & (real >= len_q).all()
    return first.to(torch.int32) if bool(left_padded) else None


def _unpadding(attention_mask: Tensor, len_q: int, len_k: int, all_queries: bool = False):
    """For the queries (the last len_q positions, or every query row with `all_queries`) and the keys (the last len_k)
    of a padding mask: the real rows as (batch, position) index tensors, their index in the flattened (B, S), and
    cu_seqlens. Reads the mask on the host (one synchronisation; two with a KV cache)."""
    mask_k = attention_mask[:, -len_k:].bool()
    mask_q = mask_k.new_ones(mask_k.shape[0], len_q) if all_queries else mask_k[:, -len_q:]
    index_k = mask_k.reshape(-1).nonzero().view(-1)
    index_q = index_k if len_q == len_k and not all_queries else mask_q.reshape(-1).nonzero().view(-1)
    return tuple(((index // length, index % length), index, _cu_seqlens(mask.sum(1)))
                 for index, length, mask in ((index_q, len_q, mask_q), (index_k, len_k, mask_k)))
