"""Where the Hopper backward (D64 / D128) spends a key block, timed from inside the kernel.

Nsight Compute's stall samples say where warps wait, not what holds a key block: a segment whose samples were removed
may gain nothing (LOG.md, backward v29). bwd_segment_timer.patch makes thread 0 of each consumer warpgroup add
globaltimer spans per segment into shared memory and print the sums at the end of CTAs 0, 33, 66 and 99. It slows the
kernel by a quarter (the window and the plain causal kernels alike), so compare segments within one build, never its
times with another build's.

    git apply benchmarks/lab/bwd_segment_timer.patch      # a lab build: revert it before any commit
    FLASHATTN_HEADDIMS=128 python setup.py build_ext --inplace
    python benchmarks/lab/profile_fwd.py --backward --causal --window 1024,0 --lengths 16384 --tokens 32768 > trace.txt
    git apply -R benchmarks/lab/bwd_segment_timer.patch
    python benchmarks/lab/bwd_segments.py trace.txt

prints, per kernel variant and consumer, the steps a key block takes, the time of a step after the first, each
segment's time per block and the block's time outside its steps (in steps). tests/lab/test_bwd_segments.py fails once
a change to bwd_kernel.h stops the patch from applying: apply it with `git apply -3`, mend, and write it again from
`git diff`.
"""
import argparse
import collections
from pathlib import Path

SEGMENTS = ("start barrier", "K/V wait", "first step", "other steps", "last dQ", "epilogue barriers", "dK/dV stores")


def parse(lines):
    """(causal, options, consumer) -> [(blocks, steps, [ns per segment])] from the TRACE lines."""
    groups = collections.defaultdict(list)
    for line in lines:
        fields = line.split()
        if not fields or fields[0] != "TRACE":
            continue
        causal, options, _cta, consumer = fields[1:5]
        groups[(causal, options, consumer)].append(
            (int(fields[6]), int(fields[8]), [int(x) for x in fields[10:10 + len(SEGMENTS)]]))
    return groups


def summary(entries):
    blocks = sum(e[0] for e in entries)
    steps = sum(e[1] for e in entries)
    ns = [sum(e[2][i] for e in entries) for i in range(len(SEGMENTS))]
    step_ns = ns[3] / max(1, steps - blocks)
    outside = sum(ns) - ns[3] - ns[2] + max(0.0, ns[2] - blocks * step_ns)
    return blocks, steps, ns, step_ns, outside


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="the workload's output, with the kernel's TRACE lines")
    args = parser.parse_args()
    groups = parse(args.trace.read_text().splitlines())
    if not groups:
        raise SystemExit(f"{args.trace}: no TRACE lines (is bwd_segment_timer.patch applied and built?)")
    for (causal, options, consumer), entries in sorted(groups.items()):
        blocks, steps, ns, step_ns, outside = summary(entries)
        print(f"causal {causal} options {options} consumer {consumer}: {steps / blocks:.2f} steps a block, "
              f"{step_ns:.0f} ns a step after the first")
        print("  per block, ns: " + ", ".join(f"{name} {t / blocks:.0f}" for name, t in zip(SEGMENTS, ns)))
        print(f"  outside the steps: {outside / blocks:.0f} ns = {outside / blocks / step_ns:.2f} steps a block")


if __name__ == "__main__":
    main()
