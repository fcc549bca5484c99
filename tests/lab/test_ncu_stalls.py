"""benchmarks/lab/ncu_stalls.py on the CPU: reading Nsight Compute's SASS source page and grouping its samples."""
import gzip
import sys

import pytest

from scripts import load_benchmark

# The shape of `ncu -i REP --page source --csv --print-source sass`: the kernel's name, then the header and a row per
# instruction (columns cut down to the ones the script reads, plus one it ignores).
SOURCE_CSV = """"Kernel Name","void kernel()",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_long_sb","stall_wait (Not Issued)"
"0x10","  MOV R1, R2","4","8","4","0","4"
"0x20","  MOV R3, R4","2","8","0","2","0"
"0x30","  HGMMA.64x80x16","30","80","10","20","10"
"0x40","  BRA 0x30","10","80","0","10","0"
"0x50","  STSM [R0], R4","6","8","6","0","6"
"0x60","  EXIT","0","0","0","0","0"
"""


@pytest.fixture(scope="module")
def ncu_stalls():
    return load_benchmark("ncu_stalls")


def test_rows_parse_past_the_kernel_line(ncu_stalls):
    rows = ncu_stalls.read_rows(SOURCE_CSV)
    assert [row["Source"].strip() for row in rows][:2] == ["MOV R1, R2", "MOV R3, R4"]
    assert [row[ncu_stalls.SAMPLES] for row in rows] == [4, 2, 30, 10, 6, 0]
    assert ncu_stalls.stall_columns(rows) == ["stall_wait", "stall_long_sb"]


def test_stretches_split_where_the_execution_count_changes(ncu_stalls):
    rows = ncu_stalls.read_rows(SOURCE_CSV)
    assert ncu_stalls.stretches(rows) == [(0, 1, 8, 6), (2, 3, 80, 40), (4, 4, 8, 6), (5, 5, 0, 0)]
    assert ncu_stalls.hot_loop(rows) == (80, 40)


def test_main_reports_passes_of_the_hot_loop(ncu_stalls, tmp_path, monkeypatch, capsys):
    path = tmp_path / "source.csv.gz"
    path.write_bytes(gzip.compress(SOURCE_CSV.encode()))
    monkeypatch.setattr(sys, "argv", ["ncu_stalls.py", str(path), "--min-share", "0"])
    ncu_stalls.main()
    out = capsys.readouterr().out
    assert "6 instructions, 52 samples" in out
    assert "hot loop: instructions run 80 times, 76.9% of the samples" in out
    # The first stretch: 6 samples over 8 executions, against the loop's 40 over 80: 1.5 passes per execution.
    assert "    0-1             8        6  11.5%        1.50  MOV R1, R2" in out


def test_help_prints_every_option(ncu_stalls, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ncu_stalls.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        ncu_stalls.main()
    assert exit_info.value.code == 0
    assert "at least this % of samples" in capsys.readouterr().out
