"""The CUDA backward kernels against the CPU backend (float32) on the same inputs and output gradients."""
import pytest
import torch

import flashattn_ext  # noqa: F401  (registers torch.ops.flashattn)
from cases import CUDA_HEAD_DIMS
from reference import (
    GRAD_FLOOR,
    assert_error_within,
    assert_grad_properties,
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
