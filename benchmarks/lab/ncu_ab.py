"""Locked-clock A/B of two builds of the forward kernel (or the Hopper backward kernel): Nsight Compute's
gpu__time_duration per launch.

One-round benchmarks at the card's own clocks move by up to 10% between rounds on the H200; Nsight Compute locks the
clocks (its default --clock-control base) and times each launch, which separates changes of 0.5-1%
(benchmarks/lab/LOG.md, v18 and v19). Each build is a source tree with the extension built in place (`python setup.py
build_ext --inplace`; FLASHATTN_HEADDIMS may limit it to the head dims measured). The builds run in turns, `--passes`
times each, so a drift of the card shows up as a spread between passes rather than as a difference between builds.

    python benchmarks/lab/ncu_ab.py --build main=/tmp/main --build new=. --shapes 128:nc:1024,128:nc:4096,256:c:8192

prints, per shape, each build's median launch time (ns) per pass and the change of every later build against the first
(+ is faster), marked "apart" where every pass of one build is faster than every pass of the other (else "overlap");
more than two builds (--build given three times or more) are A/B'd against the first in one session. With --backward
each call is a forward and a backward, and the backward kernel is timed (the Hopper one; the sm80 one under
FLASHATTN_BWD_SM90=0). Shapes are D:nc|c:L at B*L = --tokens and H*D = --hidden, as in bench_sdpa.py (--window L,R
gives each a sliding window: the options kernels); a warm-up launch, then --launches timed ones. Needs ncu (CUDA
toolkit) on PATH or at /usr/local/cuda/bin/ncu.
"""
import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

KERNEL_REGEX = "regex:flash_fwd_sm90|flash_fwd_kernel"  # the Hopper and the sm80 forward
BACKWARD_KERNEL_REGEX = "regex:flash_bwd_sm90|flash_bwd_split_sm90|flash_bwd_kernel"  # the Hopper or sm80 backward


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        d, mask, length = item.split(":")
        if mask not in ("nc", "c"):
            raise SystemExit(f"--shapes: {item!r}: the mask is nc or c")
        shapes.append((int(d), mask == "c", int(length)))
    return shapes


def window_arg(text):
    left, right = (int(x) for x in text.split(","))
    return left, right


def launch(args, shapes):
    """The workload Nsight Compute profiles: per shape one warm-up and `launches` timed calls (forward, or forward and
    backward with --backward)."""
    import torch

    import flashattn_ext

    torch.use_deterministic_algorithms(args.deterministic)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    for d, causal, length in shapes:
        batch, heads = max(1, args.tokens // length), max(1, args.hidden // d)
        q, k, v = (torch.randn(batch, heads, length, d, device="cuda", dtype=dtype, requires_grad=args.backward)
                   for _ in range(3))
        grad_out = torch.randn_like(q)
        for _ in range(1 + args.launches):
            out = flashattn_ext.flash_attn(q, k, v, causal=causal, window_size=args.window, softcap=args.softcap)
            if args.backward:
                torch.autograd.grad(out, (q, k, v), grad_out)
        torch.cuda.synchronize()


def launch_times(csv_text):
    """gpu__time_duration.sum of each launch, in ns, in launch order, from `ncu --csv` output."""
    rows = list(csv.reader(line for line in csv_text.splitlines() if line.startswith('"')))
    if not rows:
        return []
    header = rows[0]
    name, value = header.index("Metric Name"), header.index("Metric Value")
    return [float(r[value].replace(",", "")) for r in rows[1:] if r[name] == "gpu__time_duration.sum"]


def shape_medians(times, num_shapes, launches):
    per_shape = 1 + launches
    if len(times) != num_shapes * per_shape:
        raise RuntimeError(f"expected {num_shapes * per_shape} launches, ncu reported {len(times)}")
    return [statistics.median(times[i * per_shape + 1:(i + 1) * per_shape]) for i in range(num_shapes)]


def profile(args, build_dir):
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    env = dict(os.environ, PYTHONPATH=str(Path(build_dir).resolve()), FLASHATTN_FWD_SM90=args.fwd_sm90,
               FLASHATTN_BWD_SM90=args.bwd_sm90, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    kernel_regex = args.kernel_regex or (BACKWARD_KERNEL_REGEX if args.backward else KERNEL_REGEX)
    cmd = [ncu, "--csv", "--metrics", "gpu__time_duration.sum", "-k", kernel_regex, sys.executable,
           str(Path(__file__).resolve()), "--launch", "--shapes", args.shapes, "--launches", str(args.launches),
           "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--dtype", args.dtype,
           f"--window={args.window[0]},{args.window[1]}",  # one token: "-1,-1" would read as an option
           "--softcap", str(args.softcap)]
    if args.backward:
        cmd.append("--backward")
    if args.deterministic:
        cmd.append("--deterministic")
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(f"ncu failed for {build_dir} (rc {result.returncode}):\n{result.stderr[-2000:]}")
    return launch_times(result.stdout)


def add_build_argument(parser):
    """--build NAME=DIR, given once per build (also same_bits.py's)."""
    parser.add_argument("--build", action="append", default=[], metavar="NAME=DIR",
                        help="a source tree with the extension built in place; give two or more (the first is the "
                             "baseline)")


def parse_builds(items):
    """[(name, dir)] from the --build arguments; exits unless there are two or more with distinct names."""
    if len(items) < 2 or any("=" not in b for b in items):
        raise SystemExit("give two or more --build NAME=DIR")
    builds = [tuple(b.split("=", 1)) for b in items]
    if len({name for name, _ in builds}) != len(builds):
        raise SystemExit("--build: the names must differ")
    return builds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_build_argument(parser)
    parser.add_argument("--shapes", default="128:nc:1024,128:nc:4096", help="comma list of D:nc|c:L")
    # Three passes read a change of -1.35% as -0.47% once, with the passes overlapping (LOG.md, Method).
    parser.add_argument("--passes", type=int, default=5, help="turns of each build")
    parser.add_argument("--launches", type=int, default=5, help="timed launches per shape (after one warm-up)")
    parser.add_argument("--tokens", type=int, default=16384, help="B * L")
    parser.add_argument("--hidden", type=int, default=2048, help="H * D")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--window", type=window_arg, default=(-1, -1), metavar="L,R",
                        help="a sliding window for every shape (the options kernels; -1: unbounded on that side)")
    parser.add_argument("--softcap", type=float, default=0.0, help="cap the scores: C * tanh(score / C)")
    parser.add_argument("--fwd-sm90", default="strict", help="FLASHATTN_FWD_SM90 for the runs (strict: Hopper only)")
    parser.add_argument("--backward", action="store_true",
                        help="time the Hopper backward kernel of a forward + backward call instead of the forward")
    parser.add_argument("--bwd-sm90", default="strict", help="FLASHATTN_BWD_SM90 for the runs (with --backward)")
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True) (the ordered dQ)")
    parser.add_argument("--kernel-regex", default=None,
                        help="ncu -k filter: the kernels to time (one launch per call; default: the forward's, or "
                             "the Hopper backward's with --backward)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per ncu run")
    parser.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)  # the profiled workload itself
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes)
    if args.launch:
        launch(args, shapes)
        return
    builds = parse_builds(args.build)

    medians = {name: [] for name, _ in builds}  # name -> [pass][shape]
    for _ in range(args.passes):
        for name, build_dir in builds:
            medians[name].append(shape_medians(profile(args, build_dir), len(shapes), args.launches))
    for line in comparison_lines(shapes, [name for name, _ in builds], medians):
        print(line)


def comparison_lines(shapes, names, medians):
    """Per shape and later build: the baseline's (names[0]) and the build's medians per pass, the build's change
    against the baseline (mean over passes; + is faster), and whether every pass of one is faster than every pass of
    the other ("apart") or not ("overlap"): a change whose passes overlap may be the card's drift."""
    base = names[0]
    lines = []
    for i, (d, causal, length) in enumerate(shapes):
        base_all = [p[i] for p in medians[base]]
        base_ns = statistics.mean(base_all)
        passes = lambda name: " / ".join(f"{p[i]:.0f}" for p in medians[name])
        for new in names[1:]:
            new_all = [p[i] for p in medians[new]]
            new_ns = statistics.mean(new_all)
            apart = max(new_all) < min(base_all) or min(new_all) > max(base_all)
            lines.append(f"D{d} {'causal' if causal else 'non-causal'} L{length}: {base} {passes(base)} ns, "
                         f"{new} {passes(new)} ns: {100 * (base_ns / new_ns - 1):+.2f}% "
                         f"({'apart' if apart else 'overlap'})")
    return lines


if __name__ == "__main__":
    main()
