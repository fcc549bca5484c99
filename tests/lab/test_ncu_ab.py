"""benchmarks/lab/ncu_ab.py on the CPU: its parsing of Nsight Compute's CSV and the ncu command it builds (the profiling
itself needs a GPU)."""
import types
from pathlib import Path

import pytest

from scripts import load_benchmark


# The shape of `ncu --csv --metrics gpu__time_duration.sum` output: a header row, then a row per launch and metric;
# lines that do not start with a quote (ncu's ==PROF== log, the workload's own prints) are not part of the table.
NCU_CSV = """==PROF== Connected to process 1234
"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","1,500"
"1","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","1,000"
"2","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","3,000"
"3","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","2,000"
"4","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","9,000"
"5","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","5,000"
"6","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","4,000"
"7","1234","flash_fwd_sm90_kernel","gpu__time_duration.sum","nsecond","6,000"
==PROF== Disconnected from process 1234
"""


@pytest.fixture(scope="module")
def ncu_ab():
    return load_benchmark("ncu_ab")


def test_medians_skip_each_shapes_warm_up_launch(ncu_ab):
    times = ncu_ab.launch_times(NCU_CSV)
    assert times == [1500.0, 1000.0, 3000.0, 2000.0, 9000.0, 5000.0, 4000.0, 6000.0]
    # Two shapes of a warm-up and three timed launches each: the medians of (1000, 3000, 2000) and (5000, 4000, 6000).
    assert ncu_ab.shape_medians(times, num_shapes=2, launches=3) == [2000.0, 5000.0]
    with pytest.raises(RuntimeError, match="expected 6 launches"):
        ncu_ab.shape_medians(times, num_shapes=2, launches=2)
    assert ncu_ab.launch_times("==PROF== No kernels were profiled.\n") == []


def test_shapes_parse_and_reject_an_unknown_mask(ncu_ab):
    assert ncu_ab.parse_shapes("128:nc:1024,256:c:8192") == [(128, False, 1024), (256, True, 8192)]
    with pytest.raises(SystemExit, match="the mask is nc or c"):
        ncu_ab.parse_shapes("128:x:1024")


@pytest.mark.parametrize("backward,deterministic", [(False, False), (True, False), (True, True)],
                         ids=["forward", "backward", "deterministic"])
def test_profile_times_the_kernels_of_the_mode(ncu_ab, monkeypatch, backward, deterministic):
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen["cmd"], seen["env"] = cmd, env
        return types.SimpleNamespace(returncode=0, stdout=NCU_CSV, stderr="")

    monkeypatch.setattr(ncu_ab.subprocess, "run", fake_run)
    args = types.SimpleNamespace(fwd_sm90="strict", bwd_sm90="strict", kernel_regex=None, backward=backward,
                                 shapes="128:nc:1024,256:c:8192", launches=3, tokens=16384, hidden=2048, dtype="bf16",
                                 timeout=10, deterministic=deterministic, window=(1024, 0), softcap=30.0)
    assert ncu_ab.profile(args, "/tmp/build") == ncu_ab.launch_times(NCU_CSV)
    cmd = seen["cmd"]
    regex = cmd[cmd.index("-k") + 1]
    assert regex == (ncu_ab.BACKWARD_KERNEL_REGEX if backward else ncu_ab.KERNEL_REGEX)
    assert ("--backward" in cmd) == backward
    assert ("--deterministic" in cmd) == deterministic
    assert cmd[cmd.index("--shapes") + 1] == "128:nc:1024,256:c:8192"
    assert "--window=1024,0" in cmd
    assert cmd[cmd.index("--softcap") + 1] == "30.0"
    assert seen["env"]["PYTHONPATH"] == str(Path("/tmp/build").resolve())
    assert seen["env"]["FLASHATTN_FWD_SM90"] == "strict" and seen["env"]["FLASHATTN_BWD_SM90"] == "strict"


def test_every_later_build_is_compared_with_the_first(ncu_ab):
    shapes = [(128, False, 1024), (256, True, 2048)]
    medians = {"main": [[100.0, 200.0], [110.0, 210.0]], "a": [[90.0, 205.0], [100.0, 205.0]],
               "b": [[105.0, 250.0], [105.0, 250.0]]}
    lines = ncu_ab.comparison_lines(shapes, ["main", "a", "b"], medians)
    assert lines == [
        "D128 non-causal L1024: main 100 / 110 ns, a 90 / 100 ns: +10.53% (overlap)",
        "D128 non-causal L1024: main 100 / 110 ns, b 105 / 105 ns: +0.00% (overlap)",
        "D256 causal L2048: main 200 / 210 ns, a 205 / 205 ns: +0.00% (overlap)",
        "D256 causal L2048: main 200 / 210 ns, b 250 / 250 ns: -18.00% (apart)",
    ]
