"""GPU check of the Hopper building blocks in csrc/cuda/sm90 (wgmma descriptors and wrappers, TMA, mbarriers),
one piece at a time, under the sm90 forward and backward kernels that rely on them. Builds tests/sm90/sm90_probe.cu
for sm_90a at test time; skipped without a Hopper GPU."""
import math
from pathlib import Path

import pytest
import torch
from reference import assert_attention_close, make_qkv

ROOT = Path(__file__).resolve().parents[2]

# Under pytest-xdist (--dist loadgroup) every test here runs in one worker, which builds the probe once.
pytestmark = pytest.mark.xdist_group("sm90_probe")

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    from torch.utils.cpp_extension import load

    # A fresh build directory per session: in torch's shared cache a build killed midway leaves its lock file behind,
    # and load() then waits for it forever.
    return load(
        name="flashattn_sm90_probe",
        sources=[str(ROOT / "tests" / "sm90" / "sm90_probe.cu")],
        build_directory=str(tmp_path_factory.mktemp("sm90_probe")),
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cuda_cflags=["-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"],
    )


def swizzle_128b(tile: torch.Tensor) -> torch.Tensor:
    """A tile of 128-byte rows (64 16-bit or 32 fp32 elements) -> the 128-byte swizzle layout: 16-byte chunk c (an
    eighth of the row) of row r stored at chunk c ^ (r % 8)."""
    rows = tile.shape[0]
    chunks = tile.reshape(rows, 8, tile.shape[1] // 8)
    out = torch.empty_like(chunks)
    for r in range(rows):
        out[r, torch.arange(8) ^ (r % 8)] = chunks[r]
    return out.reshape(rows, -1)


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wgmma_ss_then_rs_with_transposed_b(probe, dim, dtype):
    a = torch.randn(64, dim, device="cuda", dtype=dtype)
    b, v = (torch.randn(dim, dim, device="cuda", dtype=dtype) for _ in range(2))
    s, o = probe.wgmma_probe(a, b, v)
    torch.testing.assert_close(s, a.float() @ b.float().T, rtol=1e-4, atol=1e-3)
    # The kernel rounds its own S to the input dtype for the second product, exactly as s.to(dtype) does.
    torch.testing.assert_close(o, s.to(dtype).float() @ v.float(), rtol=1e-4, atol=2e-2)


@pytest.mark.cuda
@needs_hopper
def test_tma_box_load_lands_in_the_swizzle_the_descriptors_assume(probe):
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(probe.tma_probe(a).cpu(), swizzle_128b(a.cpu()))


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("row", [-16, -24, -63, -64, -100])
def test_tma_load_zero_fills_rows_before_zero(probe, row):
    # The three-consumer causal forward's first tile of a head starts at a negative row where L_q is not a multiple of
    # 192 (fwd_kernel.h, kTilesEndAtLq): TMA must zero-fill those rows of Q and count the whole box's bytes, or the
    # load's mbarrier never completes.
    x = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    loaded, done = probe.tma_negative_rows_probe(x, row)
    torch.cuda.synchronize()
    assert done.item() == 1, "the load's mbarrier did not complete"
    valid = max(0, 64 + row)  # box rows -row .. 63 are tensor rows 0 .. valid - 1
    expected = torch.zeros(64, 64, dtype=torch.bfloat16)
    expected[64 - valid:] = x[0, 1, :valid].cpu()
    assert torch.equal(loaded.cpu(), swizzle_128b(expected))


@pytest.mark.cuda
@needs_hopper
def test_stream_k_merge_is_the_same_whichever_part_takes_the_lock_first(probe):
    # The D128 forward without a mask splits its last tiles over keys between two CTAs; the warp that finishes
    # second merges (fwd_kernel.h, merge_split_tile). In the kernel the part with the first key blocks nearly always
    # merges, so this forces both orders: the result must not depend on it, and must match the merge rule: each
    # part's O and row sums scaled by 2^(base - max base), base = row max * scale_log2.
    torch.manual_seed(0)
    parts = torch.randn(2, 68, 32, device="cuda")  # [part][64 O values, 2 row maxima, 2 row sums][lane]
    parts[:, 64:66] *= 4.0
    parts[:, 66:68] = parts[:, 66:68].abs() + 0.5
    scale_log2 = 0.125 * math.log2(math.e)
    first_part_first = probe.merge_split_tile_probe(parts, scale_log2, False)
    second_part_first = probe.merge_split_tile_probe(parts, scale_log2, True)
    torch.cuda.synchronize()
    assert torch.equal(first_part_first, second_part_first)
    parts = parts.double().cpu()
    base = parts[:, 64:66] * scale_log2  # (2 parts, 2 rows, 32 lanes)
    top = base.max(dim=0).values
    weight = torch.exp2(base - top)
    row = (torch.arange(64) // 2) % 2  # the accumulator's row of O value i (rescale_o)
    expected = torch.empty(68, 32, dtype=torch.float64)
    expected[:64] = parts[0, :64] * weight[0, row] + parts[1, :64] * weight[1, row]
    expected[64:66] = top / scale_log2
    expected[66:68] = parts[0, 66:68] * weight[0] + parts[1, 66:68] * weight[1]
    torch.testing.assert_close(first_part_first.double().cpu(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@needs_hopper
def test_warpgroup_vote_is_per_warpgroup_and_per_round(probe):
    # ptx.h warpgroup_all (bar.red.and over a warpgroup's 128 threads), the forward's vote on each key block's
    # optimistic exponentials: three warpgroups, each on its own barrier, voting round after round.
    rounds = torch.ones(6, 384, dtype=torch.int32)
    rounds[1, 128 + 77] = 0  # one thread of warpgroup 1
    rounds[2, 127] = 0  # the last thread of warpgroup 0 and the first of warpgroup 2
    rounds[2, 256] = 0
    rounds[3] = 0  # every thread
    rounds[4, ::2] = 0  # every other thread
    rounds[5] = (torch.rand(384) > 0.002).int()  # random, mostly ones
    got = probe.warpgroup_all_probe(rounds.cuda()).cpu()
    expected = rounds.view(6, 3, 128).all(dim=2).int().repeat_interleave(128, dim=1)
    assert torch.equal(got, expected)


@pytest.mark.cuda
@needs_hopper
def test_threads_store_a_swizzled_tile_that_wgmma_reads_as_a(probe):
    x, y, z = (torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    acc, out, tile, out_k_major = probe.transposed_a_probe(x, y, z)
    torch.testing.assert_close(acc, x.float() @ y.float().T, rtol=1e-4, atol=1e-3)
    rounded = acc.to(torch.bfloat16)
    assert torch.equal(tile.cpu(), swizzle_128b(rounded.cpu()))  # the backward's P^T / dS^T store
    torch.testing.assert_close(out, rounded.float().T @ z.float(), rtol=1e-4, atol=2e-2)  # dQ = dS K's read
    torch.testing.assert_close(out_k_major, rounded.float() @ z.float().T, rtol=1e-4, atol=2e-2)  # dV += P^T dO's A


@pytest.mark.cuda
@needs_hopper
def test_backward_transposed_dq_path(probe):
    # D128 without a mask: dS stored query-major by stmatrix, dQ^T = K^T dS^T with dS as the B operand, and dQ^T
    # stored transposed into the fp32 boxes that the TMA reduction reads.
    x, z = (torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y = torch.randn(80, 64, device="cuda", dtype=torch.bfloat16)
    acc, tile, out, boxes = probe.transposed_dq_probe(x, y, z)
    torch.testing.assert_close(acc, x.float() @ y.float().T, rtol=1e-4, atol=1e-3)
    rounded = acc.to(torch.bfloat16)
    assert torch.equal(tile.cpu(), swizzle_128b(rounded.T.contiguous().cpu()))
    torch.testing.assert_close(out, z.float().T @ rounded.float(), rtol=1e-4, atol=2e-2)
    dq = out.T.contiguous().cpu()  # (80 queries, 64 columns)
    for box in range(2):
        assert torch.equal(boxes[box].cpu(), swizzle_128b(dq[:, 32 * box:32 * box + 32].contiguous()))


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize(
    "bucket,head_dim,keys", [(64, 64, 128), (64, 40, 97), (128, 128, 128), (128, 96, 1), (256, 256, 64), (256, 200, 33)]
)
def test_backward_key_rows_leave_through_a_swizzled_tile(probe, bucket, head_dim, keys):
    # The second key block of a kernel (128 keys, or 64 at D256), `keys` of them below Lk: its dK rows (times 0.5)
    # staged as the K tile and stored; rows past Lk and columns past the head dim keep the poison.
    block_n = 64 if bucket == 256 else 128
    values = torch.randint(-100, 100, (block_n, bucket), device="cuda").float()
    out = torch.full((2 * block_n, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    probe.key_rows_probe(values, 0.5, block_n, block_n + keys, head_dim, bucket, out)
    expected = torch.full_like(out, float("nan"))
    expected[block_n:block_n + keys] = (values[:keys, :head_dim] * 0.5).to(torch.bfloat16)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "batch,heads,heads_kv,len_q,len_k",
    [(2, 4, 4, 256, 256), (1, 4, 2, 129, 1025), (2, 2, 1, 1025, 63), (1, 2, 2, 7, 300), (1, 16, 16, 4096, 4096)],
    ids=["even", "gqa-long-k", "mqa-short-k", "short-q", "4k"],
)
def test_sm90_forward_matches_reference(probe, head_dim, causal, batch, heads, heads_kv, len_q, len_k):
    q, k, v = make_qkv(batch, heads, heads_kv, len_q, len_k, head_dim, torch.bfloat16, "cuda")
    out, lse = probe.attention_probe(q.contiguous(), k.contiguous(), v.contiguous(), causal)
    assert_attention_close(out, lse, q, k, v, causal)


def test_swizzle_reference_is_a_permutation_within_rows():
    a = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 64)
    swizzled = swizzle_128b(a)
    assert torch.equal(swizzled.sort(dim=1).values, a) and not torch.equal(swizzled, a)
