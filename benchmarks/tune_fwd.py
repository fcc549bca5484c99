"""Tile tuning for the forward kernels: build variants of a FwdTraits in scratch copies, benchmark each against SDPA.

A variant is "KERNEL D NAME=VALUE ...": the kernel (sm80 or sm90), the head-dim bucket, and FwdTraits constants to
replace (csrc/cuda/sm80/fwd_kernel.h: kMTiles, kNWarps, kBlockN, kMinBlocksPerSM; csrc/cuda/sm90/fwd_kernel.h:
kConsumers, kBlockN, kStages (with kBarrierBytes=512 where more stages need more mbarriers), kQStages, kPingPong,
kSoftmaxUnderPV, kOptimisticExp and the other switches). Each variant is a copy of this checkout under --scratch with
those constants replaced, built for that head dim only, then timed with bench_sdpa.py in its own process. Builds run in
parallel; --repeats times every variant again in later rounds. A variant without replacements is the checkout as it is
(the baseline of the same run). A kBlockN replacement applies to every key-block variant of that head dim (at D256 both
the 64- and the 80-key kernel that run_fwd_sm90 chooses between by L_k), and a kConsumers one to every kernel of that
head dim (at D64 causal both the two- and the three-consumer kernel; a height that disagrees with launch.h's
sm90_causal_block_m fails at launch). Used for the figures in benchmarks/NOTES.md; one GPU call tunes several variants:

    python benchmarks/tune_fwd.py "sm90 128" "sm90 128 kBlockN=176" "sm80 128 kMTiles=2 kNWarps=4 kBlockN=64"
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEADERS = {"sm80": "csrc/cuda/sm80/fwd_kernel.h", "sm90": "csrc/cuda/sm90/fwd_kernel.h"}


def make_variant(kernel: str, overrides: dict, root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(REPO, root, ignore=shutil.ignore_patterns(".git", "build", "*.so", "results", "*.egg-info",
                                                              ".gpuwork"))
    header = root / HEADERS[kernel]
    text = header.read_text()
    for name, value in overrides.items():
        text, count = re.subn(rf"static constexpr (int|bool) {name} = [^;]+;",
                              rf"static constexpr \1 {name} = {value};", text)
        if count != 1:
            raise SystemExit(f"{name} not found exactly once in {header}")
    header.write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help='"KERNEL D NAME=VALUE ...", e.g. "sm90 128 kBlockN=176"')
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/flashattn_tune"))
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--causal", default="both", choices=("both", "on", "off"))
    parser.add_argument("--archs", default="90a", help="FLASHATTN_CUDA_ARCHS of the variant builds")
    parser.add_argument("--jobs", default="4", help="MAX_JOBS of each variant build")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time every variant this many times, in rounds (run-to-run noise is a few percent)")
    parser.add_argument("--backends", default="flash,cudnn", help="SDPA backends timed next to each variant")
    args = parser.parse_args()

    builds = []
    for index, variant in enumerate(args.variants):
        kernel, head_dim, *pairs = variant.split()
        if kernel not in HEADERS or not head_dim.isdigit() or not all("=" in pair for pair in pairs):
            raise SystemExit(f'variant "{variant}": expected "sm80|sm90 D NAME=VALUE ..."')
        root = args.scratch / f"variant{index}"
        make_variant(kernel, dict(pair.split("=", 1) for pair in pairs), root)
        env = dict(os.environ, FLASHATTN_HEADDIMS=head_dim, FLASHATTN_CUDA_ARCHS=args.archs, MAX_JOBS=args.jobs,
                   FLASHATTN_PTXAS_VERBOSE="1")
        log = open(root / "build.log", "w")
        proc = subprocess.Popen([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        builds.append((variant, kernel, head_dim, root, proc))
    for variant, _, _, root, proc in builds:
        status = "ok" if proc.wait() == 0 else "FAILED"
        log = (root / "build.log").read_text()
        spills = sorted(set(re.findall(r"\d+ bytes spill stores", log)) - {"0 bytes spill stores"})
        print(f"variant [{variant}]: build {status}; spills: {spills or 'none'}", flush=True)
    for run, (variant, kernel, head_dim, root, proc) in enumerate(builds * args.repeats):
        if proc.returncode != 0:
            continue
        print(f"=== variant [{variant}]" + (f" (round {run // len(builds) + 1})" if args.repeats > 1 else ""),
              flush=True)
        env = dict(os.environ, PYTHONPATH=str(root), FLASHATTN_FWD_SM90="strict" if kernel == "sm90" else "0")
        subprocess.run([sys.executable, str(REPO / "benchmarks/bench_sdpa.py"), "--head-dims", head_dim, "--lengths",
                        args.lengths, "--causal", args.causal, "--backends", args.backends, "--naive-mem-gib", "0",
                        "--no-plot", "--out", str(root / "results")], env=env, check=False)


if __name__ == "__main__":
    main()
