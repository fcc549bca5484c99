"""Ring attention's speed: forward + backward of ring_flash_attn across the ranks against one device doing the whole
sequence. Run under torchrun (NCCL on GPUs, one per rank; gloo on CPU):

    torchrun --nproc_per_node 2 benchmarks/bench_ring.py                       # B1 H16 L128k D128 causal zigzag, bf16
    torchrun --nproc_per_node 2 benchmarks/bench_ring.py --length 4096 --layout contiguous --no-causal

Every rank prints its median time per step; rank 0 then times flash_attn over the whole sequence on its own device (the
same global work on one device) and prints the speedup (one device's time over the ring's slowest rank) and the
efficiency (speedup / world size). FLOPs count the causal half when causal.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's build when not installed

import flashattn_ext  # noqa: E402
from flashattn_ext.distributed import ring_flash_attn, zigzag_shard  # noqa: E402


def median_seconds(fn, device, iters: int, align=None) -> float:
    """Median wall time of fn() over iters calls after one warm-up (synchronising the device around each; `align`,
    if given, before each start: the ranks' barrier, so that no rank's time includes waiting for a late one)."""
    fn()
    times = []
    for _ in range(iters):
        if align is not None:
            align()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fwd_bwd(attention, q, k, v, dout):
    def step():
        out = attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=131072, help="global sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=None, help="kv heads (GQA); default: --heads")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-single", dest="single", action="store_false",
                        help="skip rank 0's one-device run of the whole sequence")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA (NCCL) where every local rank has a GPU of its own, else CPU (gloo)")
    args = parser.parse_args()

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= local_world)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads_kv = args.heads_kv or args.heads
    shape_q = (args.batch, args.heads, args.length, args.dim)
    shape_kv = (args.batch, heads_kv, args.length, args.dim)

    def shard(x):
        return x.chunk(world, dim=2)[rank] if args.layout == "contiguous" else zigzag_shard(x, 2, rank, world)

    torch.manual_seed(0)
    whole = [torch.randn(s, dtype=dtype) for s in (shape_q, shape_kv, shape_kv, shape_q)]
    q, k, v, dout = (shard(t).to(device) for t in whole)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ring = fwd_bwd(lambda q, k, v: ring_flash_attn(q, k, v, causal=args.causal, layout=args.layout), q, k, v, dout)
    seconds = median_seconds(ring, device, args.iters, align=dist.barrier)
    flops = 3.5 * 4.0 * args.batch * args.heads * args.length ** 2 * args.dim * (0.5 if args.causal else 1.0)
    times = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(times, torch.tensor([seconds], device=device))
    print(f"rank {rank}/{world}: fwd+bwd {seconds * 1e3:.2f} ms per step (L_local {q.shape[2]}, {args.layout})",
          flush=True)
    dist.barrier()
    if rank == 0:
        slowest = max(t.item() for t in times)
        print(f"ring: {slowest * 1e3:.2f} ms (slowest rank), {flops / slowest / 1e12:.3g} TFLOP/s over {world} ranks")
        if args.single:
            full = [t.to(device) for t in whole]
            fq, fk, fv = (t.requires_grad_() for t in full[:3])
            one = median_seconds(
                fwd_bwd(lambda q, k, v: flashattn_ext.flash_attn(q, k, v, causal=args.causal), fq, fk, fv, full[3]),
                device, args.iters)
            speedup = one / slowest
            print(f"one device: {one * 1e3:.2f} ms, {flops / one / 1e12:.3g} TFLOP/s; speedup {speedup:.2f}x, "
                  f"efficiency {speedup / world:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
