"""Context parallelism: ring attention over torch.distributed (NCCL on GPUs, gloo on CPU).

Each rank of a process group holds a shard of one long sequence (the same batch and heads on every rank): q
(B, H, L_local, D), k and v (B, Hk, L_local, D). Key/value shards travel around the ring (rank r sends to r + 1 and
receives from r - 1), each rank attends its queries to every shard as it passes with our op, and the partial results
are merged in float32 through their lse. The backward sends the shards around again, each with the dK / dV it has
gathered so far, and one last hop brings every rank the gradients of its own keys and values. The next shard's
transfer is issued before the current one is computed (batch_isend_irecv), so communication overlaps the attention.

Layouts (``layout=``): "contiguous", rank r holds chunk r of W equal chunks of the sequence; "zigzag", rank r holds
chunks r and 2W - 1 - r of 2W equal chunks (:func:`zigzag_shard`), which gives every rank the same causal work.
Causal blocks follow the chunks' global order: a query chunk sees earlier key chunks whole, its own one causally, later
ones not at all (skipped).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .ops import flash_attn_with_lse

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


def _block_rule(q_chunk: int, k_chunk: int, causal: bool) -> Optional[bool]:
    """How query chunk q_chunk sees key chunk k_chunk: None (not at all), False (whole) or True (causally)."""
    if not causal or k_chunk < q_chunk:
        return False
    return True if k_chunk == q_chunk else None


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, softcap, group, layout):
        ring = _Ring(group)
        pieces = _pieces(layout, ring.rank, ring.world, q.shape[2])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(ring.world):
            source = (ring.rank - step) % ring.world
            pending = None
            if step + 1 < ring.world:
                incoming, pending = ring.start(kv)
            for q_chunk, q_rows in pieces:
                for k_chunk, k_rows in _pieces(layout, source, ring.world, k.shape[2]):
                    rule = _block_rule(q_chunk, k_chunk, causal)
                    if rule is None:
                        continue
                    part_out, part_lse = flash_attn_with_lse(
                        q[:, :, q_rows], kv[0][:, :, k_rows], kv[1][:, :, k_rows], rule, scale, softcap=softcap
                    )
                    out[:, :, q_rows], lse[:, :, q_rows] = _merge(out[:, :, q_rows], lse[:, :, q_rows], part_out,
                                                                  part_lse)
            if pending is not None:
                ring.finish(pending)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (causal, scale, softcap, group, layout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, softcap, group, layout = ctx.options
        ring = _Ring(group)
        dout = dout.contiguous()
        pieces = _pieces(layout, ring.rank, ring.world, q.shape[2])
        deterministic = torch.are_deterministic_algorithms_enabled()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # The shard in hand and the dK / dV gathered for it so far travel together.
        travelling = [k, v, torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                      torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(ring.world):
            source = (ring.rank - step) % ring.world
            k_blk, v_blk, dk_acc, dv_acc = travelling
            for q_chunk, q_rows in pieces:
                for k_chunk, k_rows in _pieces(layout, source, ring.world, k.shape[2]):
                    rule = _block_rule(q_chunk, k_chunk, causal)
                    if rule is None:
                        continue
                    # With the merged out and lse, each block's backward is its share of the whole one.
                    dq_part, dk_part, dv_part, _ = torch.ops.flashattn.bwd(
                        dout[:, :, q_rows], q[:, :, q_rows], k_blk[:, :, k_rows], v_blk[:, :, k_rows],
                        out[:, :, q_rows], lse[:, :, q_rows], rule, scale, None, deterministic, [-1, -1], softcap,
                    )
                    dq[:, :, q_rows] += dq_part
                    dk_acc[:, :, k_rows] += dk_part
                    dv_acc[:, :, k_rows] += dv_part
            # Pass the shard on with its gradients; after the last step only the gradients go home (one more hop).
            send = travelling if step + 1 < ring.world else [dk_acc, dv_acc]
            received, pending = ring.start(send)
            ring.finish(pending)
            travelling = received if step + 1 < ring.world else None
            if travelling is None:
                dk, dv = received
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_flash_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    group=None,
    layout: str = "contiguous",
    softcap: float = 0.0,
) -> Tensor:
    """Attention over a sequence sharded across the ranks of `group` (the default group when None).

    Args:
        q: (B, H, L_local, D) this rank's queries; k, v: (B, Hk, L_local, D) its keys and values (GQA: Hk | H). Every
            rank passes the same B, heads, D and L_local.
        causal: causal over the whole sequence (positions in the layout's global order).
        scale, softcap: as in :func:`flashattn_ext.flash_attn`.
        layout: "contiguous" (rank r holds chunk r of W) or "zigzag" (chunks r and 2W - 1 - r of 2W; L_local even).

    Differentiable in q, k and v: each rank gets the gradients of its own shard. Returns this rank's output rows
    (B, H, L_local, D) in q's dtype.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ring_flash_attn: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and q.shape[2] % 2 != 0:
        raise ValueError(f"ring_flash_attn: the zigzag layout needs an even L_local, got {q.shape[2]}")
    if q.shape[2] != k.shape[2] or k.shape != v.shape:
        raise ValueError(f"ring_flash_attn: q, k and v must hold the same positions, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    return _RingAttention.apply(q, k, v, causal, scale, softcap, group, layout)
