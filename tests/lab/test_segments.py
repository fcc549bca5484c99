"""benchmarks/lab/segments.py on the CPU: the segment timers' patches still apply, and their lines are summed."""
import shutil
import subprocess

import pytest

from scripts import LAB, load_benchmark

# As the patched kernels print them (segments in ns), amid other output: the backward's key blocks (two CTAs of
# consumer 0, one of consumer 1) and the forward's tiles (two CTAs of consumer 0).
TRACE = """TIME something else
TRACE 1 1 0 0 blocks 2 steps 10 ns 100 200 400 2400 300 500 600
TRACE 1 1 33 0 blocks 2 steps 10 ns 100 200 300 2400 300 500 600
TRACE 1 1 0 1 blocks 1 steps 3 ns 50 60 70 600 80 90 100
TRACE 1 1 0 0 tiles 2 blocks 10 ns 50 20 10 30 40 300 2400 60 70 200
TRACE 1 1 33 0 tiles 2 blocks 10 ns 50 20 10 30 40 500 2400 60 70 200
"""


@pytest.fixture(scope="module")
def segments():
    return load_benchmark("segments")


def test_lines_group_by_kernel_variant_and_consumer(segments):
    groups = segments.parse(TRACE.splitlines())
    assert sorted(groups) == [("blocks", "1", "1", "0"), ("blocks", "1", "1", "1"), ("tiles", "1", "1", "0")]
    assert groups[("blocks", "1", "1", "0")][1] == (2, 10, [100, 200, 300, 2400, 300, 500, 600])
    assert groups[("tiles", "1", "1", "0")][1] == (2, 10, [50, 20, 10, 30, 40, 500, 2400, 60, 70, 200])


def test_backward_counts_steps_after_the_first_and_the_time_outside_them(segments):
    kind = "blocks"
    entries = segments.parse(TRACE.splitlines())[(kind, "1", "1", "0")]
    blocks, steps, ns, step_ns, outside = segments.summary(kind, entries)
    assert (blocks, steps) == (4, 20)
    assert step_ns == pytest.approx(4800 / 16)  # 16 steps after each block's first
    # Barriers, K/V wait, last dQ, epilogue: 3400 ns; the first steps (700 ns) ran 700 - 4 x 300 < 0 over a step.
    assert outside == pytest.approx(3400)
    assert ns[2] == 700


def test_forward_counts_the_tiles_time_past_their_blocks(segments):
    kind = "tiles"
    entries = segments.parse(TRACE.splitlines())[(kind, "1", "1", "0")]
    tiles, blocks, ns, block_ns, outside = segments.summary(kind, entries)
    assert (tiles, blocks) == (4, 20)
    assert block_ns == pytest.approx(4800 / 16)  # 16 blocks after each tile's first
    assert outside == pytest.approx(6560 - 20 * 300)  # 6560 ns in all, 20 blocks at the loop's rate
    assert ns[5] == 800


@pytest.mark.parametrize("patch", ["bwd_segment_timer.patch", "fwd_segment_timer.patch"])
def test_the_patch_applies_to_the_kernel(patch):
    root = LAB.parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs the git checkout")
    result = subprocess.run(["git", "apply", "--check", str(LAB / patch)], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
