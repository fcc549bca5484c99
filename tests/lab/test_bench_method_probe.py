"""benchmarks/lab/bench_method_probe.py on the CPU: its arguments and its windows of per-call times (the probe itself
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
    # Calls end at 25 | 125 | 250 | 400, 900 ms: a call ending on an edge counts in the window it closes, and one
    # ending past 400 ms in the last window.
    assert probe.window_medians([25, 100, 125, 150, 500]) == [(25, 25), (125, 100), (250, 125), (400, 325)]
    assert probe.window_medians([10, 10, 30]) == [(25, 10), (125, 30)]  # empty windows left out
