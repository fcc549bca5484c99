"""benchmarks/lab/bwd_segments.py on the CPU: the segment timer's patch still applies, and its lines are summed."""
import shutil
import subprocess

import pytest

from scripts import LAB, load_benchmark

# Two CTAs of consumer 0 and one of consumer 1, as the patched kernel prints them (segments in ns), amid other output.
TRACE = """TIME something else
TRACE 1 1 0 0 blocks 2 steps 10 ns 100 200 400 2400 300 500 600
TRACE 1 1 33 0 blocks 2 steps 10 ns 100 200 300 2400 300 500 600
TRACE 1 1 0 1 blocks 1 steps 3 ns 50 60 70 600 80 90 100
"""


@pytest.fixture(scope="module")
def bwd_segments():
    return load_benchmark("bwd_segments")


def test_lines_group_by_variant_and_consumer(bwd_segments):
    groups = bwd_segments.parse(TRACE.splitlines())
    assert sorted(groups) == [("1", "1", "0"), ("1", "1", "1")]
    assert groups[("1", "1", "0")][1] == (2, 10, [100, 200, 300, 2400, 300, 500, 600])


def test_summary_counts_steps_after_the_first_and_the_time_outside_them(bwd_segments):
    blocks, steps, ns, step_ns, outside = bwd_segments.summary(bwd_segments.parse(TRACE.splitlines())[("1", "1", "0")])
    assert (blocks, steps) == (4, 20)
    assert step_ns == pytest.approx(4800 / 16)  # 16 steps after each block's first
    # Barriers, K/V wait, last dQ, epilogue: 3400 ns; the first steps (700 ns) ran 700 - 4 x 300 < 0 over a step.
    assert outside == pytest.approx(3400)
    assert ns[2] == 700


def test_the_patch_applies_to_the_kernel():
    root = LAB.parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs the git checkout")
    result = subprocess.run(["git", "apply", "--check", str(LAB / "bwd_segment_timer.patch")], cwd=root,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
