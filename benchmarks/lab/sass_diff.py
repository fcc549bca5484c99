"""Machine code of two source trees compared, instantiation by instantiation: is a change that should leave the kernels
alone really without effect, and where it is not, how far it reaches.

Each tree's generated instantiations (csrc/cuda/instantiations/*.cu, filtered by --only) are compiled for sm_90a with
the build's nvcc flags, and their SASS (cuobjdump) is compared with addresses and encodings left out. Per file it prints
"same" or the number of differing lines, also with register names and constants left out ("shape"), and for each
kernel the size of its innermost loop that issues wgmma (the key loop) in both trees.

    python benchmarks/lab/sass_diff.py /tmp/before . --only "fwd_sm90_*"

Needs nvcc, cuobjdump and nvdisasm (CUDA toolkit; on a machine without them, PyPI's nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels carry the two tools).
"""
import argparse
import concurrent.futures
import difflib
import os
import re
import subprocess
import tempfile
from pathlib import Path

NVCC_FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "--expt-relaxed-constexpr", "-lineinfo",
              "-gencode=arch=compute_90a,code=sm_90a"]
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")


def sass(tree: Path, source: Path, cubin: Path):
    """{kernel name: [(address, instruction)]} of one instantiation, compiled into `cubin`."""
    subprocess.run(["nvcc", *NVCC_FLAGS, f"-I{tree / 'csrc'}", "-cubin", "-o", str(cubin), str(source)], check=True)
    text = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    kernels, name = {}, None
    for line in text.splitlines():
        found = re.search(r"Function : (\S+)", line)
        if found:
            name = found.group(1)
            kernels[name] = []
        elif name and (match := INSTRUCTION.match(line)):
            kernels[name].append((int(match.group(1), 16), match.group(2)))
    return kernels


def shape(instruction: str) -> str:
    """The instruction with registers, predicates and constants left out."""
    text = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[]", instruction)
    text = re.sub(r"\bU?[RPB]\d+\b", "R", text)
    return re.sub(r"0x[0-9a-f]+", "N", text.replace(".reuse", ""))


def key_loop(instructions):
    """Instruction count of the shortest backward branch's span that issues wgmma (HGMMA), or 0."""
    best = 0
    for address, text in instructions:
        target = re.search(r"\bBRA 0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) <= address:
            span = [t for a, t in instructions if int(target.group(1), 16) <= a <= address]
            if any("HGMMA" in t for t in span) and (best == 0 or len(span) < best):
                best = len(span)
    return best


def changed_lines(a, b):
    return sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def compare(before: Path, after: Path, name: str, scratch: Path) -> str:
    old = sass(before, before / "csrc/cuda/instantiations" / name, scratch / f"before_{name}.cubin")
    new = sass(after, after / "csrc/cuda/instantiations" / name, scratch / f"after_{name}.cubin")
    old_code = [t for kernel in old.values() for _, t in kernel]
    new_code = [t for kernel in new.values() for _, t in kernel]
    if old_code == new_code:
        return f"{name}: same ({len(old)} kernels)"
    lines = [f"{name}: {changed_lines(old_code, new_code)} lines differ, "
             f"{changed_lines([shape(t) for t in old_code], [shape(t) for t in new_code])} by shape; "
             f"{len(old_code)} -> {len(new_code)} instructions"]
    for (old_name, old_kernel), new_kernel in zip(old.items(), new.values()):
        lines.append(f"  {old_name[-60:]}: key loop {key_loop(old_kernel)} -> {key_loop(new_kernel)}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="source tree (a checkout) before the change")
    parser.add_argument("after", type=Path, help="source tree after it")
    parser.add_argument("--only", default="*", help="glob of instantiation file names (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compiles")
    args = parser.parse_args()
    before, after = args.before.resolve(), args.after.resolve()
    names = sorted(p.name for p in (after / "csrc/cuda/instantiations").glob(f"{args.only}.cu")
                   if (before / "csrc/cuda/instantiations" / p.name).exists())
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for report in pool.map(lambda n: compare(before, after, n, Path(tmp)), names):
            print(report, flush=True)


if __name__ == "__main__":
    main()
