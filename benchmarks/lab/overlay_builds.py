"""Builds of a few variants of the tree in one checkout, each compiled incrementally over the one before, and a command
run against each in turns: an A/B of kernel changes on a GPU machine that has the tree but not its git history.

Where git is, `export NAME=REF ...` writes the files in which REF differs from the checkout's HEAD into
.overlays/NAME/ (the files REF lacks are listed in .overlays/NAME/DELETED); .overlays/ is ignored by git, so send it
with the tree. On the GPU machine `build` builds the checkout in place and keeps its package as build/overlays/base,
then lays each overlay over the checkout in turn, builds again (ninja recompiles only what the overlay's files reach:
a decode kernel's change took 8-30 s on 16 cores, where a build of its own took minutes), keeps build/overlays/NAME and
puts the checkout's files back; a last build leaves the checkout's own extension in place. `run` runs a command for
each build, `--rounds` times in turns, with that build first on PYTHONPATH; `{name}` and `{round}` in the command are
replaced by the build's name and the round.

    python benchmarks/lab/overlay_builds.py export ring2=decode-ring2 split3=decode-split3
    FLASHATTN_HEADDIMS=128 python benchmarks/lab/overlay_builds.py build
    python benchmarks/lab/overlay_builds.py run --rounds 2 -- \\
        python benchmarks/bench_decode.py --batches 1,8 --no-plot --out out/{name}_{round}
"""
import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / ".overlays"
BUILDS = ROOT / "build" / "overlays"
PACKAGE = "flashattn_ext"
DELETED = "DELETED"


def git(*args, cwd=ROOT, text=True):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=text).stdout


def export(name, ref, root=ROOT, overlays=OVERLAYS):
    """Writes REF's versions of the files in which it differs from HEAD to overlays/name (and DELETED, the files REF
    lacks); returns the paths written and deleted."""
    target = overlays / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    written, deleted = [], []
    for line in git("diff", "--name-status", "--no-renames", "HEAD", ref, cwd=root).splitlines():
        status, path = line.split("\t")
        if status == "D":
            deleted.append(path)
            continue
        dest = target / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(git("show", f"{ref}:{path}", cwd=root, text=False))
        written.append(path)
    if deleted:
        (target / DELETED).write_text("".join(p + "\n" for p in deleted))
    return written, deleted


def overlay_files(overlay):
    """An overlay's files (paths relative to the checkout) and the files it deletes."""
    files = sorted(str(p.relative_to(overlay)) for p in overlay.rglob("*") if p.is_file() and p != overlay / DELETED)
    deleted_list = overlay / DELETED
    deleted = deleted_list.read_text().split() if deleted_list.exists() else []
    return files, deleted


class Laid:
    """The checkout with an overlay laid over it; leaving puts back the checkout's files (those the overlay replaced
    or deleted, and removes those it added)."""

    def __init__(self, overlay, root=ROOT):
        self.overlay, self.root = overlay, root
        self.files, self.deleted = overlay_files(overlay)
        self.saved = {}

    def __enter__(self):
        for path in self.files + self.deleted:
            target = self.root / path
            self.saved[path] = target.read_bytes() if target.exists() else None
        for path in self.files:
            target = self.root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.overlay / path, target)
        for path in self.deleted:
            (self.root / path).unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        for path, content in self.saved.items():
            target = self.root / path
            if content is None:
                target.unlink(missing_ok=True)
            else:
                target.write_bytes(content)  # a new mtime: the next build recompiles what it reaches


def build_in_place(log):
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"the build failed: see {log}")


def keep(name, builds=BUILDS, root=ROOT):
    """Copies the checkout's package (its extension built in place) to builds/name."""
    target = builds / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root / PACKAGE, target / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))


def overlay_names(names, overlays=OVERLAYS):
    found = sorted(p.name for p in overlays.iterdir() if p.is_dir()) if overlays.is_dir() else []
    unknown = [n for n in names if n not in found]
    if unknown:
        raise SystemExit(f"no overlay {', '.join(unknown)} in {overlays} (export it first)")
    return names or found


def build(names):
    names = overlay_names(names)
    BUILDS.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    build_in_place(BUILDS / "base.log")
    keep("base")
    print(f"built base at {time.monotonic() - start:.0f} s", flush=True)
    for name in names:
        with Laid(OVERLAYS / name):
            build_in_place(BUILDS / f"{name}.log")
            keep(name)
        print(f"built {name} at {time.monotonic() - start:.0f} s", flush=True)
    if names:
        build_in_place(BUILDS / "checkout.log")  # the checkout's own sources, built in place again
        print(f"rebuilt the checkout at {time.monotonic() - start:.0f} s", flush=True)


def run_command(command, name, round_, builds=BUILDS):
    """The command for one build and round: placeholders filled, that build first on PYTHONPATH and the working
    directory kept off the path (PYTHONSAFEPATH: `python -m` would find the checkout's package before it)."""
    args = [a.replace("{name}", name).replace("{round}", str(round_)) for a in command]
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(builds / name), env.get("PYTHONPATH")) if p)
    return args, env


def run(command, names, rounds):
    built = sorted(p.name for p in BUILDS.iterdir() if p.is_dir() and p.name != "base") if BUILDS.is_dir() else []
    builds = names or ["base"] + built
    missing = [n for n in builds if not (BUILDS / n / PACKAGE).is_dir()]
    if missing:
        raise SystemExit(f"not built: {', '.join(missing)} (run `build` first)")
    status = 0
    for round_ in range(1, rounds + 1):
        for name in builds:
            print(f"== {name} round {round_}", flush=True)
            args, env = run_command(command, name, round_)
            status = subprocess.run(args, cwd=ROOT, env=env).returncode or status
    return status


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("export", help="NAME=REF ...: REF's files that differ from HEAD into .overlays/NAME")
    p.add_argument("pairs", nargs="+")
    p = sub.add_parser("build", help="the checkout, then each overlay (all, or those named) incrementally")
    p.add_argument("names", nargs="*")
    p = sub.add_parser("run", help="a command per build and round: run [--builds a,b] [--rounds N] -- command ...")
    p.add_argument("--builds", default="", help="comma list (default: base, then every overlay built)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.step == "export":
        for pair in args.pairs:
            name, sep, ref = pair.partition("=")
            if not sep or not name or not ref or name == "base":
                raise SystemExit(f"{pair!r}: give NAME=REF (a name other than base)")
            written, deleted = export(name, ref)
            print(f"{name}: {len(written)} files from {ref}, {len(deleted)} deleted")
    elif args.step == "build":
        build(args.names)
    else:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise SystemExit("run: give the command after --")
        sys.exit(run(command, [n for n in args.builds.split(",") if n], args.rounds))


if __name__ == "__main__":
    main()
