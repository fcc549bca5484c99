"""Context parallelism: ring attention over torch.distributed (NCCL on GPUs, gloo on CPU).

Each rank of a process group holds a shard of one long sequence (the same batch and heads on every rank): q
(B, H, L_local, D), k and v (B, Hk, L_local, D). Key/value shards travel around the ring (rank r sends to r + 1 and
receives from r - 1), each rank attends its queries to every shard as it passes with our op, and the partial results
are merged in float32 through their lse. The backward sends the shards around again, the dK / dV each has gathered
(float32) one step behind it, and one last hop brings every rank the gradients of its own keys and values. Every
transfer is issued a step before its data is needed (batch_isend_irecv), so communication overlaps the attention; only
the backward's last hop does not.

Layouts (``layout=``): "contiguous", rank r holds chunk r of W equal chunks of the sequence; "zigzag", rank r holds
chunks r and 2W - 1 - r of 2W equal chunks (:func:`zigzag_shard`), which gives every rank the same causal work.
Causal and windowed blocks follow the chunks' global order: a (query chunk, key chunk) pair runs only where some query
sees some key, on the rows and keys that do, with the band moved into the block's coordinates (:func:`_block`); so a
query chunk sees earlier key chunks whole, its own one causally, and later ones not at all.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .ops import _grad_rows, _output_like, flash_attn_with_lse

__all__ = ["ring_flash_attn", "zigzag_shard", "zigzag_unshard"]

LAYOUTS = ("contiguous", "zigzag")


def zigzag_shard(x: Tensor, dim: int, rank: int, world: int) -> Tensor:
    """Rank `rank`'s zigzag part of the whole tensor `x`: chunks rank and 2 * world - 1 - rank of 2 * world equal
    chunks along `dim`, concatenated (a copy)."""
    if x.shape[dim] % (2 * world) != 0:
        raise ValueError(f"zigzag_shard: the length along dim {dim} ({x.shape[dim]}) must be a multiple of "
                         f"2 * world = {2 * world}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(chunks: Sequence[Tensor], dim: int, world: int) -> Tensor:
    """The whole tensor from every rank's zigzag part (`chunks`, in rank order): the inverse of :func:`zigzag_shard`."""
    if len(chunks) != world:
        raise ValueError(f"zigzag_unshard: expected {world} parts (one per rank), got {len(chunks)}")
    halves = [part.chunk(2, dim=dim) for part in chunks]
    ordered = [halves[c][0] for c in range(world)] + [halves[2 * world - 1 - c][1] for c in range(world, 2 * world)]
    return torch.cat(ordered, dim=dim)


def _pieces(layout: str, rank: int, world: int, length: int) -> List[Tuple[int, slice]]:
    """(global chunk index, slice of the local tensor) of each piece a rank holds."""
    if layout == "contiguous":
        return [(rank, slice(0, length))]
    half = length // 2
    return [(rank, slice(0, half)), (2 * world - 1 - rank, slice(half, length))]


def _block(q_chunk: int, k_chunk: int, n: int, left: int, right: int) -> Optional[Tuple[slice, slice, List[int]]]:
    """The op call of query chunk q_chunk against key chunk k_chunk (both n long) under the global band (left, right)
    (-1: unbounded; causal is right = 0): (query rows, key rows, window) inside the chunks, or None where no query
    sees a key. Query i sees key j of the block iff i + g <= j <= i + h with g = d - left, h = d + right and d the
    chunks' distance; where g > 0 (or h < 0) the rows and keys outside are cut off, so the op's band (with L_q == L_k,
    bottom-right = top-left) expresses the rest."""
    d = (q_chunk - k_chunk) * n
    g = None if left < 0 else d - left
    h = None if right < 0 else d + right
    q_start = k_start = 0
    size = n
    if g is not None and g > 0:  # keys from i + g: queries [0, n - g), keys [g, n)
        k_start, size = g, n - g
        h, g = (None if h is None else h - g), 0
    elif h is not None and h < 0:  # keys up to i + h: queries [-h, n), keys [0, n + h)
        q_start, size = -h, n + h
        g, h = (None if g is None else g - h), 0
    if size <= 0:
        return None
    return slice(q_start, q_start + size), slice(k_start, k_start + size), [-1 if g is None else -g,
                                                                            -1 if h is None else h]


def _sub(rows: slice, part: slice) -> slice:
    """Rows `part` of the piece at `rows` of the local tensor."""
    return slice(rows.start + part.start, rows.start + part.stop)


def _block_calls(layout: str, rank: int, source: int, world: int, length: int, left: int, right: int):
    """The op calls of this rank's queries against `source`'s shard: (query rows, key rows, window, whether the key
    chunk is the query chunk itself), rows of the local tensors (both `length` long)."""
    for q_chunk, q_rows in _pieces(layout, rank, world, length):
        for k_chunk, k_rows in _pieces(layout, source, world, length):
            block = _block(q_chunk, k_chunk, q_rows.stop - q_rows.start, left, right)
            if block is not None:
                yield _sub(q_rows, block[0]), _sub(k_rows, block[1]), block[2], q_chunk == k_chunk


def _merge(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> Tuple[Tensor, Tensor]:
    """Two partial softmax results over disjoint keys, merged in float32 through their lse (rows that saw no key on
    either side keep out 0 and lse -inf)."""
    new_lse = torch.logaddexp(lse, part_lse)
    finite = new_lse != float("-inf")
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse)).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(part_lse - safe), torch.zeros_like(part_lse)).unsqueeze(-1)
    return out * w_old + part_out.float() * w_new, new_lse


class _Ring:
    """The ring's neighbours in `group` and a double-buffered exchange of a list of tensors."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None else (
            (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None else (
            (self.rank - 1) % self.world)

    def start(self, tensors: List[Tensor]) -> Tuple[List[Tensor], tuple]:
        """Send `tensors` to the next rank and receive the previous rank's into fresh buffers; returns the buffers
        and what finish() waits for (the requests, and the sent tensors, kept alive until then)."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, (dist.batch_isend_irecv(ops), sent)

    @staticmethod
    def finish(pending) -> None:
        for request in pending[0]:
            request.wait()

    @staticmethod
    def drain(*pending) -> None:
        """Waits for the exchanges in flight when a step raised: every rank posted them, so they complete, and the
        group stays in step for the next call (an exchange left unwaited would pair with the next call's)."""
        for each in pending:
            if each is not None:
                _Ring.finish(each)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window_size, softcap, sinks, group, layout):
        ring = _Ring(group)
        left, right = window_size[0], 0 if causal else window_size[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(ring.world):
            source = (ring.rank - step) % ring.world
            pending = None
            if step + 1 < ring.world:
                incoming, pending = ring.start(kv)
            try:
                for rows, keys, window, own_chunk in _block_calls(layout, ring.rank, source, ring.world, q.shape[2],
                                                                  left, right):
                    # The sinks join each row's denominator once: in its own chunk's block (never cut).
                    part_out, part_lse = flash_attn_with_lse(
                        q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], False, scale, window, softcap,
                        sinks if own_chunk else None,
                    )
                    out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
            except BaseException:
                ring.drain(pending)
                raise
            if pending is not None:
                ring.finish(pending)
                kv = incoming
        out = _output_like(q).copy_(out)  # in q's dtype and memory order, as flash_attn's
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.options = (left, right, scale, softcap, group, layout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        left, right, scale, softcap, group, layout = ctx.options
        ring = _Ring(group)
        dout = _grad_rows(dout)
        deterministic = torch.are_deterministic_algorithms_enabled()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dsinks = torch.zeros(sinks.shape, dtype=torch.float32, device=q.device) if sinks is not None else None
        # The shards travel as in the forward, each sent on before the step that holds it computes. The dK / dV a
        # shard has gathered follow one step behind: sent on once this rank has added its part, they reach the next
        # rank while it computes its next step, which then adds its own part; after the last step they go home.
        kv = [k, v]
        arriving = None  # the dK / dV the previous rank gathered for the shard in hand, on their way
        for step in range(ring.world):
            source = (ring.rank - step) % ring.world
            kv_pending = None
            if step + 1 < ring.world:
                incoming, kv_pending = ring.start(kv)
            dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            try:
                for rows, keys, window, own_chunk in _block_calls(layout, ring.rank, source, ring.world, q.shape[2],
                                                                  left, right):
                    block_sinks = sinks if own_chunk else None
                    # With the merged out and lse, each block's backward is its share of the whole one.
                    dq_part, dk_part, dv_part, dsinks_part = torch.ops.flashattn.bwd(
                        dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out[:, :, rows],
                        lse[:, :, rows], False, scale, None, deterministic, window, softcap, block_sinks,
                    )
                    dq[:, :, rows] += dq_part
                    dk_acc[:, :, keys] += dk_part
                    dv_acc[:, :, keys] += dv_part
                    if block_sinks is not None:
                        dsinks += dsinks_part
            except BaseException:
                ring.drain(kv_pending, arriving[1] if arriving is not None else None)
                raise
            if arriving is not None:  # the earlier ranks' parts, added after this rank's (a fixed order)
                (dk_in, dv_in), acc_pending = arriving
                ring.finish(acc_pending)
                dk_acc += dk_in
                dv_acc += dv_in
            arriving = ring.start([dk_acc, dv_acc]) if ring.world > 1 else None
            if kv_pending is not None:
                ring.finish(kv_pending)
                kv = incoming
        if arriving is None:  # one rank: its own shard's gradients are in hand
            dk, dv = dk_acc, dv_acc
        else:  # the last hop brought this rank its own shard's
            (dk, dv), acc_pending = arriving
            ring.finish(acc_pending)
        dsinks = dsinks.to(sinks.dtype) if sinks is not None else None
        dq, dk, dv = (_output_like(x).copy_(grad) for x, grad in ((q, dq), (k, dk), (v, dv)))
        return dq, dk, dv, None, None, None, None, dsinks, None, None


def ring_flash_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    group=None,
    layout: str = "contiguous",
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention over a sequence sharded across the ranks of `group` (the default group when None).

    Args:
        q: (B, H, L_local, D) this rank's queries; k, v: (B, Hk, L_local, D) its keys and values (GQA: Hk | H). Every
            rank passes the same B, heads, D, L_local and dtype (not checked across ranks: a mismatch fails or hangs
            in the exchange, as a collective's would). k and v travel as contiguous copies.
        causal: causal over the whole sequence (positions in the layout's global order).
        scale, window_size, softcap, sinks: as in :func:`flashattn_ext.flash_attn`, over the whole sequence (the
            window in global positions).
        layout: "contiguous" (rank r holds chunk r of W) or "zigzag" (chunks r and 2W - 1 - r of 2W; L_local even).

    Differentiable in q, k, v and sinks: each rank gets the gradients of its own shard, and its share of the sinks'
    gradient (summed over the ranks as for any replicated parameter, e.g. by DDP). Outputs and gradients are summed in
    float32 over parts that each come in q's dtype: in bf16 dK and dV carry 1.2-1.4x one process's error (world 4).
    An error in a step (a bad argument is refused before any exchange) leaves the group ready for the next call.
    Returns this rank's output rows (B, H, L_local, D) in q's dtype (under autocast, q, k and v are first cast to its
    dtype, as by flash_attn).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ring_flash_attn: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and q.shape[2] % 2 != 0:
        raise ValueError(f"ring_flash_attn: the zigzag layout needs an even L_local, got {q.shape[2]}")
    if q.shape[2] != k.shape[2] or k.shape != v.shape:
        raise ValueError(f"ring_flash_attn: q, k and v must hold the same positions, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if len(window_size) != 2 or min(window_size) < -1:
        raise ValueError(f"ring_flash_attn: window_size must be (left, right) with entries >= -1, got {window_size}")
    if torch.is_autocast_enabled(q.device.type):  # as flash_attn: q, k, v in the autocast dtype (float64 left alone)
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v))
    # The op's own checks (dtypes, heads, head dim, scale, softcap, sinks) on no rows, before any exchange starts.
    with torch.no_grad():
        empty = [t[:, :, :0] for t in (q, k, v)]
        torch.ops.flashattn.fwd(*empty, False, scale, [-1, -1], softcap, sinks)
    return _RingAttention.apply(q, k, v, causal, scale, tuple(window_size), softcap, sinks, group, layout)
