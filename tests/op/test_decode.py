"""The CUDA decode path (queries of at most 16 rows: the query heads of a kv head packed into one tile, keys split
over CTAs, the splits merged by lse): against the fp64/fp32 reference through the plain op and the KV-cache op, for
every head-dim bucket, GQA group sizes that fill one or several 16-row tiles, split counts, score modifications, and
bitwise batch invariance."""
import pytest
import torch

import flashattn_ext
from reference import assert_attention_close, make_qkv

pytestmark = pytest.mark.cuda


def decode_kernel_ran(fn):
    """Whether fn() launched the decode kernel (by its name in the profiler's trace)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any("flash_decode_kernel" in event.name for event in prof.events())


@pytest.mark.parametrize("head_dim", [40, 64, 128, 200, 256])
@pytest.mark.parametrize("heads,heads_kv", [(8, 8), (32, 8), (32, 1)], ids=["mha", "gqa4", "mqa32"])
@pytest.mark.parametrize("len_q", [1, 3, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_plain_op_matches_reference(head_dim, heads, heads_kv, len_q, causal):
    q, k, v = make_qkv(2, heads, heads_kv, len_q, 1000, head_dim, torch.bfloat16, "cuda")
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal=causal)
    assert_attention_close(out, lse, q, k, v, causal)


def test_the_decode_kernel_runs():
    q, k, v = make_qkv(1, 8, 2, 1, 300, 64, torch.bfloat16, "cuda")
    assert decode_kernel_ran(lambda: flashattn_ext.flash_attn(q, k, v))
    q = torch.randn(1, 8, 17, 64, dtype=torch.bfloat16, device="cuda")  # past the decode path's 16 rows
    assert not decode_kernel_ran(lambda: flashattn_ext.flash_attn(q, k, v))


@pytest.mark.parametrize("len_q,len_k", [(4, 1), (16, 7), (8, 65), (5, 4097)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_odd_lengths_and_rows_without_keys(len_q, len_k, dtype):
    # Causal with Lq > Lk leaves the first rows without keys: out 0, lse -inf.
    q, k, v = make_qkv(3, 6, 3, len_q, len_k, 96, dtype, "cuda")
    for causal in (False, True):
        out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal=causal)
        assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize(
    "mods",
    [dict(window_size=(100, 0), causal=True), dict(window_size=(30, 2)), dict(softcap=5.0, causal=True),
     dict(sinks=True, causal=True), dict(window_size=(700, -1), softcap=2.0, sinks=True)],
    ids=["window-causal", "window-two-sided", "softcap", "sinks", "all"],
)
def test_score_modifications(mods):
    q, k, v = make_qkv(2, 16, 4, 4, 1500, 128, torch.bfloat16, "cuda")
    mods = dict(mods)
    if mods.pop("sinks", False):
        mods["sinks"] = torch.linspace(-2.0, 4.0, 16, device="cuda")
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, **mods)
    assert_attention_close(out, lse, q, k, v, mods.get("causal", False), None, mods.get("window_size", (-1, -1)),
                           mods.get("softcap", 0.0), mods.get("sinks"))


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_split_counts(num_splits):
    # Every split count gives the reference's answer; each is deterministic.
    batch, heads, heads_kv, capacity, head_dim = 3, 32, 8, 2048, 128
    k_cache = torch.randn(batch, heads_kv, capacity, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    lengths = [1, 777, capacity]
    for b, n in enumerate(lengths):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 2, head_dim, dtype=torch.bfloat16, device="cuda")
    run = lambda: flashattn_ext.flash_attn_with_kvcache(  # noqa: E731
        q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, num_splits=num_splits, return_lse=True)
    out, lse = run()
    out2, lse2 = run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    for b, n in enumerate(lengths):
        assert_attention_close(out[b : b + 1], lse[b : b + 1], q[b : b + 1], k_cache[b : b + 1, :, :n],
                               v_cache[b : b + 1, :, :n], True)


def test_batch_invariance():
    # A row's bits do not depend on the batch around it (the split count comes from the shape without the batch).
    heads, heads_kv, capacity, head_dim = 32, 8, 4096, 128
    k_cache = torch.randn(5, heads_kv, capacity, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(5, heads, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor([4096, 100, 3000, 17, 2500], dtype=torch.int32, device="cuda")
    full = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    for b in range(5):
        alone = flashattn_ext.flash_attn_with_kvcache(q[b : b + 1], k_cache[b : b + 1], v_cache[b : b + 1],
                                                      cache_seqlens=seqlens[b : b + 1])
        assert torch.equal(alone, full[b : b + 1])


def test_nan_inputs_reach_their_rows_only():
    q, k, v = make_qkv(2, 8, 2, 1, 500, 64, torch.bfloat16, "cuda")
    q[0, 3] = float("nan")
    out = flashattn_ext.flash_attn(q, k, v)
    assert torch.isnan(out[0, 3]).all()
    finite = torch.ones(out.shape[:2], dtype=torch.bool, device="cuda")
    finite[0, 3] = False
    assert torch.isfinite(out[finite]).all()
