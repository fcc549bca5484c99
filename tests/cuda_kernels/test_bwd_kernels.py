"""The CUDA backward kernels against the CPU backend (float32) on the same inputs and output gradients."""
import os

import pytest
import torch

import flashattn_ext  # noqa: F401  (registers torch.ops.flashattn)
from cases import CUDA_HEAD_DIMS
from reference import (
    GRAD_FLOOR,
    assert_error_within,
    assert_grad_layouts,
    assert_grad_properties,
    assert_grads_close,
    attention_grads,
    make_qkv,
    op_inputs,
    reference_dtype,
    rows_with_keys,
)

fwd = torch.ops.flashattn.fwd
bwd = torch.ops.flashattn.bwd


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 72])
@pytest.mark.parametrize("len_q,len_k", [(257, 257), (1, 513), (200, 97)], ids=["q257-k257", "q1-k513", "q200-k97"])
def test_cuda_grads_match_cpu(dtype, causal, head_dim, len_q, len_k):
    q, k, v = make_qkv(2, 4, 2, len_q, len_k, head_dim, dtype, "cuda")
    dout, out, lse, dlse = op_inputs(q, k, v, causal)
    grads = bwd(dout, q, k, v, out, lse, causal, None, dlse)
    assert_grad_properties(grads, q, k, v)
    # Reference: our CPU kernel on the same inputs and output gradients upcast to float32.
    cpu = [t.cpu().float() for t in (q, k, v)]
    cpu_out, cpu_lse = fwd(*cpu, causal)
    cpu_grads = bwd(dout.cpu().float(), *cpu, cpu_out, cpu_lse, causal, None, dlse.cpu())
    low_precision = attention_grads(q, k, v, dout, dlse, causal, upcast=False)
    keyed = rows_with_keys(len_q, len_k, causal, "cpu")
    assert (grads[0].cpu()[:, :, ~keyed] == 0).all()
    for name, grad, ref, low in zip(("dq", "dk", "dv"), grads, cpu_grads, low_precision):
        floor = GRAD_FLOOR[dtype] * max(1.0, ref.abs().max().item())
        assert_error_within(grad.cpu(), ref, [low.cpu()], None, f"CUDA {name} vs CPU float32", floor=floor)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("len_q,len_k", [(80, 80), (81, 300), (159, 129), (1025, 1025)])
def test_cuda_grads_match_cpu_query_tiles(dtype, len_q, len_k):
    # D128 without a mask takes 80 queries a step on Hopper (dQ computed transposed): one tile exactly, a partial
    # last one, and many.
    test_cuda_grads_match_cpu(dtype, False, 128, len_q, len_k)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", CUDA_HEAD_DIMS + [40, 72, 200])
def test_cuda_grads_match_cpu_head_dims(head_dim):
    dtype = torch.bfloat16
    q, k, v = make_qkv(1, 4, 2, 200, 333, head_dim, dtype, "cuda")
    dout, out, lse, dlse = op_inputs(q, k, v, True)
    grads = bwd(dout, q, k, v, out, lse, True, None, dlse)
    cpu = [t.cpu().to(reference_dtype(dtype)) for t in (q, k, v)]
    cpu_out, cpu_lse = fwd(*cpu, True)
    cpu_grads = bwd(dout.cpu().float(), *cpu, cpu_out, cpu_lse, True, None, dlse.cpu())
    low_precision = attention_grads(q, k, v, dout, dlse, True, upcast=False)
    for name, grad, ref, low in zip(("dq", "dk", "dv"), grads, cpu_grads, low_precision):
        floor = GRAD_FLOOR[dtype] * max(1.0, ref.abs().max().item())
        assert_error_within(grad.cpu(), ref, [low.cpu()], None, f"CUDA {name} vs CPU float32", floor=floor)


# ---- the persistent Hopper backward --------------------------------------------------------------------------------
# At D <= 128 a grid of at most one CTA per SM takes key blocks in turn; FLASHATTN_BWD_CTAS=3 makes every CTA run many
# blocks in a row (blocks without steps among them), which the default grid does only on large shapes.


def small_grid_cases():
    """[(op, args, kwargs, ordered)]: dense (MHA, GQA, Lq < Lk and Lq > Lk, a band that leaves key blocks without
    queries) and packed sequences (idle slots, empty sequences), D64 and D128, bf16 and fp16; ordered: a
    deterministic dQ."""
    from op.test_varlen import MIXED, packed_inputs

    cases = []
    dense = [  # (head_dim, dtype, (B, H, Hk, Lq, Lk), kwargs, deterministic)
        (64, torch.bfloat16, (2, 8, 2, 700, 700), dict(causal=True), True),
        (128, torch.bfloat16, (1, 4, 4, 300, 1000), dict(), True),
        (128, torch.float16, (1, 4, 2, 200, 1100), dict(causal=True), True),
        (128, torch.bfloat16, (2, 2, 1, 1000, 260), dict(causal=True), False),
        (128, torch.bfloat16, (1, 4, 2, 100, 1000), dict(causal=True, window_size=(32, 0)), False),
        (128, torch.bfloat16, (1, 4, 2, 900, 1000), dict(window_size=(200, 50), softcap=10.0), True),
        (64, torch.bfloat16, (1, 4, 4, 513, 513), dict(window_size=(-1, 16)), False),
    ]
    for head_dim, dtype, (batch, heads, heads_kv, len_q, len_k), kwargs, deterministic in dense:
        q, k, v = make_qkv(batch, heads, heads_kv, len_q, len_k, head_dim, dtype, "cuda")
        out, lse = fwd(q, k, v, **kwargs)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        cases.append(("bwd", (dout, q, k, v, out, lse), dict(kwargs, dlse=dlse, deterministic=deterministic),
                      deterministic))
    packed = [(128, dict(causal=True), True), (64, dict(causal=True, window_size=(31, 0)), False),
              (64, dict(window_size=(40, 20)), True)]
    for head_dim, kwargs, deterministic in packed:
        q, k, v, cu_q, cu_k = packed_inputs(MIXED, 4, 2, head_dim, torch.bfloat16, "cuda")
        out, lse = torch.ops.flashattn.fwd_varlen(q, k, v, cu_q, cu_k, **kwargs)
        cases.append(("bwd_varlen", (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k),
                      dict(kwargs, deterministic=deterministic), deterministic))
    return cases


@pytest.mark.cuda
def test_persistent_backward_small_grid_gives_the_default_grids_gradients():
    # Ordered, the dQ additions keep their order whichever CTA takes a block: the same bits as the default grid; else
    # dK and dV (one writer each, steps in a fixed order) the same bits and dQ close. The dense cases also against the
    # reference.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward's schedule")
    from isolated import run_isolated
    cases = small_grid_cases()
    runs, grids = {}, {}
    for ctas in ("", "3"):
        env = dict({"FLASHATTN_BWD_SM90": "strict"}, **({"FLASHATTN_BWD_CTAS": ctas} if ctas else {}))
        runs[ctas], grids[ctas] = run_isolated(env, "cuda_kernels.schedule_runs", "backward_grids",
                                               [c[:3] for c in cases])
    # The switch took: every launch of the Hopper backward had 3 CTAs with it, and some had more without.
    kernels = [name for name in grids["3"] if "flash_bwd_sm90_kernel" in name]
    assert kernels and all(grid[0] == 3 for name in kernels for grid in grids["3"][name])
    assert any(grid[0] > 3 for name, launched in grids[""].items() if "flash_bwd_sm90_kernel" in name
               for grid in launched)
    for (op, args, kwargs, ordered), default, small in zip(cases, runs[""], runs["3"]):
        for name, a, b in zip(("dq", "dk", "dv"), default, small):
            if ordered or name != "dq":
                assert torch.equal(a, b), f"{op} {kwargs}: {name} differs on the small grid"
            else:
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
        if op == "bwd":
            dout, q, k, v = args[:4]
            mods = {key: kwargs[key] for key in ("causal", "window_size", "softcap") if key in kwargs}
            assert_grads_close(small, q, k, v, dout, kwargs["dlse"], **mods)


@pytest.mark.cuda
@pytest.mark.large
@pytest.mark.xdist_group("large")  # one worker runs the large tests, one after another
@pytest.mark.skipif(os.environ.get("FLASHATTN_TEST_LARGE") != "1", reason="set FLASHATTN_TEST_LARGE=1 (~45 GiB)")
def test_cuda_backward_of_more_than_2_31_elements():
    # q, out, dout and dq of more than 2^31 elements: the entries past the mark get their gradients (64-bit offsets
    # in the kernels, the preprocessing and the dQ conversion).
    batch, heads, length, head_dim = 65537, 8, 32, 128
    q, k, v = make_qkv(batch, heads, heads, length, length, head_dim, torch.bfloat16, "cuda")
    assert q.numel() > 2**31
    dout, out, lse, dlse = op_inputs(q, k, v, True)
    grads = bwd(dout, q, k, v, out, lse, True, None, dlse)
    for b in (0, batch // 2, batch - 1):
        sl = slice(b, b + 1)
        assert_grads_close(tuple(g[sl] for g in grads[:3]), q[sl], k[sl], v[sl], dout[sl], dlse[sl], True)


@pytest.mark.cuda
@pytest.mark.parametrize("env", [{}, {"FLASHATTN_BWD_SM90": "0"}, {"FLASHATTN_CUDA_BWD": "chunked"}],
                         ids=["default", "sm80", "chunked"])
def test_cuda_grads_in_input_layouts(env):
    # Every backward path writes dq, dk, dv in the layouts of q, k, v (sequence-major here, as a model passes them:
    # (B, L, H, D) memory) with the numbers contiguous inputs give: plain, band, ordered dQ, D256 (sm80: chunked).
    from isolated import run_isolated

    if not env and torch.cuda.get_device_capability() == (9, 0):
        env = {"FLASHATTN_BWD_SM90": "strict"}  # the default there is the Hopper kernel: not a silent fallback
    cases, inputs = [], []
    for head_dim, heads_kv, mods in ((64, 2, {}), (128, 4, {"window_size": (64, 0)}),
                                     (128, 2, {"deterministic": True}), (256, 2, {})):
        q, k, v = make_qkv(2, 4, heads_kv, 97, 130, head_dim, torch.bfloat16, "cuda", layout="seq_major")
        window = mods.get("window_size", (-1, -1))
        dout, out, lse, dlse = op_inputs(q, k, v, True, window_size=window)
        kwargs = dict(dlse=dlse, **mods)
        cases.append(("bwd", (dout, q, k, v, out, lse, True), kwargs))
        cases.append(("bwd", (dout, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, True), kwargs))
        inputs.append((q, k, v, dout, dlse, window))
    results = run_isolated(env, "cuda_kernels.schedule_runs", "backward_each", cases)
    for i, (q, k, v, dout, dlse, window) in enumerate(inputs):
        got, want = results[2 * i], results[2 * i + 1]
        assert_grad_layouts(got, q, k, v)
        assert got[0].transpose(1, 2).is_contiguous() and got[1].transpose(1, 2).is_contiguous()
        assert_grads_close(got, q, k, v, dout, dlse, True, None, window)  # each path right, not only self-consistent
        for grad, expected in zip(got, want):
            torch.testing.assert_close(grad, expected, msg=lambda m: f"case {i}: {m}")
