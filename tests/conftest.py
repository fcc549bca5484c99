"""Shared pytest setup: per-test seeds, device/dtype parametrisation, markers, CUDA skips, poisoned memory.

A test that takes a ``device`` argument runs on every device of :func:`devices`; one that takes ``device`` and
``dtype`` runs on every (device, dtype) pair the backend supports (:data:`DTYPES`), narrowed with
``@pytest.mark.dtypes(cpu=[...], cuda=[...])`` (an empty list drops the device). Tests marked ``cuda`` (the CUDA
parameters included) are skipped when no GPU is visible.
"""
import json
import zlib
from pathlib import Path

import pytest
import torch

import flashattn_ext  # noqa: F401  (registers torch.ops.flashattn)
from reference import poison_free_cuda_memory

DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.float16, torch.bfloat16),
    "cuda": (torch.float16, torch.bfloat16),
}
DTYPE_IDS = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}


def devices():
    """The devices tests run on, as pytest params: cpu always, cuda marked ``cuda`` (skipped without a GPU)."""
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def device_dtypes(cpu=None, cuda=None):
    """(device, dtype) pytest params; ``cpu``/``cuda`` override the dtypes of that device."""
    chosen = {"cpu": DTYPES["cpu"] if cpu is None else cpu, "cuda": DTYPES["cuda"] if cuda is None else cuda}
    params = []
    for device_param in devices():
        device = device_param.values[0]
        for dtype in chosen[device]:
            params.append(pytest.param(device, dtype, id=f"{device}-{DTYPE_IDS[dtype]}", marks=device_param.marks))
    return params


def _explicitly_parametrized(metafunc, name):
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    names = metafunc.fixturenames
    if "device" not in names or _explicitly_parametrized(metafunc, "device"):
        return
    if "dtype" in names and not _explicitly_parametrized(metafunc, "dtype"):
        marker = metafunc.definition.get_closest_marker("dtypes")
        overrides = marker.kwargs if marker else {}
        metafunc.parametrize("device,dtype", device_dtypes(**overrides))
    else:
        metafunc.parametrize("device", devices())


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "dtypes(cpu=[...], cuda=[...]): the dtypes a (device, dtype) test runs with")
    config.addinivalue_line("markers", "large: needs FLASHATTN_TEST_LARGE=1 and tens of GiB of GPU memory")
    config.addinivalue_line("markers", "xdist_group(name): under pytest-xdist --dist loadgroup, one worker runs these")
    # Raised inside torch by torch.compile / opcheck, not by this project.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


# A build of some head-dim buckets only (FLASHATTN_HEADDIMS) raises this for the others: its tests of those head
# dims are skipped rather than failed, so that such a quick build can run the suite. A full build fails on it.
LEFT_OUT = "which this build left out (FLASHATTN_HEADDIMS at build time)"
ALL_BUCKETS = set(json.loads((Path(__file__).resolve().parents[1] / "csrc/cuda/kernels.json").read_text())["buckets"])
BUILT_BUCKETS = set(torch.ops.flashattn.cuda_head_dims())
PARTIAL_BUILD = bool(BUILT_BUCKETS) and BUILT_BUCKETS != ALL_BUCKETS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if PARTIAL_BUILD and report.failed and call.excinfo is not None and LEFT_OUT in str(call.excinfo.value):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, "a head-dim bucket this build left out")


@pytest.fixture(autouse=True)
def seed(request):
    """Seed every RNG from the test id: each test gets fresh, reproducible inputs independent of test order."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def poisoned_cuda_memory(request):
    """A CUDA test starts with the caching allocator's free memory all NaN bytes (reference.poison_free_cuda_memory;
    isolated.py's processes likewise): an output or workspace a kernel leaves unwritten reads NaN and fails the test."""
    if request.node.get_closest_marker("cuda") is not None and torch.cuda.is_available():
        poison_free_cuda_memory()
    yield


@pytest.fixture(autouse=True)
def poisoned_cpu_memory(request):
    """A test off the GPU runs with torch's deterministic algorithms on, whose fill of uninitialized memory makes every
    at::empty of the CPU kernels NaN (integers their maximum): an output they leave unwritten fails the test. The CPU
    kernels are deterministic by construction and do not read the switch."""
    if request.node.get_closest_marker("cuda") is not None:
        yield
        return
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture
def deterministic_algorithms(monkeypatch):
    """torch.use_deterministic_algorithms(True) for one test (cuBLAS needs CUBLAS_WORKSPACE_CONFIG for it)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
