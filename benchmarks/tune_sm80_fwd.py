"""Tile tuning for the sm80 forward: build variants of FwdTraits in scratch copies and benchmark each against SDPA.

A variant is "D MT NW BN MINB": head-dim bucket, m16 tiles per warp, warps per CTA, keys per block, minimum CTAs
per SM (FwdTraits in csrc/cuda/sm80/fwd_kernel.h). Each variant is a copy of this checkout under --scratch with
those four traits replaced by constants, built for that head dim only, then timed with bench_sdpa.py in its own
process. Builds run in parallel. Used for the figures in benchmarks/NOTES.md; one GPU call tunes several variants:

    python benchmarks/tune_sm80_fwd.py "128 2 4 64 2" "128 2 4 32 2" "256 1 8 64 1"
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAITS = {"kMTiles": 1, "kNWarps": 2, "kBlockN": 3, "kMinBlocksPerSM": 4}  # trait -> index in the variant


def make_variant(spec: list, scratch: Path) -> Path:
    root = scratch / "_".join(spec)
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(REPO, root, ignore=shutil.ignore_patterns(".git", "build", "*.so", "results", "*.egg-info"))
    header = root / "csrc/cuda/sm80/fwd_kernel.h"
    text = header.read_text()
    for trait, index in TRAITS.items():
        text, count = re.subn(rf"static constexpr int {trait} = [^;]+;", f"static constexpr int {trait} = {spec[index]};",
                              text)
        if count != 1:
            raise SystemExit(f"{trait} not found exactly once in {header}")
    header.write_text(text)
    return root


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help='"D MT NW BN MINB", e.g. "128 2 4 64 2"')
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/flashattn_tune"))
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--archs", default="90a", help="FLASHATTN_CUDA_ARCHS of the variant builds")
    args = parser.parse_args()

    specs = [v.split() for v in args.variants]
    builds = []
    for spec in specs:
        if len(spec) != 5:
            raise SystemExit(f"variant {spec}: expected 5 numbers D MT NW BN MINB")
        root = make_variant(spec, args.scratch)
        env = dict(os.environ, FLASHATTN_HEADDIMS=spec[0], FLASHATTN_CUDA_ARCHS=args.archs, MAX_JOBS="4")
        log = open(root / "build.log", "w")
        builds.append((spec, root, subprocess.Popen([sys.executable, "setup.py", "build_ext", "--inplace"],
                                                    cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)))
    for spec, root, proc in builds:
        status = "ok" if proc.wait() == 0 else "FAILED"
        spills = sorted({line.strip() for line in open(root / "build.log") if "bytes spill" in line})
        print(f"variant {' '.join(spec)}: build {status}; {spills[:1] or 'no spill report'}", flush=True)
    for spec, root, proc in builds:
        if proc.returncode != 0:
            continue
        print(f"=== variant D MT NW BN MINB = {' '.join(spec)}", flush=True)
        subprocess.run([sys.executable, str(REPO / "benchmarks/bench_sdpa.py"), "--head-dims", spec[0], "--lengths",
                        args.lengths, "--backends", "flash,cudnn", "--naive-mem-gib", "0", "--no-plot", "--out",
                        str(root / "results")], env=dict(os.environ, PYTHONPATH=str(root)), check=False)


if __name__ == "__main__":
    main()
