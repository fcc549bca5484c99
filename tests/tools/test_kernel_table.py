"""csrc/cuda/kernels.json is the one table of which head dims the CUDA kernels are built for: the generated header and
instantiations match it (run csrc/cuda/generate_instantiations.py after editing it), and setup.py reads it."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_match_the_table():
    generator = load(ROOT / "csrc" / "cuda" / "generate_instantiations.py", "generate_instantiations")
    files = generator.rendered()
    for path, text in files.items():
        assert path.read_text() == text, f"{path.name} is stale: run csrc/cuda/generate_instantiations.py"
    on_disk = set((ROOT / "csrc" / "cuda" / "instantiations").glob("*.cu"))
    assert on_disk == {p for p in files if p.suffix == ".cu"}, "instantiations/ holds files the table does not name"


def test_setup_reads_the_table():
    text = (ROOT / "setup.py").read_text()
    assert "kernels.json" in text and not re.search(r"ALL_HEADDIMS = \(\d", text)
