"""Where the Hopper kernels spend a unit of work, timed from inside: the backward (D64 / D128) a key block, the forward
a tile.

Nsight Compute's stall samples say where warps wait, not what holds a unit: a segment whose samples were removed may
gain nothing (LOG.md, backward v29). The lab patches make thread 0 of each consumer warpgroup add globaltimer spans per
segment into shared memory and print the sums at the end of CTAs 0, 33, 66 and 99: bwd_segment_timer.patch per key
block of the backward, fwd_segment_timer.patch per tile of the forward. The stamps slow the kernels (the backward by a
quarter, every block alike), so compare segments within one build, never its times with another build's.

    git apply benchmarks/lab/bwd_segment_timer.patch      # a lab build: revert it before any commit
    FLASHATTN_HEADDIMS=128 python setup.py build_ext --inplace
    python benchmarks/lab/profile_fwd.py --backward --causal --window 1024,0 --lengths 16384 --tokens 32768 > trace.txt
    git apply -R benchmarks/lab/bwd_segment_timer.patch
    python benchmarks/lab/segments.py trace.txt

(the forward: fwd_segment_timer.patch, and profile_fwd.py without --backward) prints, per kernel variant and consumer,
the steps a key block takes (the blocks a tile takes), the time of one after the first, each segment's time per unit
and the unit's time outside them. The lines do not name the shape: one shape per trace. tests/lab/test_segments.py
fails once a kernel change stops a patch from applying: apply it with `git apply -3`, mend, and write it again from
`git diff`.
"""
import argparse
import collections
from pathlib import Path

# The word after a TRACE line's consumer names the kernel: "blocks" (the backward's key blocks, then its steps) or
# "tiles" (the forward's tiles, then their key blocks).
SEGMENTS = {
    "blocks": ("start barrier", "K/V wait", "first step", "other steps", "last dQ", "epilogue barriers",
               "dK/dV stores"),
    "tiles": ("next tile", "Q wait", "Q fragments", "K wait", "turn wait", "first block", "key loop", "last P V",
              "row totals + P V wait", "O store"),
}
UNITS = {"blocks": ("key block", "step"), "tiles": ("tile", "block")}


def parse(lines):
    """(kind, causal, options, consumer) -> [(units, parts, [ns per segment])] from the TRACE lines."""
    groups = collections.defaultdict(list)
    for line in lines:
        fields = line.split()
        if not fields or fields[0] != "TRACE":
            continue
        causal, options, _cta, consumer, kind = fields[1:6]
        groups[(kind, causal, options, consumer)].append(
            (int(fields[6]), int(fields[8]), [int(x) for x in fields[10:10 + len(SEGMENTS[kind])]]))
    return groups


def summary(kind, entries):
    """Units, their parts (steps, blocks), ns per segment, ns per part after a unit's first, ns outside the parts."""
    units = sum(e[0] for e in entries)
    parts = sum(e[1] for e in entries)
    names = SEGMENTS[kind]
    ns = [sum(e[2][i] for e in entries) for i in range(len(names))]
    if kind == "blocks":  # the backward: a block's first step counts past a later step's time only
        first, later = ns[names.index("first step")], ns[names.index("other steps")]
        part_ns = later / max(1, parts - units)
        outside = sum(ns) - later - first + max(0.0, first - units * part_ns)
    else:  # the forward: a loop pass takes S of one block and P V of the one before; the first S and the last P V
        # make up one more block
        part_ns = ns[names.index("key loop")] / max(1, parts - units)
        outside = sum(ns) - parts * part_ns
    return units, parts, ns, part_ns, outside


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="the workload's output, with the kernel's TRACE lines")
    args = parser.parse_args()
    groups = parse(args.trace.read_text().splitlines())
    if not groups:
        raise SystemExit(f"{args.trace}: no TRACE lines (is a segment timer patch applied and built?)")
    for (kind, causal, options, consumer), entries in sorted(groups.items()):
        unit, part = UNITS[kind]
        units, parts, ns, part_ns, outside = summary(kind, entries)
        print(f"causal {causal} options {options} consumer {consumer}: {parts / units:.2f} {part}s a {unit}, "
              f"{part_ns:.0f} ns a {part} after the first")
        print(f"  per {unit}, ns: " + ", ".join(f"{name} {t / units:.0f}" for name, t in zip(SEGMENTS[kind], ns)))
        print(f"  outside the {part}s: {outside / units:.0f} ns = {outside / units / part_ns:.2f} {part}s a {unit}")


if __name__ == "__main__":
    main()
