"""flashattn_ext as PyTorch's SDPA flash provider: registered on import, never active until asked; once active, SDPA's
flash backend and varlen_attn run our kernels (bitwise our op's results), fall back to PyTorch's kernel for what ours
lack, work under torch.compile and CUDA graphs, and train real models as PyTorch's kernel does."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext
from flashattn_ext.integrations import sdpa
from reference import assert_grads_close, flat_grads, leaves, make_qkv, relative_error

attention = pytest.importorskip("torch.nn.attention")
if not hasattr(attention, "activate_flash_attention_impl"):
    pytest.skip("this torch has no flash-provider hook", allow_module_level=True)


@contextlib.contextmanager
def activated():
    attention.activate_flash_attention_impl(sdpa.NAME)
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


def flash_sdpa(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def ours_ran(op="_scaled_dot_product_flash_attention"):
    return sdpa.calls[(op, sdpa.NAME)]


def test_registered_not_active():
    # Registered where the build has CUDA kernels (a CPU-only build has nothing to offer the flash backend).
    assert (sdpa.NAME in attention.list_flash_attention_impls()) == bool(torch.ops.flashattn.cuda_head_dims())
    assert attention.current_flash_attention_impl() != sdpa.NAME


def test_head_dims_of_buckets_left_out_fall_back(monkeypatch):
    # A build of some buckets only (FLASHATTN_HEADDIMS): other head dims are PyTorch's, not an error of ours.
    monkeypatch.setattr(sdpa, "_cuda_head_dims", lambda: frozenset({64, 128}))
    for head_dim, reason in ((64, None), (40, None), (120, None), (96, "head dim"), (256, "head dim")):
        q = torch.empty(1, 2, 8, head_dim, dtype=torch.bfloat16)
        assert sdpa._tensors_unsupported(q, q, q) == reason, head_dim


def test_results_reach_aten_in_its_layout_without_copies():
    # _like: a result already in torch.empty_like(template)'s layout (our ops give one) is returned as it is; one that
    # differs only on one-element dimensions is restrided, no copy; any other is copied into that layout.
    template = torch.randn(2, 9, 4, 64).transpose(1, 2)  # SDPA's (B, H, L, D) view of (B, L, H, D) memory
    ours = flashattn_ext.flash_attn(template, template, template)
    assert sdpa._like(ours, template) is ours
    decode = torch.randn(2, 1, 4, 64).transpose(1, 2)  # L = 1: strides that address nothing may differ
    odd = torch.randn(2, 4, 1, 64)
    assert odd.stride()[2] != torch.empty_like(decode).stride()[2]
    like = sdpa._like(odd, decode)
    assert like.data_ptr() == odd.data_ptr() and like.stride() == torch.empty_like(decode).stride()
    contiguous = template.contiguous()
    copied = sdpa._like(contiguous, template)
    assert copied.data_ptr() != contiguous.data_ptr() and copied.stride() == template.stride()
    assert torch.equal(copied, contiguous)


@pytest.mark.skipif(not torch.ops.flashattn.cuda_head_dims(), reason="a CPU-only build registers no provider")
def test_activation_is_harmless_on_cpu():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, torch.float32, "cpu")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with activated():
        assert attention.current_flash_attention_impl() == sdpa.NAME
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), want)
    assert attention.current_flash_attention_impl() is None


# ---- CUDA -------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "seq_major"])
@pytest.mark.parametrize("heads_kv", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sdpa_is_our_kernel(head_dim, causal, heads_kv, layout):
    q, k, v = make_qkv(2, 8, heads_kv, 300, 300, head_dim, torch.bfloat16, "cuda", layout=layout)
    want = flashattn_ext.flash_attn(q, k, v, causal=causal, scale=0.3)  # not the default: SDPA's scale must carry
    with activated():
        got = flash_sdpa(q, k, v, is_causal=causal, enable_gqa=heads_kv != 8, scale=0.3)
        assert ours_ran() == 1
    assert got.stride() == q.stride()  # the layout aten's meta function promises
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_grads(causal):
    q, k, v = leaves(*make_qkv(2, 4, 4, 257, 257, 128, torch.bfloat16, "cuda", layout="seq_major"))
    with activated():
        out = flash_sdpa(q, k, v, is_causal=causal, scale=0.3)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert ours_ran("_scaled_dot_product_flash_attention_backward") == 1
    for grad, like in zip(grads, (q, k, v)):
        assert grad.stride() == like.stride()
    assert_grads_close(tuple(g.contiguous() for g in grads), q.detach(), k.detach(), v.detach(), dout, None, causal,
                       scale=0.3)


@pytest.mark.cuda
@pytest.mark.parametrize("packed", [False, True], ids=["sdpa", "varlen_attn"])
def test_expanded_output_gradient(packed):
    # out.sum().backward() hands the backward an expanded gradient (every stride 0), which our ops take only with
    # contiguous rows: made contiguous first, as PyTorch's own flash backward does.
    from torch.nn.attention.varlen import varlen_attn

    if packed:
        cu = torch.tensor([0, 100, 257], dtype=torch.int32, device="cuda")
        q, k, v = leaves(*(torch.randn(257, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3)))
        run = lambda: varlen_attn(q, k, v, cu, cu, 157, 157, window_size=(-1, 0))  # noqa: E731
        op = "_flash_attention_backward"
    else:
        q, k, v = leaves(*make_qkv(2, 4, 4, 257, 257, 64, torch.bfloat16, "cuda"))
        run = lambda: flash_sdpa(q, k, v, is_causal=True)  # noqa: E731
        op = "_scaled_dot_product_flash_attention_backward"
    want = torch.autograd.grad(run().float().sum(), (q, k, v))
    with activated():
        got = torch.autograd.grad(run().sum(), (q, k, v))
        assert ours_ran(op) == 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", [(100, 260), (260, 100)], ids=["keys_longer", "queries_longer"])
def test_sdpa_lengths_differ(lengths):
    from torch.nn.attention.bias import causal_lower_right

    len_q, len_k = lengths
    q, k, v = make_qkv(1, 4, 4, len_q, len_k, 64, torch.float16, "cuda")
    with activated():
        got = flash_sdpa(q, k, v)
    assert torch.equal(got, flashattn_ext.flash_attn(q, k, v))
    # Causal with Lq != Lk reaches the flash backend only through causal_lower_right (SDPA's is_causal refuses it
    # there): bottom-right, as PyTorch's kernel has it, rows without keys included.
    mask = causal_lower_right(len_q, len_k)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # PyTorch's flash kernel
    with activated():
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert ours_ran() == 1
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(got, flashattn_ext.flash_attn(q, k, v, causal=True))


def packed_batch(lengths_q, lengths_k, heads=4, head_dim=64):
    def cumulative(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

    q = torch.randn(sum(lengths_q), heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(sum(lengths_k), heads, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    return leaves(q, k, v), cumulative(lengths_q), cumulative(lengths_k)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [(-1, 0), (63, 0), (-1, -1), (3, 2)], ids=["causal", "w63", "full", "w3_2"])
@pytest.mark.parametrize("keys", ["same", "differ"])
def test_varlen_attn(window, keys):
    # Against PyTorch's own kernel (varlen_attn before activation): its window and causal conventions, per sequence,
    # with Lq != Lk too.
    from torch.nn.attention.varlen import varlen_attn

    lengths_q = [1, 130, 7, 300, 64]
    lengths_k = lengths_q if keys == "same" else [5, 100, 7, 340, 1]
    (q, k, v), cu_q, cu_k = packed_batch(lengths_q, lengths_k)

    def run():
        out = varlen_attn(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), window_size=window, scale=0.3)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    dout = torch.randn_like(q)
    want, want_grads = run()
    with activated():
        got, grads = run()
        assert ours_ran("_flash_attention_forward") == 1 and ours_ran("_flash_attention_backward") == 1
    causal = window[1] == 0
    ours = flashattn_ext.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=window, scale=0.3)
    assert torch.equal(got, ours)
    # Two bf16 kernels, each within bf16's rounding of the exact result; a key more or less in a row moves it by far
    # more.
    for result, other in zip((got, *grads), (want, *want_grads)):
        assert relative_error(result.float(), other.float()) < 1.5e-2


@pytest.mark.cuda
def test_negative_window_is_unbounded():
    # PyTorch's flash kernel reads any negative window size as unbounded; so do we (our op takes -1 only).
    from torch.nn.attention.varlen import varlen_attn

    (q, k, v), cu, _ = packed_batch([30, 70], [30, 70])
    with activated():
        got = varlen_attn(q, k, v, cu, cu, 70, 70, window_size=(-2, 0))
        assert ours_ran("_flash_attention_forward") == 1
    assert torch.equal(got, flashattn_ext.flash_attn_varlen(q, k, v, cu, cu, causal=True))


@pytest.mark.cuda
@pytest.mark.parametrize("packed", [False, True], ids=["sdpa_op", "varlen_attn"])
def test_autocast_dtype_as_pytorchs_kernel(packed):
    # Under a bf16 autocast, fp16 inputs: varlen_attn's op has no autocast rule (fp16 results through PyTorch's kernel),
    # aten's SDPA flash op has one (bf16): our kernels run inside them and must not cast again.
    from torch.nn.attention.varlen import varlen_attn

    if packed:
        (q, k, v), cu, _ = packed_batch([30, 70], [30, 70])
        q, k, v = leaves(*(t.detach().half() for t in (q, k, v)))
        run = lambda: varlen_attn(q, k, v, cu, cu, 70, 70, window_size=(-1, 0))  # noqa: E731
    else:
        q, k, v = leaves(*make_qkv(1, 4, 4, 100, 100, 64, torch.float16, "cuda"))
        run = lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0]  # noqa: E731
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = run()
        with activated():
            got = run()
            grads = torch.autograd.grad(got.float().sum(), (q, k, v))
            assert sum(n for (op, side), n in sdpa.calls.items() if side == sdpa.NAME) == 2
    assert got.dtype == want.dtype == (torch.float16 if packed else torch.bfloat16)
    assert all(grad.dtype == torch.float16 for grad in grads)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


@pytest.mark.cuda
def test_unsupported_falls_back():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "cuda")
    with activated():
        torch.manual_seed(0)
        out = flash_sdpa(q, k, v, dropout_p=0.5)
        assert sdpa.calls[("_scaled_dot_product_flash_attention", "fallback")] == 1 and ours_ran() == 0
    torch.manual_seed(0)
    assert torch.equal(out, flash_sdpa(q, k, v, dropout_p=0.5))  # PyTorch's kernel, the same dropout
    # A packed backward past D128: PyTorch's kernel (the forward ours, where this build has D192's bucket).
    if 192 not in torch.ops.flashattn.cuda_head_dims():
        pytest.skip("a build without the D192 bucket (FLASHATTN_HEADDIMS) falls back for the forward too")
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0, 30, 64], dtype=torch.int32, device="cuda")
    q, k, v = leaves(*(torch.randn(64, 2, 192, dtype=torch.bfloat16, device="cuda") for _ in range(3)))
    dout = torch.randn_like(q)
    want = torch.autograd.grad(varlen_attn(q, k, v, cu, cu, 34, 34, window_size=(-1, 0)), (q, k, v), dout)
    with activated():
        out = varlen_attn(q, k, v, cu, cu, 34, 34, window_size=(-1, 0))
        grads = torch.autograd.grad(out, (q, k, v), dout)  # PyTorch's backward from our out and lse
        assert ours_ran("_flash_attention_forward") == 1
        assert sdpa.calls[("_flash_attention_backward", "fallback")] == 1
    for grad, other in zip(grads, want):
        assert relative_error(grad.float(), other.float()) < 1.5e-2


@pytest.mark.cuda
def test_restore():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "cuda")
    with activated():
        flash_sdpa(q, k, v)
    sdpa.calls.clear()
    flash_sdpa(q, k, v)
    assert not sdpa.calls


@pytest.mark.cuda
def test_compile_and_graphs():
    q, k, v = make_qkv(2, 4, 4, 200, 200, 64, torch.bfloat16, "cuda")
    want = flashattn_ext.flash_attn(q, k, v, causal=True)

    def f(q, k, v):
        return flash_sdpa(q, k, v, is_causal=True) * 2

    with activated():
        compiled = torch.compile(f, fullgraph=True)
        assert torch.equal(compiled(q, k, v), want * 2)
        assert ours_ran() >= 1
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            f(q, k, v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = f(q, k, v)
        torch.cuda.current_stream().wait_stream(stream)
        q.copy_(torch.randn_like(q))
        graph.replay()
    assert torch.equal(out, flashattn_ext.flash_attn(q, k, v, causal=True) * 2)


# ---- models: a few training steps with and without activation ---------------------------------------------------


def train_losses(model, batches, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = model(batches[step])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def first_step_grads(model, batch):
    """Every parameter's gradient of one step, flattened (float32)."""
    model(batch).backward()
    return flat_grads(model)


def compare_training(make_model, make_batches, op):
    torch.manual_seed(0)
    base = make_model()
    state = {name: t.clone() for name, t in base.state_dict().items()}
    batches = make_batches()

    def fresh():
        model = make_model()
        model.load_state_dict(state)
        return model

    with sdpa_kernel(SDPBackend.MATH):
        math_grads = first_step_grads(fresh(), batches[0])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want_grads = first_step_grads(fresh(), batches[0])
        want = train_losses(base, batches)
        with activated():
            got_grads = first_step_grads(fresh(), batches[0])
            got = train_losses(fresh(), batches)
            assert ours_ran(op) > 0 and ours_ran(op + "_backward") > 0
    # The losses at random weights barely depend on the attention (attention that sees later tokens moves them by
    # 0.4%); the first step's gradients move by far more than PyTorch's math backend differs from its flash kernel.
    noise = relative_error(math_grads, want_grads)
    error = relative_error(got_grads, want_grads)
    assert error <= 3 * noise + 1e-3, f"gradients {error:.2e} from PyTorch's flash kernel's (math: {noise:.2e})"
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_timm_vit_trains():
    timm = pytest.importorskip("timm")

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=64)

        def forward(self, batch):
            images, labels = batch
            return F.cross_entropy(self.net(images), labels)

    def make_model():
        return Classifier().cuda().to(torch.bfloat16)

    def make_batches():
        return [(torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.bfloat16),
                 torch.randint(0, 10, (4,), device="cuda")) for _ in range(3)]

    compare_training(make_model, make_batches, "_scaled_dot_product_flash_attention")


@pytest.mark.cuda
def test_llama_sdpa_trains():
    transformers = pytest.importorskip("transformers")

    class CausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=512, attn_implementation="sdpa")
            self.net = transformers.LlamaForCausalLM(config)

        def forward(self, ids):
            return self.net(input_ids=ids, labels=ids).loss

    def make_model():
        return CausalLM().cuda().to(torch.bfloat16)

    def make_batches():
        return [torch.randint(0, 128, (2, 200), device="cuda") for _ in range(3)]

    compare_training(make_model, make_batches, "_scaled_dot_product_flash_attention")
