"""benchmarks/lab/fwd_segments.py on the CPU: the segment timer's patch still applies, and its lines are summed."""
import shutil
import subprocess

import pytest

from scripts import LAB, load_benchmark

# Two CTAs of consumer 0 and one of consumer 1, as the patched kernel prints them (segments in ns), amid other output.
TRACE = """TIME something else
TRACE 1 1 0 0 tiles 2 blocks 10 ns 50 20 10 30 40 300 2400 60 70 200
TRACE 1 1 33 0 tiles 2 blocks 10 ns 50 20 10 30 40 500 2400 60 70 200
TRACE 1 1 0 1 tiles 1 blocks 5 ns 10 10 10 10 10 400 1200 10 10 100
"""


@pytest.fixture(scope="module")
def fwd_segments():
    return load_benchmark("fwd_segments")


def test_lines_group_by_variant_and_consumer(fwd_segments):
    groups = fwd_segments.parse(TRACE.splitlines())
    assert sorted(groups) == [("1", "1", "0"), ("1", "1", "1")]
    assert groups[("1", "1", "0")][1] == (2, 10, [50, 20, 10, 30, 40, 500, 2400, 60, 70, 200])


def test_summary_counts_blocks_after_the_first_and_the_time_outside_them(fwd_segments):
    tiles, blocks, ns, block_ns, outside = fwd_segments.summary(fwd_segments.parse(TRACE.splitlines())[("1", "1", "0")])
    assert (tiles, blocks) == (4, 20)
    assert block_ns == pytest.approx(4800 / 16)  # 16 blocks after each tile's first
    # 6560 ns in all, 20 blocks at the loop's 300 ns: 560 ns of seam.
    assert outside == pytest.approx(560)
    assert ns[5] == 800


def test_the_patch_applies_to_the_kernel():
    root = LAB.parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs the git checkout")
    result = subprocess.run(["git", "apply", "--check", str(LAB / "fwd_segment_timer.patch")], cwd=root,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
