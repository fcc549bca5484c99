"""How much bench_sdpa.py's timing method moves ours / cuDNN under the card's power cap.

    python benchmarks/lab/bench_method_probe.py                          # default shapes and methods
    python benchmarks/lab/bench_method_probe.py 256:nc:8192 --methods 25:fixed,250:turned --repeats 3
    python benchmarks/lab/bench_method_probe.py 256:nc:16384 --transient

For each shape (D:nc|c:L with B = 16384 // L and H = 2048 // D, as in bench_sdpa.py's grid) and each method
(do_bench warm-up in ms, and a fixed order or one that turns round every round, as bench_sdpa.round_order does), it
takes --rounds rounds of do_bench (100 ms timed) over ours, FA2, SDPA's efficient backend and cuDNN, starting from
bench_sdpa's order without the naive path (F) and from its reverse (R), --repeats times each, and prints ours /
cuDNN (medians) of each. In the fixed order F and R give every implementation other predecessors, so where they
disagree the method measures the order, not the kernels. In the turned order with an even number of rounds R is F a
round later: the two share predecessors, and their agreement shows repeatability, not the bias left. With
--transient it first prints each target's speed over the 400 ms (the sum of its calls' GPU times) after each
implementation's do_bench, itself included, in windows.
Its prototype took the same measurements (LOG.md, Method): the fixed order with 25 ms of warm-up moved ours / cuDNN by
up to 9% between F and R; the turned order with 250 ms repeated within 2.3%.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from power_probe import parse_shape  # noqa: E402  (D:nc|c:L, as in bench_sdpa.py's grid)

DEFAULT_SHAPES = ("256:nc:16384", "256:nc:8192", "128:nc:1024")
DEFAULT_METHODS = "25:fixed,25:turned,100:turned,250:turned"
IMPLS = ("ours", "flash", "efficient", "cudnn")
REP_MS = 100
TRANSIENT_MS = 400
TRANSIENT_WINDOWS_MS = (25, 125, 250, TRANSIENT_MS)


def parse_methods(text):
    """'25:fixed,250:turned' -> [(25, False), (250, True)]."""
    methods = []
    for item in text.split(","):
        warmup, order = item.split(":")
        if order not in ("fixed", "turned"):
            raise argparse.ArgumentTypeError(f"method {item!r}: the order is 'fixed' or 'turned'")
        methods.append((int(warmup), order == "turned"))
    return methods


def window_medians(per_call_ms, edges_ms=TRANSIENT_WINDOWS_MS):
    """Median per-call time in each window of elapsed time (calls ending at or before each edge, after the previous
    one); empty windows are left out. Returns [(edge, median ms)]."""
    windows = {edge: [] for edge in edges_ms}
    elapsed = 0.0
    for ms in per_call_ms:
        elapsed += ms
        edge = next((e for e in edges_ms if elapsed <= e), edges_ms[-1])
        windows[edge].append(ms)
    return [(edge, statistics.median(times)) for edge, times in windows.items() if times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                        help=f"D:nc|c:L (default: {' '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--methods", type=parse_methods, default=parse_methods(DEFAULT_METHODS),
                        help=f"comma list of WARMUP_MS:fixed|turned (default {DEFAULT_METHODS})")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per measurement, as bench_sdpa's --rounds")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per method and base order")
    parser.add_argument("--transient", action="store_true", help="also print each target's first 400 ms")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats: at least 1")

    import torch
    from triton.testing import do_bench

    import bench_sdpa

    bench_sdpa.import_flashattn_ext()
    torch.manual_seed(0)
    for head_dim, causal, length in args.shapes:
        batch, heads = max(1, 16384 // length), max(1, 2048 // head_dim)
        q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * length * length * head_dim / (2 if causal else 1)
        fns = {impl: bench_sdpa.forward_callable(impl, q, k, v, causal) for impl in IMPLS}
        for fn in fns.values():
            fn()  # a backend that rejects the shape raises here
        tflops = lambda ms: flops / ms / 1e9
        print(f"== D{head_dim} {'c' if causal else 'nc'} L{length} (B{batch} H{heads})", flush=True)
        if args.transient:
            for target in ("ours", "cudnn"):
                for before in IMPLS:
                    do_bench(fns[before], warmup=25, rep=REP_MS)
                    events = []
                    start = time.perf_counter()
                    while time.perf_counter() - start < TRANSIENT_MS / 1e3:
                        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        begin.record()
                        fns[target]()
                        end.record()
                        events.append((begin, end))
                        if len(events) % 8 == 0:
                            end.synchronize()  # keep the host within a few calls of the card
                    torch.cuda.synchronize()
                    windows = window_medians([begin.elapsed_time(end) for begin, end in events])
                    print(f"  {target:5s} after {before:9s}: " +
                          " | ".join(f"to {edge} ms {tflops(ms):.0f}" for edge, ms in windows), flush=True)
        for warmup_ms, turned in args.methods:
            readings = []
            for _ in range(args.repeats):
                for name, base in (("F", list(IMPLS)), ("R", list(IMPLS[::-1]))):
                    times = {impl: [] for impl in IMPLS}
                    for round_index in range(args.rounds):
                        for impl in bench_sdpa.round_order(base, round_index) if turned else base:
                            times[impl].append(do_bench(fns[impl], warmup=warmup_ms, rep=REP_MS,
                                                        return_mode="median"))
                    ours, cudnn = (tflops(statistics.median(times[impl])) for impl in ("ours", "cudnn"))
                    readings.append(f"{name} {ours:.0f}/{cudnn:.0f}={ours / cudnn:.3f}")
            print(f"  warm-up {warmup_ms:3d} ms {'turned' if turned else 'fixed '}: " + "  ".join(readings),
                  flush=True)


if __name__ == "__main__":
    main()
