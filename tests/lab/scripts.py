"""The benchmarks/lab/ scripts loaded as modules, for CPU tests of their parts that need no GPU."""
import importlib.util
import types
from pathlib import Path

LAB = Path(__file__).resolve().parents[2] / "benchmarks" / "lab"


def load_benchmark(name: str) -> types.ModuleType:
    """benchmarks/lab/<name>.py as a module (its main() not run)."""
    spec = importlib.util.spec_from_file_location(name, LAB / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
