"""Bad inputs raise RuntimeError with a message that names the problem (messages: csrc/api/checks.h and backends)."""
import re

import pytest
import torch

fwd = torch.ops.flashattn.fwd


def valid_dtype(device):
    return torch.float16 if device == "cuda" else torch.float32


def qkv(device, batch=2, heads=4, heads_kv=2, len_q=16, len_k=24, head_dim=64, dtype=None):
    opts = dict(dtype=dtype or valid_dtype(device), device=device)
    return (
        torch.randn(batch, heads, len_q, head_dim, **opts),
        torch.randn(batch, heads_kv, len_k, head_dim, **opts),
        torch.randn(batch, heads_kv, len_k, head_dim, **opts),
    )


def raises(fragment):
    return pytest.raises(RuntimeError, match=re.escape(fragment))


def raises_all(*fragments):
    """A RuntimeError whose message has the fragments in this order."""
    return pytest.raises(RuntimeError, match=".*".join(map(re.escape, fragments)))


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [3, 5])
def test_wrong_rank(device, which, rank):
    tensors = dict(zip("qkv", qkv(device)))
    t = tensors[which]
    tensors[which] = t[0] if rank == 3 else t.unsqueeze(0)
    with raises(f"{which} must have 4 dimensions"):
        fwd(tensors["q"], tensors["k"], tensors["v"])


def test_batch_mismatch(device):
    q, _, _ = qkv(device, batch=2)
    _, k, v = qkv(device, batch=3)
    with raises("same batch size B"):
        fwd(q, k, v)


def test_head_dim_mismatch(device):
    q, _, _ = qkv(device, head_dim=64)
    _, k, v = qkv(device, head_dim=32)
    with raises("same head dim D"):
        fwd(q, k, v)


def test_kv_heads_do_not_divide_query_heads(device):
    q, k, v = qkv(device, heads=4, heads_kv=3)
    with raises("must divide the number of query heads"):
        fwd(q, k, v)


def test_kv_length_mismatch(device):
    q, k, _ = qkv(device, len_k=24)
    _, _, v = qkv(device, len_k=25)
    with raises("k and v must have the same length Lk"):
        fwd(q, k, v)


def test_kv_heads_mismatch(device):
    q, k, _ = qkv(device, heads_kv=2)
    _, _, v = qkv(device, heads_kv=4)
    with raises("k and v must have the same number of heads"):
        fwd(q, k, v)


def test_mixed_dtypes(device):
    q, k, v = qkv(device)
    other = torch.bfloat16 if q.dtype != torch.bfloat16 else torch.float16
    with raises("q, k and v must have the same dtype"):
        fwd(q, k.to(other), v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_last_dim_not_contiguous(device, which):
    tensors = dict(zip("qkv", qkv(device)))
    t = tensors[which]
    tensors[which] = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, stride(-1) == L
    with raises(f"{which} must have stride(-1) == 1"):
        fwd(tensors["q"], tensors["k"], tensors["v"])


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_scale(device, scale):
    with raises("scale must be finite"):
        fwd(*qkv(device), False, scale)


@pytest.mark.parametrize("scale", [1e39, -3e38])
def test_scale_beyond_float32(device, scale):
    # Finite as a double, but scale * log2(e), which every backend works with, overflows float32.
    with raises("flashattn.fwd: scale must be at most 2.35866e+38 in magnitude"):
        fwd(*qkv(device), False, scale)
    with raises("flashattn.bwd: scale must be at most 2.35866e+38 in magnitude"):
        call_bwd(bwd_args(device), scale=scale)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64], ids=["int32", "complex64"])
def test_cpu_unsupported_dtype(dtype):
    q, k, v = (t.to(dtype) for t in qkv("cpu"))
    with raises("flashattn.fwd: CPU supports float32, float64, float16 and bfloat16"):
        fwd(q, k, v)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_cuda_unsupported_dtype(dtype):
    with raises("flashattn.fwd: CUDA supports float16 and bfloat16; cast q, k, v to one of them"):
        fwd(*qkv("cuda", dtype=dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [4, 20, 100, 264, 512])
def test_cuda_unsupported_head_dim(head_dim):
    # CUDA: D a multiple of 8 up to 256.
    with raises("on CUDA the head dim must be a multiple of 8 and at most 256"):
        fwd(*qkv("cuda", head_dim=head_dim))


@pytest.mark.cuda
def test_cuda_lengths_past_32_bit_band_bounds():
    # Band bounds such as i + (Lk - Lq) + right reach Lq + Lk: past 2^31 they would wrap in the kernels' 32-bit ints.
    # Keys of stride 0 (no memory behind them): the check runs before anything is read.
    q = torch.randn(1, 1, 1000, 64, dtype=torch.float16, device="cuda")
    k = torch.zeros(1, 1, 1, 64, dtype=torch.float16, device="cuda").expand(1, 1, 2**31 - 1000, 64)
    with pytest.raises(RuntimeError, match=re.escape("Lq + Lk must be below 2^31 - 256")):
        fwd(q, k, k, window_size=[1023, 1000])


@pytest.mark.cuda
@pytest.mark.parametrize("cpu_tensor", ["q", "k", "v"])
def test_mixed_devices(cpu_tensor):
    tensors = dict(zip("qkv", qkv("cuda")))
    tensors[cpu_tensor] = tensors[cpu_tensor].cpu()
    with raises("same device"):
        fwd(tensors["q"], tensors["k"], tensors["v"])


def misaligned(t, how):
    """t's values in a tensor whose rows break the kernels' 16-byte rule: "pointer" starts 2 bytes past a 16-byte
    boundary, "stride" has rows 4 elements longer than D (a stride that is not a multiple of 8)."""
    if how == "pointer":
        return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)
    padded = torch.empty(*t.shape[:-1], t.shape[-1] + 4, dtype=t.dtype, device=t.device)
    return padded[..., : t.shape[-1]].copy_(t)


@pytest.mark.cuda
@pytest.mark.parametrize("how,message", [("pointer", "must be 16-byte aligned"),
                                         ("stride", "must be a multiple of 8 elements")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_cuda_rows_not_16_byte_aligned(which, how, message):
    tensors = dict(zip("qkv", qkv("cuda")))
    tensors[which] = misaligned(tensors[which], how)
    with raises_all(f"flashattn.fwd: {which}", message):
        fwd(tensors["q"], tensors["k"], tensors["v"])


@pytest.mark.cuda
@pytest.mark.parametrize("how,message", [("pointer", "must be 16-byte aligned"),
                                         ("stride", "must be a multiple of 8 elements")])
@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache"])
def test_cuda_kvcache_rows_not_16_byte_aligned(which, how, message):
    q = torch.randn(2, 4, 1, 64, dtype=torch.float16, device="cuda")
    tensors = dict(q=q, k_cache=torch.randn(2, 2, 32, 64, dtype=torch.float16, device="cuda"))
    tensors["v_cache"] = torch.randn_like(tensors["k_cache"])
    tensors[which] = misaligned(tensors[which], how)
    with raises_all(f"flashattn.fwd_kvcache: {which}", message):
        torch.ops.flashattn.fwd_kvcache(tensors["q"], tensors["k_cache"], tensors["v_cache"])


@pytest.mark.cuda
@pytest.mark.parametrize("how,message", [("pointer", "must be 16-byte aligned"),
                                         ("stride", "must be a multiple of 8 elements")])
def test_cuda_varlen_rows_not_16_byte_aligned(how, message):
    q = torch.randn(24, 4, 64, dtype=torch.float16, device="cuda")
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device="cuda")
    with raises_all("flashattn.fwd_varlen: q", message):
        torch.ops.flashattn.fwd_varlen(misaligned(q, how), q, q, cu, cu)


# ---- flashattn.bwd: its extra arguments must match what fwd produced (check_bwd_inputs) ------------------------

bwd = torch.ops.flashattn.bwd


def bwd_args(device):
    """Valid (dout, q, k, v, out, lse) for flashattn.bwd."""
    q, k, v = qkv(device)
    out, lse = fwd(q, k, v)
    return dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse)


def call_bwd(args, **kwargs):
    return bwd(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], **kwargs)


@pytest.mark.parametrize("which", ["dout", "out"])
def test_bwd_shape_mismatch(device, which):
    args = bwd_args(device)
    args[which] = args[which][:, :, :-1]
    with raises(f"flashattn.bwd: {which} must have q's shape"):
        call_bwd(args)


@pytest.mark.parametrize("which", ["dout", "out"])
def test_bwd_dtype_mismatch(device, which):
    args = bwd_args(device)
    args[which] = args[which].to(torch.float64 if device == "cpu" else torch.bfloat16)
    with raises(f"flashattn.bwd: {which} must have q's dtype"):
        call_bwd(args)


def test_bwd_lse_not_float32(device):
    args = bwd_args(device)
    args["lse"] = args["lse"].to(torch.float64)
    with raises("flashattn.bwd: lse must be float32"):
        call_bwd(args)


def test_bwd_lse_shape_mismatch(device):
    args = bwd_args(device)
    args["lse"] = args["lse"][:, :2]
    with raises("flashattn.bwd: lse must have shape (B, H, Lq)"):
        call_bwd(args)


def test_bwd_dlse_mismatch(device):
    args = bwd_args(device)
    with raises("flashattn.bwd: dlse must have shape (B, H, Lq)"):
        call_bwd(args, dlse=torch.zeros_like(args["lse"])[..., :-1])
    with raises("flashattn.bwd: dlse must be float32"):
        call_bwd(args, dlse=torch.zeros_like(args["lse"], dtype=torch.float16))


def test_bwd_dout_last_dim_not_contiguous(device):
    args = bwd_args(device)
    args["dout"] = args["dout"].transpose(-1, -2).contiguous().transpose(-1, -2)
    with raises("flashattn.bwd: dout must have stride(-1) == 1"):
        call_bwd(args)


def test_bwd_checks_q_k_v_like_fwd(device):
    args = bwd_args(device)
    args["k"] = args["k"][:, :, :-1]
    with raises("flashattn.bwd: k and v must have the same length Lk"):
        call_bwd(args)


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_bwd_non_finite_scale(device, scale):
    with raises("flashattn.bwd: scale must be finite"):
        call_bwd(bwd_args(device), scale=scale)


@pytest.mark.cuda
def test_bwd_mixed_devices():
    args = bwd_args("cuda")
    args["lse"] = args["lse"].cpu()
    with raises("flashattn.bwd: lse must be on q's device"):
        call_bwd(args)
