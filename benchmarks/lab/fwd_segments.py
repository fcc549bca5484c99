"""Where the Hopper forward spends a tile, timed from inside the kernel: the key loop against the tile's seam.

fwd_segment_timer.patch makes thread 0 of each consumer warpgroup add globaltimer spans per segment of a tile into
shared memory and print the sums at the end of CTAs 0, 33, 66 and 99. The stamps slow the kernel, so compare segments
within one build, never its times with another build's.

    git apply benchmarks/lab/fwd_segment_timer.patch      # a lab build: revert it before any commit
    FLASHATTN_HEADDIMS=128 python setup.py build_ext --inplace
    python benchmarks/lab/profile_fwd.py --causal --window 1024,0 --lengths 16384 --tokens 32768 > trace.txt
    git apply -R benchmarks/lab/fwd_segment_timer.patch
    python benchmarks/lab/fwd_segments.py trace.txt

prints, per kernel variant and consumer, the key blocks a tile takes, the time of a block after the first, each
segment's time per tile and the tile's time outside its blocks (in blocks). Run one shape per trace: the lines do not
name it. tests/lab/test_fwd_segments.py fails once a change to the forward stops the patch from applying: apply it
with `git apply -3`, mend, and write it again from `git diff`.
"""
import argparse
import collections
from pathlib import Path

SEGMENTS = ("next tile", "Q wait", "Q fragments", "K wait", "turn wait", "first block", "key loop", "last P V",
            "row totals + P V wait", "O store")
LOOP = SEGMENTS.index("key loop")


def parse(lines):
    """(causal, options, consumer) -> [(tiles, blocks, [ns per segment])] from the TRACE lines."""
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
    """Tiles, blocks, ns per segment, ns per block of the loop, ns per tile outside its blocks."""
    tiles = sum(e[0] for e in entries)
    blocks = sum(e[1] for e in entries)
    ns = [sum(e[2][i] for e in entries) for i in range(len(SEGMENTS))]
    block_ns = ns[LOOP] / max(1, blocks - tiles)
    # The loop's passes each take S of one block and P V of the one before; the first block's S and the last P V
    # make up the tile's last block of work. The seam: the tile's time past its blocks at the loop's rate.
    outside = sum(ns) - blocks * block_ns
    return tiles, blocks, ns, block_ns, outside


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="the workload's output, with the kernel's TRACE lines")
    args = parser.parse_args()
    groups = parse(args.trace.read_text().splitlines())
    if not groups:
        raise SystemExit(f"{args.trace}: no TRACE lines (is fwd_segment_timer.patch applied and built?)")
    for (causal, options, consumer), entries in sorted(groups.items()):
        tiles, blocks, ns, block_ns, outside = summary(entries)
        print(f"causal {causal} options {options} consumer {consumer}: {blocks / tiles:.2f} blocks a tile, "
              f"{block_ns:.0f} ns a block after the first")
        print("  per tile, ns: " + ", ".join(f"{name} {t / tiles:.0f}" for name, t in zip(SEGMENTS, ns)))
        print(f"  outside the blocks: {outside / tiles:.0f} ns = {outside / tiles / block_ns:.2f} blocks a tile")


if __name__ == "__main__":
    main()
