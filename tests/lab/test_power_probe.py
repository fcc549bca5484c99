"""benchmarks/lab/power_probe.py on the CPU: its shape arguments and its summary of nvidia-smi's samples (the runs
themselves need a GPU)."""
import argparse

import pytest

from scripts import load_benchmark


# nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active
#            --format=csv,noheader,nounits: six samples, the first two (the first third) while the card settles.
SAMPLES = """2026/11/30 15:50:00.000, 1980, 300.10, 45, 0x0000000000000000
2026/11/30 15:50:00.050, 1980, 650.00, 46, 0x0000000000000000
2026/11/30 15:50:00.100, 1665, 690.50, 60, 0x0000000000000004
2026/11/30 15:50:00.150, 1650, 688.00, 61, 0x0000000000000004
2026/11/30 15:50:00.200, 1680, 691.00, 62, 0x0000000000000004

2026/11/30 15:50:00.250, 1620, 689.00, 61, 0x0000000000000000
"""


@pytest.fixture(scope="module")
def power_probe():
    return load_benchmark("power_probe")


def test_shapes(power_probe):
    assert power_probe.parse_shape("128:nc:8192") == (128, False, 8192)
    assert power_probe.parse_shape("64:c:1024") == (64, True, 1024)
    with pytest.raises(argparse.ArgumentTypeError, match="'nc' or 'c'"):
        power_probe.parse_shape("64:causal:1024")
    assert all(power_probe.parse_shape(s) for s in power_probe.DEFAULT_SHAPES)


def test_summary_drops_the_first_third_and_takes_medians(power_probe):
    clock, power, temperature, reasons = power_probe.summarise_samples(SAMPLES.splitlines())
    # The last four samples: clocks 1665, 1650, 1680, 1620; power 690.5, 688, 691, 689; temperatures 60, 61, 62, 61.
    assert clock == pytest.approx(1657.5)
    assert power == pytest.approx(689.75)
    assert temperature == pytest.approx(61.0)
    assert reasons == ["0x0000000000000000", "0x0000000000000004"]


def test_summary_without_samples_fails(power_probe):
    with pytest.raises(RuntimeError, match="no samples"):
        power_probe.summarise_samples(["", "  "])


def test_the_sampling_command_asks_for_the_summarised_columns(power_probe):
    fields = power_probe.smi_fields("clocks_event_reasons.active")
    assert fields[1:4] == ["clocks.sm", "power.draw", "temperature.gpu"] and fields[4] == "clocks_event_reasons.active"
