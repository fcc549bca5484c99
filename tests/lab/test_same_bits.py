"""benchmarks/lab/same_bits.py on the CPU: its grid, its bitwise comparison, and one build's run on the CPU path."""
import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def same_bits():
    return load_benchmark("same_bits")


def test_grid_covers_the_options_and_names_each_case(same_bits):
    grid = same_bits.cases([64, 128])
    names = [same_bits.describe(case) for case in grid]
    assert len(set(names)) == len(grid)  # each case told apart in the report
    assert {case["head_dim"] for case in grid} == {64, 128}
    assert {case["window"] for case in grid} == set(same_bits.WINDOWS)
    assert any(case["softcap"] for case in grid) and any(case["sinks"] for case in grid)
    assert any(case["dtype"] == "fp16" for case in grid) and {case["gqa"] for case in grid} == {1, 4}
    assert {case["kind"] for case in grid} == {"dense", "packed", "cache", "paged"}
    assert max(case["lq"] for case in same_bits.cases([64], quick=True) if case["kind"] == "dense") == 129


def test_compare_tells_bits_not_values(same_bits):
    x = torch.tensor([1.0, float("nan"), -0.0])
    base = {0: [x, x.to(torch.bfloat16)], 1: [x]}
    assert same_bits.compare(base, {0: [x.clone(), x.to(torch.bfloat16)], 1: [x.clone()]}) == []
    zero = torch.tensor([1.0, float("nan"), 0.0])  # +0 for -0: equal values, other bits
    nudged = torch.tensor([1.0 + 2**-23, float("nan"), -0.0])
    differing = same_bits.compare(base, {0: [x, x.to(torch.bfloat16)], 1: [zero]})
    assert differing == [(1, 0.0)]
    assert same_bits.compare(base, {0: [nudged, x.to(torch.bfloat16)], 1: [x]}) == [(0, pytest.approx(2**-23))]
    assert same_bits.compare(base, {0: [x, x.to(torch.bfloat16)]})[0][0] == 1  # a case the other run lacks


def test_a_run_on_the_cpu_path_repeats_its_bits(same_bits, tmp_path):
    first, second = tmp_path / "a.pt", tmp_path / "b.pt"
    same_bits.run(first, [64], "cpu", backward=True, quick=True)
    same_bits.run(second, [64], "cpu", backward=True, quick=True)
    a, b = torch.load(first), torch.load(second)
    grid = same_bits.cases([64], quick=True)
    assert len(a) == len(grid)
    kinds = [case["kind"] for case in grid]
    assert len(a[kinds.index("dense")]) == len(a[kinds.index("packed")]) == 5  # out, lse, dq, dk, dv
    assert len(a[kinds.index("paged")]) == 4  # out, lse and the caches
    assert same_bits.compare(a, b) == []
