"""benchmarks/lab/band_check.py on the CPU: its chunked band reference, and a check that passes and one that fails."""
import argparse

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def band_check():
    return load_benchmark("band_check")


@pytest.mark.parametrize("window,causal", [(5, True), (-1, True), (7, False), (0, True)])
def test_chunked_reference_is_the_whole_masked_attention(band_check, window, causal):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 33, 8, dtype=torch.float64) for _ in range(4))
    got = band_check.reference(q, k, v, dout, window, causal, torch.float64, chunk=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    seen = band_check.band(33, 33, window, causal, range(0, 33), "cpu")
    scores = (leaves[0] @ leaves[1].transpose(-1, -2)) * 8**-0.5
    out = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ leaves[2]
    out.backward(dout)
    lse = scores.masked_fill(~seen, float("-inf")).logsumexp(-1)
    for mine, want in zip(got, [out.detach(), *(t.grad for t in leaves), lse.detach()]):
        torch.testing.assert_close(mine, want)


def arguments(**overrides):
    values = dict(length=65, window=16, no_causal=False, batch=1, heads=2, head_dim=32, dtype="bf16", runs=2, chunk=16,
                  seed=0, flex=False, deterministic=False, poison=0.0, device="cpu")
    values.update(overrides)
    return argparse.Namespace(**values)


def test_our_cpu_path_passes_and_a_planted_gradient_error_fails(band_check, monkeypatch):
    before = torch.are_deterministic_algorithms_enabled()
    report = band_check.check(arguments(window=-1, deterministic=True))
    assert all(r["ok"] for r in report.values()) and torch.are_deterministic_algorithms_enabled() == before, report
    report = band_check.check(arguments())
    assert list(report) == ["out", "dq", "dk", "dv", "lse"]
    assert all(r["ok"] and r["same_bits"] for r in report.values()), report
    real = band_check.ours

    def off_by_five_percent(*args):
        out, dq, dk, dv, lse = real(*args)
        return [out, dq, dk * 1.05, dv, lse]

    monkeypatch.setattr(band_check, "ours", off_by_five_percent)
    report = band_check.check(arguments())
    assert [name for name, r in report.items() if not r["ok"]] == ["dk"], report
    assert report["dk"]["past"] > 0 and report["dq"]["past"] == 0 and report["dk"]["span"][1] < 65, report


def test_digests_tell_bits_apart(band_check):
    torch.manual_seed(0)
    t = torch.randn(3, 5, dtype=torch.bfloat16)
    bumped = t.clone()
    bumped.view(torch.int16)[1, 2] += 1  # one unit in the last place
    assert band_check.digest(t) == band_check.digest(t.clone().t().contiguous().t())
    assert len({band_check.digest(t), band_check.digest(bumped), band_check.digest(t, t)}) == 3


def test_report_lines_carry_the_digests(band_check, capsys):
    argv = ["--device", "cpu", "--length", "33", "--window", "8", "--batch", "1", "--heads", "2", "--head-dim", "32",
            "--runs", "1", "--chunk", "16"]
    assert band_check.main(argv) == 0
    first = capsys.readouterr().out.splitlines()
    assert band_check.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == first  # the same bits, the same report
    assert first[0].startswith("inputs (q, k, v, dout): bits ") and len(first) == 6
    assert all(line.split("; bits ")[1].isalnum() for line in first[1:]), first


def test_poison_needs_cuda(band_check, capsys):
    with pytest.raises(SystemExit) as exit_info:
        band_check.main(["--device", "cpu", "--poison", "1"])
    assert exit_info.value.code == 2 and "--poison fills CUDA memory" in capsys.readouterr().err


@pytest.mark.cuda
def test_poisoned_memory_shows_a_gradient_left_unwritten(band_check, monkeypatch):
    report = band_check.check(arguments(device="cuda", head_dim=128, poison=0.25))
    assert all(r["ok"] and r["same_bits"] for r in report.values()), report
    real = band_check.ours

    def unwritten_dk(*args):
        out, dq, dk, dv, lse = real(*args)
        return [out, dq, torch.empty_like(dk), dv, lse]  # carved from the poisoned block

    monkeypatch.setattr(band_check, "ours", unwritten_dk)
    report = band_check.check(arguments(device="cuda", head_dim=128, poison=0.25))
    assert [name for name, r in report.items() if not r["ok"]] == ["dk"], report
