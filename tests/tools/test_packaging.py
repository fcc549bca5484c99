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
