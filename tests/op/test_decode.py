"""Short queries against long keys (decode): on CUDA the decode path (queries of at most 16 rows: the query heads of
a kv head packed into one tile, keys split over CTAs, the splits merged by lse), on CPU the packed short-query path.
Against the fp64/fp32 reference through the plain op and the KV-cache op, for every head-dim bucket, GQA group sizes
that fill one or several 16-row tiles, split counts, score modifications, rows whose scores are all -inf, NaN inputs
and bitwise batch invariance; on CUDA also the same bits whether a CTA runs each split or one CTA runs them all in
turn."""
import pytest
import torch

import flashattn_ext
from isolated import run_isolated
from reference import assert_attention_close, make_qkv, sinks_for_keys


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
def test_plain_op_matches_reference(device, head_dim, heads, heads_kv, len_q, causal):
    q, k, v = make_qkv(2, heads, heads_kv, len_q, 1000, head_dim, torch.bfloat16, device)
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal=causal)
    assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.cuda
def test_the_decode_kernel_runs():
    q, k, v = make_qkv(1, 8, 2, 1, 300, 64, torch.bfloat16, "cuda")
    assert decode_kernel_ran(lambda: flashattn_ext.flash_attn(q, k, v))
    q = torch.randn(1, 8, 17, 64, dtype=torch.bfloat16, device="cuda")  # past the decode path's 16 rows
    assert not decode_kernel_ran(lambda: flashattn_ext.flash_attn(q, k, v))


@pytest.mark.parametrize("len_q,len_k", [(4, 1), (16, 7), (8, 65), (5, 4097)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_odd_lengths_and_rows_without_keys(device, len_q, len_k, dtype):
    # Causal with Lq > Lk leaves the first rows without keys: out 0, lse -inf.
    q, k, v = make_qkv(3, 6, 3, len_q, len_k, 96, dtype, device)
    for causal in (False, True):
        out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal=causal)
        assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize(
    "mods",
    [dict(window_size=(100, 0), causal=True), dict(window_size=(30, 2)), dict(softcap=5.0, causal=True),
     dict(sinks=True, causal=True), dict(window_size=(700, -1), softcap=2.0, sinks=True)],
    ids=["window-causal", "window-two-sided", "softcap", "sinks", "all"],
)
def test_score_modifications(device, mods):
    q, k, v = make_qkv(2, 16, 4, 4, 1500, 128, torch.bfloat16, device)
    mods = dict(mods)
    if mods.pop("sinks", False):
        mods["sinks"] = torch.linspace(5.0, 9.0, 16, device=device)  # about the lse of 1500 keys (log 1500 + 1/2 = 7.8)
    out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, **mods)
    assert_attention_close(out, lse, q, k, v, mods.get("causal", False), None, mods.get("window_size", (-1, -1)),
                           mods.get("softcap", 0.0), mods.get("sinks"))


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_split_counts(device, num_splits):
    # Every split count gives the reference's answer and is deterministic; on CUDA each differs in its bits from one
    # split (the CPU ignores the count: every row in one pass).
    batch, heads, heads_kv, capacity, head_dim = 3, 32, 8, 2048, 128
    k_cache = torch.randn(batch, heads_kv, capacity, head_dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    lengths = [1, 777, capacity]
    for b, n in enumerate(lengths):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, 2, head_dim, dtype=torch.bfloat16, device=device)
    run = lambda: flashattn_ext.flash_attn_with_kvcache(  # noqa: E731
        q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, num_splits=num_splits, return_lse=True)
    out, lse = run()
    out2, lse2 = run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    if num_splits > 1 and device == "cuda":  # the count took effect: parts merged round otherwise than one pass
        one = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                    num_splits=1, return_lse=True)
        assert not (torch.equal(out, one[0]) and torch.equal(lse, one[1])), "the splits did not run"
    for b, n in enumerate(lengths):
        assert_attention_close(out[b : b + 1], lse[b : b + 1], q[b : b + 1], k_cache[b : b + 1, :, :n],
                               v_cache[b : b + 1, :, :n], True)


def test_batch_invariance(device):
    # A row's bits do not depend on the batch around it (the split count comes from the shape without the batch).
    heads, heads_kv, capacity, head_dim = 32, 8, 4096, 128
    k_cache = torch.randn(5, heads_kv, capacity, head_dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(5, heads, 1, head_dim, dtype=torch.bfloat16, device=device)
    seqlens = torch.tensor([4096, 100, 3000, 17, 2500], dtype=torch.int32, device=device)
    full, full_lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True)
    for b in range(5):
        alone, alone_lse = flashattn_ext.flash_attn_with_kvcache(
            q[b : b + 1], k_cache[b : b + 1], v_cache[b : b + 1], cache_seqlens=seqlens[b : b + 1], return_lse=True)
        assert torch.equal(alone, full[b : b + 1]) and torch.equal(alone_lse, full_lse[b : b + 1])


def test_nan_inputs_reach_their_rows_only(device):
    q, k, v = make_qkv(2, 8, 2, 1, 500, 64, torch.bfloat16, device)
    q[0, 3] = float("nan")
    out = flashattn_ext.flash_attn(q, k, v)
    assert torch.isnan(out[0, 3]).all()
    finite = torch.ones(out.shape[:2], dtype=torch.bool, device=device)
    finite[0, 3] = False
    assert torch.isfinite(out[finite]).all()


@pytest.mark.parametrize("num_splits", [1, 4, 0], ids=["one", "four", "auto"])
def test_rows_whose_scores_are_all_minus_inf(device, num_splits):
    # Entry 0: every key scores -inf, so each split's part is empty and only the fold can tell the row sees keys: NaN
    # out and lse, as softmax gives, whatever the split count; with a sink, out 0 and lse = the sink. Entry 1: the
    # first 600 keys only, which weigh 0.
    q, k, v = make_qkv(2, 8, 2, 1, 1000, 64, torch.bfloat16, device)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[0, :, :, 0] = float("-inf")
    k[1, :, :600, 0] = float("-inf")
    for sinks in (None, sinks_for_keys(8, device)):
        out, lse = flashattn_ext.flash_attn_with_kvcache(q, k, v, num_splits=num_splits, sinks=sinks,
                                                         return_lse=True)
        if sinks is None:
            assert out[0].isnan().all() and lse[0].isnan().all()
        else:
            assert (out[0] == 0).all() and torch.equal(lse[0], sinks[:, None])
        assert_attention_close(out[1:], lse[1:], q[1:], k[1:, :, 600:], v[1:, :, 600:], sinks=sinks)


def same_bits(a, b):
    """Bit for bit equal (NaN included)."""
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def splits_cases():
    """KV-cache calls with several key splits: head-dim buckets, GQA groups of one or two 16-row tiles, query lengths,
    cache lengths 0 and full with NaN past them, score modifications, paged caches (per-row and per-block table
    entries), an append, forced split counts, a NaN query and a NaN key."""
    torch.manual_seed(0)
    cases = []

    def dense(batch, heads, heads_kv, len_q, lengths, capacity, head_dim, **kwargs):
        q = torch.randn(batch, heads, len_q, head_dim, dtype=torch.bfloat16, device="cuda")
        k_cache = torch.randn(batch, heads_kv, capacity, head_dim, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        for b, n in enumerate(lengths):
            k_cache[b, :, n:] = float("nan")
            v_cache[b, :, n:] = float("nan")
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        cases.append((q, k_cache, v_cache, dict(cache_seqlens=seqlens, **kwargs)))
        return cases[-1]

    sinks = torch.linspace(-2.0, 4.0, 32, device="cuda")
    dense(3, 32, 8, 1, [0, 1000, 4096], 4096, 128, causal=True)
    dense(2, 8, 8, 3, [5, 2000], 2000, 64, causal=True, window_size=(100, 0), sinks=sinks[:8])
    dense(2, 32, 1, 1, [1500, 700], 1500, 200, softcap=5.0, sinks=sinks)
    dense(2, 4, 1, 16, [1, 1300], 1300, 64, causal=True)
    dense(2, 8, 2, 1, [0, 600], 600, 64, sinks=sinks[:8])  # rows without keys but a sink
    dense(1, 8, 2, 1, [3100], 3100, 256, num_splits=48)  # the combine's shared memory past 48 KB
    q, k_cache, v_cache, kwargs = dense(2, 32, 8, 1, [4096, 3000], 4096, 128, num_splits=64)
    q[0, 3] = float("nan")  # every part of its row NaN
    k_cache[1, 2, 1500] = float("nan")  # one split's part of kv head 2's rows NaN
    for page_size, len_new in ((16, 2), (64, 0)):
        q, k_cache, v_cache, kwargs = dense(3, 16, 4, 4, [700, 1, 1024 - len_new], 1024, 128, causal=True,
                                            num_splits=5 if page_size == 64 else 0)
        batch, heads_kv, capacity, head_dim = k_cache.shape
        per_entry = capacity // page_size
        order = torch.randperm(batch * per_entry, device="cuda")
        pages = [torch.empty(batch * per_entry, heads_kv, page_size, head_dim, dtype=k_cache.dtype, device="cuda")
                 for _ in range(2)]
        for cache, paged in zip((k_cache, v_cache), pages):
            paged[order] = cache.view(batch, heads_kv, per_entry, page_size, head_dim).transpose(1, 2).reshape(
                -1, heads_kv, page_size, head_dim)
        kwargs["block_table"] = order.view(batch, per_entry).to(torch.int32)
        if len_new:
            kwargs["k"], kwargs["v"] = (torch.randn(batch, heads_kv, len_new, head_dim, dtype=k_cache.dtype,
                                                    device="cuda") for _ in range(2))
        cases[-1] = (q, pages[0], pages[1], kwargs)
    return cases


@pytest.mark.cuda
def test_splits_in_turn_give_the_same_bits():
    # The two ways of running the splits fold the same parts in the same order: one process each (the switch is read
    # once), the same inputs.
    cases = splits_cases()
    runs = {mode: run_isolated({"FLASHATTN_DECODE_SPLITS": mode}, "cuda_kernels.schedule_runs", "kvcache_each", cases)
            for mode in ("ctas", "in-turn")}
    (ctas, ctas_kernels), (in_turn, in_turn_kernels) = runs["ctas"], runs["in-turn"]
    assert any("decode_combine" in name for name in ctas_kernels)
    assert not any("decode_combine" in name for name in in_turn_kernels)
    for i, ((out, lse), (out2, lse2)) in enumerate(zip(ctas, in_turn)):
        assert same_bits(out, out2) and same_bits(lse, lse2), f"case {i}"
    # and they are right (the dense cases with a valid length; empty caches are checked elsewhere)
    for (q, k_cache, v_cache, kwargs), (out, lse) in zip(cases[:6], ctas[:6]):
        for b, n in enumerate(kwargs["cache_seqlens"].tolist()):
            if n == 0:
                continue
            assert_attention_close(out[b : b + 1], lse[b : b + 1], q[b : b + 1], k_cache[b : b + 1, :, :n],
                                   v_cache[b : b + 1, :, :n], kwargs.get("causal", False), None,
                                   kwargs.get("window_size", (-1, -1)), kwargs.get("softcap", 0.0),
                                   kwargs.get("sinks"))


@pytest.mark.cuda
def test_batch_invariance_with_splits_in_turn():
    # A batch whose row groups fill the GPU runs the splits in turn; each row still has the bits it has alone.
    heads, heads_kv, capacity, head_dim = 32, 8, 2048, 64
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = -(-2 * sms // heads_kv) + 1
    k_cache = torch.randn(batch, heads_kv, capacity, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, heads, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.randint(0, capacity + 1, (batch,), dtype=torch.int32, device="cuda")
    full, full_lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                           return_lse=True)
    for b in range(0, batch, 7):
        alone, alone_lse = flashattn_ext.flash_attn_with_kvcache(
            q[b : b + 1], k_cache[b : b + 1], v_cache[b : b + 1], cache_seqlens=seqlens[b : b + 1], causal=True,
            return_lse=True)
        assert same_bits(alone, full[b : b + 1]) and same_bits(alone_lse, full_lse[b : b + 1]), f"entry {b}"
