"""Where a kernel's warps wait, per SASS instruction and per stretch of code, from Nsight Compute's source page.

Take the profile with per-instruction sampling and export its SASS source page as CSV (plain or gzipped):

    ncu --set full --import-source yes -k regex:flash_fwd_sm90 -c 1 -o /tmp/fwd \\
        python benchmarks/lab/profile_fwd.py --head-dim 256 --lengths 2048
    ncu -i /tmp/fwd.ncu-rep --page source --csv --print-source sass > source.csv
    python benchmarks/lab/ncu_stalls.py source.csv

It prints the stall reasons over all samples, the instructions with the most samples, and the stretches of code
(consecutive instructions run equally often: a loop body, a once-per-tile epilogue) with their samples. The execution
count with the most samples is taken as the hot loop; each stretch's cost per execution is also given in passes of that
loop (its samples per execution over the loop's), which is how benchmarks/lab/LOG.md (v27) counts a tile's seam in
key-block times.
"""
import argparse
import collections
import csv
import gzip
import io
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_rows(text):
    """The source page's rows as dicts (the first line names the kernel; the header follows)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    for row in rows:
        row[SAMPLES] = int(row[SAMPLES] or 0)
        row[EXECUTED] = int(row[EXECUTED] or 0)
    return rows


def stall_columns(rows):
    return [name for name in rows[0] if name.startswith("stall_") and "(Not Issued)" not in name]


def stretches(rows):
    """Maximal runs of consecutive instructions with one execution count: (first, last, executions, samples)."""
    runs = []
    for index, row in enumerate(rows):
        if runs and runs[-1][2] == row[EXECUTED]:
            first, _, executed, samples = runs[-1]
            runs[-1] = (first, index, executed, samples + row[SAMPLES])
        else:
            runs.append((index, index, row[EXECUTED], row[SAMPLES]))
    return runs


def hot_loop(rows):
    """The execution count whose instructions hold the most samples, and those samples."""
    by_count = collections.Counter()
    for row in rows:
        by_count[row[EXECUTED]] += row[SAMPLES]
    executed, samples = max(by_count.items(), key=lambda item: item[1])
    return executed, samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="the source page as CSV (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=20, help="instructions listed")
    parser.add_argument("--min-share", type=float, default=0.5, help="stretches listed: at least this %% of samples")
    args = parser.parse_args()

    raw = args.csv.read_bytes()
    rows = read_rows((gzip.decompress(raw) if args.csv.suffix == ".gz" else raw).decode())
    total = sum(row[SAMPLES] for row in rows)
    stalls = stall_columns(rows)
    print(f"{len(rows)} instructions, {total} samples")
    reasons = collections.Counter({name: sum(int(row[name] or 0) for row in rows) for name in stalls})
    for name, count in reasons.most_common(8):
        print(f"  {name[len('stall_'):]:18s} {100 * count / total:5.1f}%")

    loop_executed, loop_samples = hot_loop(rows)
    per_pass = loop_samples / loop_executed  # samples per execution of the hot loop's instructions
    print(f"\nhot loop: instructions run {loop_executed} times, {100 * loop_samples / total:.1f}% of the samples")
    print(f"\n{'stretch':>11s} {'executed':>9s} {'samples':>8s} {'share':>6s} {'loop passes':>11s}  top instruction")
    for first, last, executed, samples in stretches(rows):
        if 100 * samples / total < args.min_share or executed == 0:
            continue
        passes = samples / executed / per_pass
        top = max(rows[first:last + 1], key=lambda row: row[SAMPLES])
        print(f"{first:5d}-{last:<5d} {executed:9d} {samples:8d} {100 * samples / total:5.1f}% {passes:11.2f}  "
              f"{top['Source'].strip()[:60]}")

    print(f"\n{'index':>5s} {'share':>6s} {'executed':>9s}  instruction / top stall reasons")
    ranked = sorted(range(len(rows)), key=lambda index: -rows[index][SAMPLES])[:args.top]
    for index in ranked:
        row = rows[index]
        top = sorted(((int(row[name] or 0), name[len("stall_"):]) for name in stalls), reverse=True)[:2]
        reasons_text = ", ".join(f"{name} {count}" for count, name in top if count)
        print(f"{index:5d} {100 * row[SAMPLES] / total:5.2f}% {row[EXECUTED]:9d}  {row['Source'].strip()[:60]}"
              f"  [{reasons_text}]")


if __name__ == "__main__":
    main()
