"""benchmarks/bench_sdpa.py: the interleaved timing rounds, and the CPU variant end to end (CSV and JSON)."""
import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sdpa.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_sdpa", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through the module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_measure_interleaves_the_rounds_and_keeps_each_median(bench):
    # Each implementation is timed once per round, in an order that turns round every round, so a drift of the card
    # touches all alike and the kernel run just before changes; a rejected implementation becomes an error, not a
    # timing.
    timings = {"a": [3.0, 1.0, 2.0], "b": [5.0, 9.0, 4.0]}
    order = []

    def make_fn(impl, q, k, v, causal):
        if impl == "rejected":
            raise RuntimeError("unsupported configuration")
        return bench.Timed(lambda: impl, 2.0)

    def timer(fn):
        impl = fn()
        order.append(impl)
        return timings[impl][order.count(impl) - 1]

    config = bench.Config("fp32", 32, False, 128, 2, 4)
    results = bench.measure(["a", "rejected", "b"], None, None, None, config, make_fn, timer, "cpu", rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert (results["a"].ms, results["b"].ms) == (2.0, 5.0)
    assert results["a"].tflops == pytest.approx(config.forward_flops() * 2.0 / 2e-3 / 1e12)
    assert results["rejected"].error.startswith("RuntimeError: unsupported configuration")
    assert results["rejected"].ms is None


def test_measure_times_the_backward_alone_after_each_step(bench):
    # fwdbwd's backward alone is timed right after the implementation's step, in the same turned rounds, and rated at
    # 2.5x the forward's FLOPs.
    order = []

    def make_fn(impl, q, k, v, causal):
        return bench.Timed(lambda: impl, 3.5, lambda: impl + "-bwd")

    def timer(fn):
        order.append(fn())
        return 4.0 if order[-1].endswith("-bwd") else 10.0

    config = bench.Config("fp32", 32, True, 128, 2, 4)
    results = bench.measure(["a", "b"], None, None, None, config, make_fn, timer, "cpu", rounds=2)
    assert order == ["a", "a-bwd", "b", "b-bwd", "b", "b-bwd", "a", "a-bwd"]
    assert (results["a"].ms, results["a"].bwd_ms) == (10.0, 4.0)
    assert results["a"].tflops == pytest.approx(config.forward_flops() * 3.5 / 10e-3 / 1e12)
    assert results["a"].bwd_tflops == pytest.approx(config.forward_flops() * 2.5 / 4e-3 / 1e12)


def test_round_order_turns_round_every_round(bench):
    assert bench.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert bench.round_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_cpu_variant_writes_its_rows_and_rounds(bench, tmp_path):
    bench.main(["--device", "cpu", "--head-dims", "32", "--lengths", "64", "--causal", "on", "--backends", "math",
                "--tokens", "128", "--hidden", "64", "--rounds", "2", "--no-plot", "--out", str(tmp_path)])
    rows = list(csv.DictReader((tmp_path / "bench_sdpa_cpu_fwd.csv").open()))
    assert len(rows) == 1 and rows[0]["seqlen"] == "64" and rows[0]["causal"] == "True"
    assert float(rows[0]["ours_ms"]) > 0 and float(rows[0]["math_ms"]) > 0
    assert rows[0]["diff_ok"] == "True"
    meta = json.loads((tmp_path / "bench_sdpa_cpu_fwd.json").read_text())["metadata"]
    assert meta["rounds"] == 2 and meta["device_uuid"] is None  # the card's UUID is recorded on a GPU only


def test_fwdbwd_reports_the_backward_alone_and_runs_deterministic(bench, tmp_path):
    bench.main(["--device", "cpu", "--head-dims", "32", "--lengths", "64", "--causal", "off", "--backends", "math",
                "--tokens", "128", "--hidden", "64", "--rounds", "1", "--no-plot", "--out", str(tmp_path),
                "--mode", "fwdbwd", "--deterministic"])
    rows = list(csv.DictReader((tmp_path / "bench_sdpa_cpu_fwdbwd_deterministic.csv").open()))
    assert float(rows[0]["ours_bwd_ms"]) > 0 and float(rows[0]["math_bwd_tflops"]) > 0
    assert rows[0]["best_sdpa_bwd"] == "math" and float(rows[0]["ours_bwd_over_best"]) > 0
    meta = json.loads((tmp_path / "bench_sdpa_cpu_fwdbwd_deterministic.json").read_text())["metadata"]
    assert meta["deterministic"] is True and meta["mode"] == "fwdbwd"


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_model_layout_times_and_checks_sequence_major_views(bench, tmp_path, monkeypatch, mode):
    # --layout bshd: ours, math and naive get (B, L, H, D) views (GQA included), in the timing and in the check.
    seen = []

    def as_heads(rows, heads):
        view = rows.view(rows.shape[0], rows.shape[1], heads, -1).transpose(1, 2)
        seen.append(view.stride())
        return view

    monkeypatch.setattr(bench, "as_heads", as_heads)
    bench.main(["--device", "cpu", "--head-dims", "32", "--lengths", "64", "--causal", "on", "--backends", "math",
                "--tokens", "128", "--hidden", "128", "--kv-heads", "2", "--rounds", "1", "--no-plot",
                "--out", str(tmp_path), "--mode", mode, "--layout", "bshd"])
    assert (64 * 4 * 32, 32, 4 * 32, 1) in seen and (64 * 2 * 32, 32, 2 * 32, 1) in seen  # q's and k / v's views
    rows = list(csv.DictReader((tmp_path / f"bench_sdpa_cpu_{mode}_bshd.csv").open()))
    assert float(rows[0]["ours_ms"]) > 0 and float(rows[0]["math_ms"]) > 0 and rows[0]["diff_ok"] == "True"
    meta = json.loads((tmp_path / f"bench_sdpa_cpu_{mode}_bshd.json").read_text())["metadata"]
    assert meta["layout"] == "bshd"


def test_kv_heads_run_gqa_rows_against_sdpa(bench, tmp_path):
    # --kv-heads: K/V with fewer heads (SDPA with enable_gqa, the naive path repeats them); a K/V head count that does
    # not divide H is refused.
    bench.main(["--device", "cpu", "--head-dims", "32", "--lengths", "64", "--causal", "on", "--backends", "math",
                "--tokens", "128", "--hidden", "128", "--kv-heads", "2", "--rounds", "1", "--no-plot",
                "--out", str(tmp_path)])
    rows = list(csv.DictReader((tmp_path / "bench_sdpa_cpu_fwd.csv").open()))
    assert (rows[0]["heads"], rows[0]["heads_kv"]) == ("4", "2")
    assert float(rows[0]["math_ms"]) > 0 and float(rows[0]["naive_ms"]) > 0 and rows[0]["diff_ok"] == "True"
    with pytest.raises(SystemExit, match="kv-heads"):
        bench.main(["--device", "cpu", "--head-dims", "32", "--lengths", "64", "--hidden", "128", "--kv-heads", "3",
                    "--no-plot", "--out", str(tmp_path)])


def test_rounds_must_be_positive(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--device", "cpu", "--rounds", "0"])
    assert exit_info.value.code == 2 and "--rounds: at least 1" in capsys.readouterr().err


def test_varlen_lengths_and_plot(tmp_path):
    # bench_varlen.py (bench_sdpa.py --varlen): the lengths fill the token budget exactly, the bar chart is written.
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_varlen
    finally:
        sys.path.remove(str(BENCH.parent))
    lengths = bench_varlen.draw_lengths(16384, 100, 4000, 0)
    assert sum(lengths) == 16384 and all(1 <= n <= 4000 for n in lengths)
    assert lengths == bench_varlen.draw_lengths(16384, 100, 4000, 0)
    rows = [dict(impl="ours", ms=1.0, tflops=300.0), dict(impl="varlen_attn", ms=1.2, tflops=250.0)]
    bench_varlen.write_plot(tmp_path / "varlen.png", rows, "title")
    assert (tmp_path / "varlen.png").stat().st_size > 0


def test_decode_mode_and_plot(bench, monkeypatch, tmp_path):
    # bench_sdpa.py --mode decode hands the other arguments to bench_decode.py, whose bar chart is written.
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_decode
    finally:
        sys.path.remove(str(BENCH.parent))
    seen = []
    monkeypatch.setattr(bench_decode, "main", seen.append)
    bench.main(["--batches", "8", "--mode", "decode", "--rounds", "2"])
    bench.main(["--mode=decode", "--len-q", "4"])
    assert seen == [["--batches", "8", "--rounds", "2"], ["--len-q", "4"]]
    pytest.importorskip("matplotlib")
    rows = [dict(heads_kv=8, batch=b, length=4096, kvcache_tbs=2.0 * b, cudnn_tbs=2.1 * b) for b in (1, 8)]
    bench_decode.write_plot(tmp_path / "decode.png", rows, "tbs")
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_visible_pairs_count_the_mask(bench):
    # The FLOPs every rate is counted on: the (query, key) pairs the op's mask leaves, against the mask the tests hold
    # the op to (windows inclusive, bottom-right with Lq != Lk both ways, rows without keys; bench_decode's causal chunks
    # take the same count).
    from reference import visible_mask

    for window in [(-1, -1), (0, 0), (16, 0), (5, -1), (-1, 3), (7, 2)]:
        mods = bench.ScoreMods(window=window)
        for len_q, len_k in [(1, 1), (7, 7), (20, 16), (16, 20), (1, 50), (50, 1), (33, 70)]:
            for causal in (False, True):
                want = int(visible_mask(len_q, len_k, causal, "cpu", window).sum())
                assert mods.visible_pairs(len_q, len_k, causal) == want, (window, len_q, len_k, causal)


@pytest.mark.parametrize("bug", ["none", "scale", "gradient"])
def test_the_correctness_check_can_fail(bench, monkeypatch, bug):
    # The rule (3x the reference path's own error in the input dtype) catches a 5% scale error in the output and, in
    # fwdbwd, a 5% error in the gradients alone.
    import flashattn_ext

    class ScaledGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.05

    real = flashattn_ext.flash_attn

    def planted(q, k, v, **kwargs):
        if bug == "scale":
            kwargs["scale"] = 1.05 * q.shape[-1] ** -0.5
        out = real(q, k, v, **kwargs)
        return ScaledGradient.apply(out) if bug == "gradient" else out

    monkeypatch.setattr(bench, "flashattn_ext", flashattn_ext, raising=False)
    monkeypatch.setattr(flashattn_ext, "flash_attn", planted)
    config = bench.Config("fp32", 32, True, 96, 2, 4)
    q, k, v = (torch.randn(2, 4, 96, 32) for _ in range(3))
    for with_grads in (False, True):
        row = bench.Row(config)
        bench.check_correctness(row, q, k, v, with_grads, 2**30)
        assert row.diff_ref == "math float64"
        caught = bug == "scale" or (bug == "gradient" and with_grads)
        assert row.diff_ok is (not caught), (bug, with_grads, row.max_abs_diff, row.grad_abs_diff)
        named = [part.split()[0] for part in row.diff_over.split("; ")] if row.diff_over else []
        assert ("out" in named) == (bug == "scale") and bool(named) == caught, row.diff_over
        assert bug != "gradient" or named == (["dq", "dk", "dv"] if with_grads else []), row.diff_over
