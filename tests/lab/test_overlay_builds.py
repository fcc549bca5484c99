"""benchmarks/lab/overlay_builds.py on the CPU: the overlays it exports from git, laying one over a checkout and putting
the checkout back, and the command it runs per build (the builds themselves need the CUDA toolchain)."""
import shutil
import subprocess

import pytest

from scripts import load_benchmark

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


@pytest.fixture(scope="module")
def overlay_builds():
    return load_benchmark("overlay_builds")


def git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


@pytest.fixture
def checkout(tmp_path):
    """A repository whose branch `change` edits a.txt, adds dir/new.txt and deletes c.txt; HEAD stays on the first
    commit."""
    root = tmp_path / "repo"
    (root / "dir").mkdir(parents=True)
    (root / "a.txt").write_text("a before\n")
    (root / "dir" / "b.txt").write_text("b\n")
    (root / "c.txt").write_text("c\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    git(root, "checkout", "-q", "-b", "change")
    (root / "a.txt").write_text("a after\n")
    (root / "dir" / "new.txt").write_text("new\n")
    (root / "c.txt").unlink()
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "change")
    git(root, "checkout", "-q", "-")
    return root


def test_export_writes_the_refs_files_and_lists_its_deletions(overlay_builds, checkout, tmp_path):
    overlays = tmp_path / "overlays"
    written, deleted = overlay_builds.export("v", "change", root=checkout, overlays=overlays)
    assert sorted(written) == ["a.txt", "dir/new.txt"] and deleted == ["c.txt"]
    assert (overlays / "v" / "a.txt").read_text() == "a after\n"
    assert not (overlays / "v" / "dir" / "b.txt").exists()  # unchanged files stay out of the overlay
    assert overlay_builds.overlay_files(overlays / "v") == (["a.txt", "dir/new.txt"], ["c.txt"])
    # Exporting again replaces the overlay: a ref equal to HEAD leaves it empty.
    assert overlay_builds.export("v", "HEAD", root=checkout, overlays=overlays) == ([], [])
    assert overlay_builds.overlay_files(overlays / "v") == ([], [])


def test_an_overlay_is_laid_and_the_checkout_put_back_even_after_an_error(overlay_builds, checkout, tmp_path):
    overlays = tmp_path / "overlays"
    overlay_builds.export("v", "change", root=checkout, overlays=overlays)
    with pytest.raises(RuntimeError, match="build failed"):
        with overlay_builds.Laid(overlays / "v", root=checkout):
            assert (checkout / "a.txt").read_text() == "a after\n"
            assert (checkout / "dir" / "new.txt").read_text() == "new\n"
            assert not (checkout / "c.txt").exists()
            raise RuntimeError("build failed")
    assert (checkout / "a.txt").read_text() == "a before\n"
    assert not (checkout / "dir" / "new.txt").exists()
    assert (checkout / "c.txt").read_text() == "c\n"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True,
                          text=True).stdout == ""


def test_run_fills_the_placeholders_and_puts_the_build_first_on_the_path(overlay_builds, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    args, env = overlay_builds.run_command(["bench", "--out", "out/{name}_{round}.csv"], "v2", 3, builds=tmp_path)
    assert args == ["bench", "--out", "out/v2_3.csv"]
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "v2"), "/elsewhere"]
    assert env["PYTHONSAFEPATH"] == "1"  # else `python -m` puts the checkout's own package first
