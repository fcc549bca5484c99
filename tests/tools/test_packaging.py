"""The source distribution holds every source file the build reads (an sdist without the headers cannot be built)."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def checkout_files():
    """The checkout's files that git does not ignore (None outside a git checkout)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    return [name for name in listed.stdout.splitlines() if (ROOT / name).is_file()] if listed.returncode == 0 else None


def test_sdist_holds_every_source(tmp_path):
    files = checkout_files()
    if not files:
        pytest.skip("needs a git checkout")
    # A copy of the checkout without build leftovers: setuptools would also pack whatever an earlier build's
    # egg-info lists.
    tree = tmp_path / "tree"
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    env = dict(os.environ, FLASHATTN_BUILD_CUDA="0")
    build = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=tree, env=env,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = {name for name in files if name.startswith("csrc/")} - members
    assert not missing, sorted(missing)


def load_setup(monkeypatch, archs):
    """setup.py as a module (its setup() call runs under __main__ only), with FLASHATTN_CUDA_ARCHS set."""
    import importlib.util

    monkeypatch.setenv("FLASHATTN_CUDA_ARCHS", archs)
    spec = importlib.util.spec_from_file_location("flashattn_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("archs,want", [("80;90a", ["80", "90a"]), ("86, 89", ["86", "89"]), ("100", ["100"])])
def test_cuda_archs(monkeypatch, archs, want):
    assert load_setup(monkeypatch, archs).cuda_archs() == want


@pytest.mark.parametrize("archs", ["80a", "75", "sm_90a", "9.0a"])
def test_cuda_archs_refused(monkeypatch, archs):
    # nvcc has no compute_80a: arch-specific targets start at 90a.
    with pytest.raises(SystemExit, match="FLASHATTN_CUDA_ARCHS"):
        load_setup(monkeypatch, archs).cuda_archs()


def test_import_before_the_build_says_so(tmp_path):
    # The package's sources without the compiled library: "not built", not a circular-import riddle.
    shutil.copytree(ROOT / "flashattn_ext", tmp_path / "flashattn_ext", ignore=shutil.ignore_patterns("_C*", "*.so"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    # Python's own finders only: an editable install's finder would supply its checkout's library.
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if f.__module__.startswith('_frozen_importlib')]; "
            "import flashattn_ext")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "flashattn_ext._C) is not built" in result.stderr, result.stderr[-1000:]


def test_cuda_tensors_refused_without_cuda_kernels():
    # A build without CUDA kernels says so on a CUDA tensor (else: the dispatcher's "Could not run ... CUDA backend").
    # The registered kernel is called directly here, as no GPU may be present.
    import torch

    import flashattn_ext  # noqa: F401

    if torch.ops.flashattn.cuda_head_dims():
        pytest.skip("this build has CUDA kernels")
    q = torch.randn(1, 1, 4, 8)
    for op, args in (("fwd", (q, q, q)), ("fwd_kvcache", (q, q, q))):
        kernel = torch.library.get_kernel(f"flashattn::{op}", "CUDA")
        with pytest.raises(RuntimeError, match="built without CUDA kernels"):
            kernel.call_boxed(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), *args)
