"""Ring attention (flashattn_ext.distributed) on CPU with gloo: world 1, 2 and 3 processes, contiguous and zigzag
layouts, causal and not, GQA, softcap, windows, sinks, autocast. Each rank's output and q / k / v gradients must match its rows of one
process's flash_attn over the whole sequence (float64, on the same inputs)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashattn_ext
from flashattn_ext.distributed import ring_flash_attn, zigzag_shard, zigzag_unshard
from flashattn_ext.ops import _output_like

CASES = [  # (layout, causal, heads, heads_kv, window, softcap, sinks)
    ("contiguous", False, 2, 2, (-1, -1), 0.0, False),
    ("contiguous", True, 4, 2, (-1, -1), 0.0, False),
    ("zigzag", True, 2, 2, (-1, -1), 0.0, False),
    ("zigzag", False, 4, 1, (-1, -1), 0.0, False),
    ("zigzag", True, 4, 2, (-1, -1), 3.0, True),
    ("zigzag", True, 2, 2, (7, -1), 0.0, False),  # a causal window reaching back past one chunk
    ("contiguous", False, 2, 2, (5, 13), 0.0, True),  # two-sided, crossing chunk boundaries both ways
    ("zigzag", False, 2, 1, (2, 0), 1.5, False),  # a window narrower than a chunk
    ("contiguous", False, 2, 2, (11, 11), 0.0, False),  # one key into each neighbouring chunk (12 rows)
    ("zigzag", True, 2, 2, (5, -1), 0.0, False),  # one key into the chunk before (6 rows)
]


def shard(x, layout, rank, world):
    return x.chunk(world, dim=2)[rank] if layout == "contiguous" else zigzag_shard(x, 2, rank, world)


def run_rank(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case, (layout, causal, heads, heads_kv, window, softcap, with_sinks) in enumerate(CASES):
            torch.manual_seed(0)  # the same whole tensors on every rank
            length, dim = 12 * world, 8
            q = torch.randn(2, heads, length, dim, dtype=torch.float64)
            k = torch.randn(2, heads_kv, length, dim, dtype=torch.float64)
            v = torch.randn(2, heads_kv, length, dim, dtype=torch.float64)
            dout = torch.randn(2, heads, length, dim, dtype=torch.float64)
            sinks = torch.linspace(-1.0, 1.0, heads, dtype=torch.float32) if with_sinks else None
            mods = dict(causal=causal, window_size=window, softcap=softcap)
            # One process over the whole sequence.
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = flashattn_ext.flash_attn(*whole, **mods, sinks=sinks)
            ref_grads = torch.autograd.grad(ref, whole, dout)
            # This rank's shard through the ring.
            local = [shard(t, layout, rank, world).detach() for t in (q, k, v)]
            if case % 2:  # sequence-major shards ((B, L, H, D) memory), as a model's projections give them
                local = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in local]
            local = [t.requires_grad_() for t in local]
            ring_sinks = sinks.clone().requires_grad_() if with_sinks else None
            out = ring_flash_attn(*local, layout=layout, **mods, sinks=ring_sinks)
            grads = torch.autograd.grad(out, local, shard(dout, layout, rank, world))
            what = f"{layout} {mods} H={heads} Hk={heads_kv} sinks={with_sinks} rank {rank}/{world}"
            # out and the gradients in their inputs' memory order, as flash_attn's
            assert out.stride() == _output_like(local[0]).stride(), what
            for g, t in zip(grads, local):
                assert g.stride() == _output_like(t).stride(), what
            # The partial results merge through lse, which is float32 by the op's contract: float32-sized tolerances
            # (a wrong block rule or a lost shard is off by O(1)).
            torch.testing.assert_close(out, shard(ref, layout, rank, world), atol=2e-6, rtol=2e-6,
                                       msg=lambda m: f"out, {what}: {m}")
            for name, g, r in zip("qkv", grads, ref_grads):
                torch.testing.assert_close(g, shard(r, layout, rank, world), atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"d{name}, {what}: {m}")
            if with_sinks:  # each rank's share, summed over the ring, is the whole gradient
                whole_sinks = sinks.clone().requires_grad_()
                ref_out = flashattn_ext.flash_attn(*[t.detach() for t in (q, k, v)], **mods, sinks=whole_sinks)
                (ref_dsinks,) = torch.autograd.grad(ref_out, whole_sinks, dout)
                out = ring_flash_attn(*local, layout=layout, **mods, sinks=ring_sinks)
                (dsinks,) = torch.autograd.grad(out, ring_sinks, shard(dout, layout, rank, world))
                dist.all_reduce(dsinks)
                torch.testing.assert_close(dsinks, ref_dsinks, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"dsinks, {what}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_matches_one_process(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(world, os.path.join(tmp, "init")), nprocs=world, join=True)


def run_autocast_rank(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        length = 12 * world
        # fp32 q and k (after a QK-norm) next to a bf16 v, as flash_attn takes them under autocast.
        q, k = (torch.randn(1, 2, length, 8) for _ in range(2))
        v = torch.randn(1, 2, length, 8).bfloat16()
        dout = torch.randn(1, 2, length, 8).bfloat16()
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        local = [shard(t, "contiguous", rank, world).detach().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = flashattn_ext.flash_attn(*whole, causal=True)
            out = ring_flash_attn(*local, causal=True)
        assert out.dtype == ref.dtype == torch.bfloat16
        ref_grads = torch.autograd.grad(ref, whole, dout)
        grads = torch.autograd.grad(out, local, shard(dout, "contiguous", rank, world))
        torch.testing.assert_close(out, shard(ref, "contiguous", rank, world), atol=2e-2, rtol=2e-2)
        for g, r, t in zip(grads, ref_grads, local):
            assert g.dtype == t.dtype  # each input's gradient in its own dtype
            torch.testing.assert_close(g.float(), shard(r, "contiguous", rank, world).float(), atol=5e-2, rtol=5e-2)
    finally:
        dist.destroy_process_group()


def test_ring_under_autocast():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_autocast_rank, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


def test_zigzag_roundtrip():
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)
    parts = [zigzag_shard(x, 2, r, 3) for r in range(3)]
    assert parts[0].tolist() == torch.cat([x[..., 0:4], x[..., 20:24]], -1).tolist()
    assert torch.equal(zigzag_unshard(parts, 2, 3), x)


def test_bad_arguments():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_flash_attn(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="window_size must be"):
        ring_flash_attn(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="multiple of 2 \\* world"):
        zigzag_shard(torch.randn(1, 1, 10, 8), 2, 0, 3)


def test_bench_ring_runs_under_torchrun(tmp_path):
    # The benchmark's CPU variant (gloo), tiny: it runs, every rank reports, rank 0 compares with one process.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ring.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), "--length", "64",
           "--heads", "2", "--dim", "16", "--iters", "1", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 1/2: fwd+bwd" in result.stdout and "speedup" in result.stdout
