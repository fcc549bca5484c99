"""Ring attention (flashattn_ext.distributed) on CPU with gloo: world 1, 2 and 3 processes and rings in subgroups,
contiguous and zigzag layouts, causal and not, GQA, softcap, windows, sinks, autocast, errors inside a step. Each
rank's output and q / k / v gradients must match its rows of one process's flash_attn over the whole sequence
(float64, on the same inputs)."""
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashattn_ext
from flashattn_ext import distributed
from flashattn_ext.distributed import ring_flash_attn, zigzag_shard, zigzag_unshard
from flashattn_ext.ops import _output_like

CASES = [  # (layout, causal, heads, heads_kv, window, softcap, sinks, scale)
    ("contiguous", False, 2, 2, (-1, -1), 0.0, False, None),
    ("contiguous", True, 4, 2, (-1, -1), 0.0, False, None),
    ("zigzag", True, 2, 2, (-1, -1), 0.0, False, 0.3),
    ("zigzag", False, 4, 1, (-1, -1), 0.0, False, None),
    ("zigzag", True, 4, 2, (-1, -1), 3.0, True, None),
    ("zigzag", True, 2, 2, (7, -1), 0.0, False, None),  # a causal window reaching back past one chunk
    ("contiguous", False, 2, 2, (5, 13), 0.0, True, None),  # two-sided, crossing chunk boundaries both ways
    ("zigzag", False, 2, 1, (2, 0), 1.5, False, -0.5),  # a window narrower than a chunk
    ("contiguous", False, 2, 2, (11, 11), 0.0, False, None),  # one key into each neighbouring chunk (12 rows)
    ("zigzag", True, 2, 2, (5, -1), 0.0, False, None),  # one key into the chunk before (6 rows)
]


def shard(x, layout, rank, world):
    return x.chunk(world, dim=2)[rank] if layout == "contiguous" else zigzag_shard(x, 2, rank, world)


def run_rank(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case, (layout, causal, heads, heads_kv, window, softcap, with_sinks, scale) in enumerate(CASES):
            torch.manual_seed(0)  # the same whole tensors on every rank
            length, dim = 12 * world, 8
            q = torch.randn(2, heads, length, dim, dtype=torch.float64)
            k = torch.randn(2, heads_kv, length, dim, dtype=torch.float64)
            v = torch.randn(2, heads_kv, length, dim, dtype=torch.float64)
            dout = torch.randn(2, heads, length, dim, dtype=torch.float64)
            sinks = torch.linspace(-1.0, 1.0, heads, dtype=torch.float32) if with_sinks else None
            mods = dict(causal=causal, window_size=window, softcap=softcap, scale=scale)
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


def whole_and_local(rank, world, layout="contiguous", dtype=torch.float64):
    """The same whole q, k, v, dout on every rank, and this rank's shards (autograd leaves)."""
    torch.manual_seed(0)
    whole = [torch.randn(1, 2, 12 * world, 8, dtype=dtype) for _ in range(4)]
    local = [shard(t, layout, rank, world).detach().requires_grad_() for t in whole[:3]]
    return whole, local, shard(whole[3], layout, rank, world)


def assert_matches_whole(whole, local, dout, rank, world, group=None):
    out = ring_flash_attn(*local, causal=True, group=group)
    grads = torch.autograd.grad(out, local, dout)
    leaves = [t.clone().requires_grad_() for t in whole[:3]]
    ref = flashattn_ext.flash_attn(*leaves, causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, whole[3])
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got, shard(want, "contiguous", rank, world), atol=1e-5, rtol=1e-5)


def run_recovery_rank(rank, world, init_file):
    # A timeout, so that a group left out of step fails the test instead of hanging it.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        whole, local, dout = whole_and_local(rank, world)
        with pytest.raises(RuntimeError, match="softcap must be"):  # the op's checks, before any exchange
            ring_flash_attn(*local, softcap=-1.0)

        def failing(*args):  # an error inside a step, once its exchange is in flight (as out of memory would be)
            raise RuntimeError("injected")

        blocks = distributed._block_calls
        distributed._block_calls = failing
        with pytest.raises(RuntimeError, match="injected"):
            ring_flash_attn(*local, causal=True)
        distributed._block_calls = blocks
        out = ring_flash_attn(*local, causal=True)
        distributed._block_calls = failing
        with pytest.raises(RuntimeError, match="injected"):
            torch.autograd.grad(out, local, dout)
        distributed._block_calls = blocks
        assert_matches_whole(whole, local, dout, rank, world)  # the group still in step
    finally:
        dist.destroy_process_group()


def test_ring_after_an_error():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_recovery_rank, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


def run_subgroup_rank(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
        group = groups[rank % 2]
        whole, local, dout = whole_and_local(dist.get_rank(group), 2)
        assert_matches_whole(whole, local, dout, dist.get_rank(group), 2, group=group)
    finally:
        dist.destroy_process_group()


def test_ring_in_a_subgroup():
    # Two rings of two in a world of four: neighbours are the group's, by their global ranks.
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_subgroup_rank, args=(4, os.path.join(tmp, "init")), nprocs=4, join=True)


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
    # --standalone: a free port, so that parallel test runs do not collide on torchrun's default one.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           "--length", "64", "--heads", "2", "--dim", "16", "--iters", "1", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 1/2: fwd+bwd" in result.stdout and "speedup" in result.stdout
