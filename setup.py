"""Build flashattn_ext._C: the op schemas, the CPU kernels and (when nvcc is present) the CUDA kernels.

Environment variables (all optional):
  FLASHATTN_BUILD_CUDA   "0" builds the CPU backend only, "1" CUDA too; default: CUDA where torch has it and nvcc
                         is found (a CPU-only build says so).
  FLASHATTN_CUDA_ARCHS   e.g. "80;90a" (80 and newer). Default: the visible GPU's arch ("90a" on Hopper), else
                         "80;90a".
                         The sm_80 cubin also runs on sm_86/sm_89; sm_90a is Hopper's own target.
  FLASHATTN_HEADDIMS     head-dim buckets to compile, e.g. "64,128" for a quick build. Default: all of
                         32,64,96,128,160,192,224,256. A head dim whose bucket is not built raises an error.
  FLASHATTN_PTXAS_VERBOSE "1" prints ptxas register/spill reports for every kernel.
  MAX_JOBS               parallel compile jobs (ninja).
"""
import json
import os
import re
import sys
from importlib import metadata
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
# Which head dims each CUDA kernel is built for: the one table, which generate_instantiations.py also reads.
KERNEL_TABLE = json.loads((ROOT / "csrc" / "cuda" / "kernels.json").read_text())
ALL_HEADDIMS = tuple(KERNEL_TABLE["buckets"])


def read_version():
    text = (ROOT / "flashattn_ext" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def cuda_archs():
    env = os.environ.get("FLASHATTN_CUDA_ARCHS")
    if env:
        archs = [a.strip() for a in env.replace(",", ";").split(";") if a.strip()]
        # The "a" (arch-specific) targets begin at sm_90a: nvcc has no compute_80a.
        bad = [a for a in archs
               if not re.fullmatch(r"\d{2,3}a?", a) or int(a.rstrip("a")) < (90 if a.endswith("a") else 80)]
        if bad or not archs:
            raise SystemExit(f"FLASHATTN_CUDA_ARCHS: {bad or env!r} are not archs of sm_80 or newer, written as 80, "
                             "86, 90a ...")
        if "90" in archs and "90a" not in archs:
            print("FLASHATTN_CUDA_ARCHS: 90 builds the portable kernels only; the Hopper (TMA + wgmma) kernels need "
                  "90a", file=sys.stderr)
        return archs
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if major >= 8:
            return ["90a"] if (major, minor) == (9, 0) else [f"{major}{minor}"]
    return ["80", "90a"]


def headdims():
    env = os.environ.get("FLASHATTN_HEADDIMS")
    if not env:
        return list(ALL_HEADDIMS)
    try:
        dims = sorted({int(d) for d in env.replace(";", ",").split(",") if d.strip()})
    except ValueError:
        raise SystemExit(f"FLASHATTN_HEADDIMS: {env!r} is not a list of buckets such as 64,128") from None
    bad = [d for d in dims if d not in ALL_HEADDIMS]
    if bad or not dims:
        raise SystemExit(f"FLASHATTN_HEADDIMS: {bad or env!r} are not buckets; choose from {ALL_HEADDIMS}")
    return dims


def build_cuda():
    """Whether the CUDA kernels are built: FLASHATTN_BUILD_CUDA decides; else where torch has CUDA and nvcc is found."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    flag = os.environ.get("FLASHATTN_BUILD_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        raise SystemExit(f"FLASHATTN_BUILD_CUDA must be 0 or 1, got {flag!r}")
    if flag == "0":
        return False
    if torch.version.cuda is None:
        if flag == "1":
            raise SystemExit(f"FLASHATTN_BUILD_CUDA=1, but this torch ({torch.__version__}) is built without CUDA")
        why = f"torch {torch.__version__} is built without CUDA"
    elif CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        if flag == "1":
            return True  # torch's extension build reports the missing toolkit
        why = "no nvcc found (set CUDA_HOME)"
    else:
        return True
    print(f"flashattn_ext: building the CPU backend only ({why}); CUDA tensors will raise", file=sys.stderr)
    return False


def make_extension():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    # The stable ABI (py_limited_api, as pytorch/extension-cpp builds; torch defines Py_LIMITED_API for 3.10): the
    # library uses no Python API beyond creating an empty module, so one build loads on every CPython >= 3.10.
    cxx_flags = ["-O3", "-std=c++17"]
    sources = ["csrc/flashattn.cpp", "csrc/autocast.cpp", "csrc/autograd.cpp", "csrc/cpu/attention_cpu.cpp"]
    if not build_cuda():
        return CppExtension(
            "flashattn_ext._C",
            sources,
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args={"cxx": cxx_flags},
            py_limited_api=True,
        )

    dims = headdims()
    archs = cuda_archs()
    with_sm90 = "90a" in archs  # the Hopper kernels need sm_90a's wgmma/setmaxnreg
    # One generated file per (kernel, dtype, head dim, causal): see csrc/cuda/generate_instantiations.py. Each bucket
    # runs in the smallest Hopper kernel head dim that holds it (kernels.json).
    sm90_dims = {min(h for h in KERNEL_TABLE["fwd_sm90"] if h >= d) for d in dims}
    decode_dims = {min(h for h in KERNEL_TABLE["decode"] if h >= d) for d in dims}
    for path in sorted((ROOT / "csrc/cuda/instantiations").glob("*.cu")):
        m = re.search(r"_hdim(\d+)_", path.name)
        if not m:
            continue
        if "_sm90_" in path.name:
            wanted = with_sm90 and int(m.group(1)) in sm90_dims
        elif path.name.startswith("decode_"):
            wanted = int(m.group(1)) in decode_dims
        else:
            wanted = int(m.group(1)) in dims
        if wanted:
            sources.append(str(path.relative_to(ROOT)))
    sources += ["csrc/cuda/flash_api.cpp", "csrc/cuda/bwd_chunked.cpp", "csrc/cuda/bwd_preprocess.cu",
                "csrc/cuda/bwd_postprocess.cu", "csrc/cuda/decode_combine.cu",
                "csrc/cuda/kvcache_append.cu"]
    if with_sm90:
        sources.append("csrc/cuda/sm90/sequences.cu")

    # Read by the dispatch in flash_api.cpp (host compiler only: nvcc would split the value at its commas).
    built_headdims = f"-DFLASHATTN_BUILT_HEADDIMS={','.join(map(str, dims))}"
    host_defines = [built_headdims] + (["-DFLASHATTN_WITH_SM90"] if with_sm90 else [])
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        "-Xptxas=-warn-spills",
    ]
    for arch in archs:
        nvcc_flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    if os.environ.get("FLASHATTN_PTXAS_VERBOSE") == "1":
        nvcc_flags.append("-Xptxas=-v")
    return CUDAExtension(
        "flashattn_ext._C",
        sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": cxx_flags + host_defines, "nvcc": nvcc_flags},
        py_limited_api=True,
    )


def main():
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        raise SystemExit("flashattn_ext builds against the torch it will run with, which must be importable here: "
                         "pip install --no-build-isolation ...") from None

    setup(
        name="flashattn_ext",
        version=read_version(),
        packages=find_packages(include=["flashattn_ext", "flashattn_ext.*"]),
        ext_modules=[make_extension()],
        # The binary loads only with the torch it is built against.
        install_requires=[f"torch=={metadata.version('torch')}"],
        cmdclass={"build_ext": BuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )


if __name__ == "__main__":
    main()
