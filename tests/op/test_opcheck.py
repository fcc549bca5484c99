"""Dispatcher integration: torch.library.opcheck (schema, fake impl, autograd registration, AOT dispatch) and
torch.compile(fullgraph=True) against eager."""
import pytest
import torch

import flashattn_ext
from reference import sample_inputs

SAMPLE_IDS = ["basic", "gqa-causal", "mqa-causal-scale-no-keys", "decode-strided", "packed-causal"]


@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16], cuda=[torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sample", range(len(SAMPLE_IDS)), ids=SAMPLE_IDS)
def test_opcheck(device, dtype, sample):
    args, kwargs = sample_inputs(device, dtype)[sample]
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args, kwargs)


@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16], cuda=[torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sample", range(len(SAMPLE_IDS)), ids=SAMPLE_IDS)
def test_opcheck_fwd_autograd(device, dtype, sample):
    # q, k, v require grad: test_autograd_registration checks the autograd kernel, and test_aot_dispatch_dynamic
    # traces the backward (flashattn.bwd through its fake impl) and runs it against eager.
    args, kwargs = sample_inputs(device, dtype)[sample]
    args = tuple(t.detach().requires_grad_() for t in args)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args, kwargs)


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 0, 5, 8), (2, 4, 0, 8)], ids=["no-heads", "no-queries"])
def test_opcheck_empty(device, dtype, shape):
    # test_aot_dispatch_dynamic runs the backward on the gradient of an empty out.sum(): every stride 0.
    args = tuple(torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args, {})


def bwd_sample(device, dtype, sample):
    """(args, kwargs) of flashattn.bwd built from a fwd sample: out and lse from fwd, random dout (and dlse)."""
    (q, k, v), kwargs = sample_inputs(device, dtype)[sample]
    out, lse = torch.ops.flashattn.fwd(q, k, v, **kwargs)
    extra = {"dlse": torch.randn_like(lse)} if sample % 2 else {"deterministic": True}
    return (torch.randn_like(out), q, k, v, out, lse), {**kwargs, **extra}


@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16], cuda=[torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sample", range(len(SAMPLE_IDS)), ids=SAMPLE_IDS)
def test_opcheck_bwd(device, dtype, sample):
    args, kwargs = bwd_sample(device, dtype, sample)
    torch.library.opcheck(torch.ops.flashattn.bwd.default, args, kwargs)


def attention_block(q, k, v):
    # Ops around the call so the compiled graph has more than the custom op in it.
    out, lse = flashattn_ext.flash_attn_with_lse(q * 1.5, k, v, causal=True, scale=0.2)
    return flashattn_ext.flash_attn(out, k, v) + 1, lse.exp()


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_compile_fullgraph(device, dtype):
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True)
    # Two shapes: the second one recompiles (or runs a dynamic-shape graph) through the fake impl again.
    for args, _ in sample_inputs(device, dtype)[1:3]:
        expected_out, expected_lse = attention_block(*args)
        out, lse = compiled(*args)
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(lse, expected_lse)


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_compile_data_dependent_length(device, dtype):
    # Queries picked by a boolean mask (a length known only at run time): the fake kernels must not guard on it, and
    # out keeps q's sequence-major layout, as the kernel gives it.
    torch._dynamo.reset()
    x = torch.randn(2, 6, 2, 8, device=device, dtype=dtype, requires_grad=True)
    keep = torch.tensor([True, True, True, False, True, False], device=device)

    def loss(x, keep):
        q = x[0][keep].unsqueeze(0).transpose(1, 2)  # (1, H, kept, D) over (1, kept, H, D) memory
        out = flashattn_ext.flash_attn(q, q, q, causal=True)
        return (out * torch.arange(8, device=x.device)).sum(), out.stride()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(loss, fullgraph=True)
        got, got_stride = compiled(x, keep)
    grad = torch.autograd.grad(got, x)[0]
    want, want_stride = loss(x, keep)
    assert got_stride == want_stride
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)  # fused differently
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(grad, torch.autograd.grad(want, x)[0], **tol)


class TinyAttention(torch.nn.Module):
    """Projections around flash_attn with GQA (4 query heads, 2 kv heads): a training step has grads to check."""

    def __init__(self, dim=64, heads=4, heads_kv=2):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(batch, length, 2, self.heads_kv, self.head_dim).permute(2, 0, 3, 1, 4)
        out = flashattn_ext.flash_attn(q, k, v, causal=True)  # strided views in, as a model passes them
        return self.proj(out.transpose(1, 2).reshape(batch, length, -1))


def training_loss(model, x, target):
    return torch.nn.functional.mse_loss(model(x), target)


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_compile_training_step(device, dtype):
    # torch.compile(fullgraph=True) of forward + loss; backward through the compiled graph (AOTAutograd traces
    # flashattn.bwd); then an optimizer step. Gradients and updated weights match eager.
    torch._dynamo.reset()
    eager = TinyAttention().to(device=device, dtype=dtype)
    compiled_model = TinyAttention().to(device=device, dtype=dtype)
    compiled_model.load_state_dict(eager.state_dict())
    compiled_loss = torch.compile(training_loss, fullgraph=True)
    x = torch.randn(2, 37, 64, device=device, dtype=dtype)
    target = torch.randn_like(x)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model)]
    for _ in range(2):  # the second step runs the cached compiled graph on the updated weights
        losses = [training_loss(eager, x, target), compiled_loss(compiled_model, x, target)]
        for loss, opt in zip(losses, optimizers):
            opt.zero_grad()
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], **tol)
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(p_compiled.grad, p_eager.grad, **tol, msg=lambda m: f"{name}.grad: {m}")
        for opt in optimizers:
            opt.step()
