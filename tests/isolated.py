"""Runs a function of a test module in a fresh Python process with extra environment variables.

The extension reads its switches (FLASHATTN_*) once per process, at the first call, so a test that compares switch
settings runs each setting in a process of its own. Arguments and results travel through torch.save (CUDA tensors
come back on the GPU)."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import flashattn_ext

TESTS = Path(__file__).resolve().parent
# The caller's extension (installed, built in place or found on PYTHONPATH) leads the child's path, so that both
# processes run the same build: with the tree first, a build outside it met the tree's unbuilt package.
PACKAGE_ROOT = Path(flashattn_ext.__file__).resolve().parent.parent


def run_isolated(env, module, function, *args, timeout=600):
    """`module.function(*args)` (module: a file under tests/, as a dotted path from there) in a fresh process with
    `env` added to the environment; returns its result, or raises RuntimeError with the process's stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
        torch.save(args, inputs)
        code = (
            "import sys, torch\n"
            f"sys.path[:0] = [{str(TESTS)!r}]\n"
            f"import {module} as m\n"
            "from reference import poison_free_cuda_memory\n"
            "if torch.cuda.is_available(): poison_free_cuda_memory()\n"
            f"torch.save(m.{function}(*torch.load({str(inputs)!r})), {str(outputs)!r})\n"
        )
        paths = [str(TESTS), str(PACKAGE_ROOT), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **env)
        result = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                                timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{module}.{function} under {env} failed:\n{result.stderr[-4000:]}")
        return torch.load(outputs)
