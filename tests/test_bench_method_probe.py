"""benchmarks/bench_method_probe.py on the CPU: its arguments and its windows of per-call times (the probe itself
needs a GPU)."""
import argparse

import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("bench_method_probe")


def test_shapes_and_methods(probe):
    assert probe.parse_shape("256:nc:16384") == (256, False, 16384)
    assert probe.parse_methods("25:fixed,250:turned") == [(25, False), (250, True)]
    assert all(probe.parse_shape(s) for s in probe.DEFAULT_SHAPES)
    assert len(probe.parse_methods(probe.DEFAULT_METHODS)) == 4
    with pytest.raises(argparse.ArgumentTypeError, match="'fixed' or 'turned'"):
        probe.parse_methods("25:reversed")


def test_window_medians(probe):
    # Calls end at 10, 20 | 30, 70, 110 | 150, 190, 230 | 270, ..., 470 ms: the windows to 25, 125, 250 and 400 ms,
    # the calls ending past 400 ms counted in the last.
    per_call = [10, 10, 10, 40, 40, 40, 40, 40, 40, 40, 40, 40, 40, 40]
    assert probe.window_medians(per_call) == [(25, 10), (125, 40), (250, 40), (400, 40)]
    assert probe.window_medians([10, 10, 30]) == [(25, 10), (125, 30)]  # empty windows left out
