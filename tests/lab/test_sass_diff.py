"""benchmarks/lab/sass_diff.py on the CPU: its normalisation of instructions and its key-loop measure (the compiles need
nvcc and cuobjdump)."""
from scripts import load_benchmark


def test_shape_leaves_out_registers_and_constants():
    sass_diff = load_benchmark("sass_diff")
    same = sass_diff.shape("IMAD R12.reuse, R3, c[0x0][0x3a8], UR4"), sass_diff.shape("IMAD R7, R9, c[0x0][0x20], UR5")
    assert same[0] == same[1]
    assert sass_diff.shape("IADD3 R1, R2, 0x10, RZ") != sass_diff.shape("IMAD R1, R2, 0x10, RZ")


def test_key_loop_is_the_shortest_backward_branch_that_issues_wgmma():
    sass_diff = load_benchmark("sass_diff")
    code = [(0x00, "MOV R1, R2"), (0x10, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24"), (0x20, "FADD R1, R1, R2"),
            (0x30, "@P0 BRA 0x10"), (0x40, "LDS R3, [R2]"), (0x50, "@P1 BRA 0x0"), (0x60, "@P2 BRA 0x40")]
    assert sass_diff.key_loop(code) == 3  # 0x10 .. 0x30; 0x40 .. 0x60 has no wgmma, 0x0 .. 0x50 is longer
    assert sass_diff.key_loop([(0x0, "MOV R1, R2"), (0x10, "BRA 0x0")]) == 0
