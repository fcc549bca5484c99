"""The KV-cache forward (flashattn.fwd_kvcache): appends in place, then attends over each entry's valid keys with the
same bits as the dense op on those keys (itself checked against the fp64 reference); paged caches give the same
results as dense ones; nothing past a valid length reaches the output."""
import pytest
import torch

import flashattn_ext
from cases import hopper_forward
from isolated import run_isolated
from reference import assert_attention_close, with_sinks

fwd_kvcache = torch.ops.flashattn.fwd_kvcache

B, H, HK, D, LMAX = 3, 4, 2, 16, 96


def dense_cache(dtype=torch.float32, lengths=None):
    """k_cache, v_cache (B, Hk, LMAX, D) of random values; with `lengths`, NaN past each entry's valid length."""
    k_cache = torch.randn(B, HK, LMAX, D, dtype=dtype)
    v_cache = torch.randn(B, HK, LMAX, D, dtype=dtype)
    if lengths is not None:
        poison_past(k_cache, lengths)
        poison_past(v_cache, lengths)
    return k_cache, v_cache


def poison_past(cache, lengths):
    for b, n in enumerate(lengths):
        cache[b, :, n:] = float("nan")


def paged_from_dense(k_cache, v_cache, page_size, seed=0):
    """The same contents as (num_pages, Hk, page_size, D) pages in a random order, and the block table."""
    pages_per_entry = LMAX // page_size
    num_pages = B * pages_per_entry + 3  # spare pages, never listed
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: B * pages_per_entry]
    block_table = order.view(B, pages_per_entry).to(torch.int32)
    shape = (num_pages, HK, page_size, D)
    k_pages = torch.full(shape, float("nan"), dtype=k_cache.dtype)
    v_pages = torch.full(shape, float("nan"), dtype=v_cache.dtype)
    for b in range(B):
        for i in range(pages_per_entry):
            rows = slice(i * page_size, (i + 1) * page_size)
            k_pages[block_table[b, i]] = k_cache[b, :, rows]
            v_pages[block_table[b, i]] = v_cache[b, :, rows]
    return k_pages, v_pages, block_table


def expected(q, k_cache, v_cache, k, v, lengths, first=None, **kwargs):
    """Per entry: the dense op over the valid keys after the append (computed on copies), from `first` (left
    padding)."""
    outs, lses = [], []
    for b, n in enumerate(lengths):
        keys, values = k_cache[b : b + 1, :, :n], v_cache[b : b + 1, :, :n]
        if k is not None:
            keys, values = torch.cat([keys, k[b : b + 1]], 2), torch.cat([values, v[b : b + 1]], 2)
        if first is not None:
            keys, values = keys[:, :, first[b] :], values[:, :, first[b] :]
        out, lse = flashattn_ext.flash_attn_with_lse(q[b : b + 1], keys, values, **kwargs)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


MODS = {  # a non-default scale rides on two of them (positive and negative)
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(9, 0), scale=0.3),
    "softcap-sinks": dict(causal=True, softcap=4.0, sinks=True, scale=-0.2),
}


def mods_for(name, heads=H, device="cpu"):
    return with_sinks(MODS[name], heads, device)


@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("len_new", [0, 1, 4])
@pytest.mark.parametrize("len_q", [1, 4, 50])  # 50: a chunk of two query blocks, its first rows without keys
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dense_cache(dtype, len_q, len_new, mods):
    lengths = [0, 37, LMAX - len_new]  # an empty cache, a partial one, one that the append fills
    k_cache, v_cache = dense_cache(dtype, lengths)
    q = torch.randn(B, H, len_q, D, dtype=dtype)
    k = torch.randn(B, HK, len_new, D, dtype=dtype) if len_new else None
    v = torch.randn(B, HK, len_new, D, dtype=dtype) if len_new else None
    kwargs = mods_for(mods)
    want_out, want_lse = expected(q, k_cache.clone(), v_cache.clone(), k, v, lengths, **kwargs)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True, **kwargs)
    assert torch.isfinite(out).all(), "nothing past a valid length may reach the output"
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(seqlens, torch.tensor(lengths, dtype=torch.int32)), "cache_seqlens is not changed"
    if len_new:
        for b, n in enumerate(lengths):
            assert torch.equal(k_cache[b, :, n : n + len_new], k[b])
            assert torch.equal(v_cache[b, :, n : n + len_new], v[b])


@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("len_new", [0, 2])
@pytest.mark.parametrize("len_q", [1, 4])
def test_left_padding(len_q, len_new, mods):
    # Entry b's keys start at cache_leftpad[b] (NaN before: never read): none at all, 2 of 40 (the last two, with the
    # appended ones), some, and the whole cache of a full entry.
    lengths, first = [5, 40, LMAX - len_new], [5 + len_new, 38, 0]
    k_cache, v_cache = dense_cache(lengths=lengths)
    for cache in (k_cache, v_cache):
        for b, start in enumerate(first):
            cache[b, :, :start] = float("nan")
    q = torch.randn(B, H, len_q, D)
    k = torch.randn(B, HK, len_new, D) if len_new else None
    v = torch.randn(B, HK, len_new, D) if len_new else None
    kwargs = mods_for(mods)
    want_out, want_lse = expected(q, k_cache.clone(), v_cache.clone(), k, v, lengths, first, **kwargs)
    seqlens, leftpad = torch.tensor(lengths, dtype=torch.int32), torch.tensor(first, dtype=torch.int32)
    out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True,
                                                     cache_leftpad=leftpad, **kwargs)
    assert torch.isfinite(out).all(), "no key before the left padding's end may reach the output"
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_left_padding_out_of_range():
    k_cache, v_cache = dense_cache()
    with pytest.raises(RuntimeError, match=r"cache_leftpad\[1\] must lie in \[0, 8\]"):
        fwd_kvcache(torch.randn(B, H, 1, D), k_cache, v_cache, torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D),
                    torch.tensor([0, 7, 9], dtype=torch.int32),
                    cache_leftpad=torch.tensor([0, 9, 0], dtype=torch.int32))


def assert_paged_matches_dense(q, caches, pages, block_table, k, v, seqlens, page_size, **kwargs):
    """The paged cache gives the dense cache's output bit for bit, and the appended rows landed in the right pages."""
    dense_out = flashattn_ext.flash_attn_with_kvcache(q, *caches, k, v, seqlens, **kwargs)
    paged_out = flashattn_ext.flash_attn_with_kvcache(q, *pages, k, v, seqlens, block_table, **kwargs)
    assert torch.isfinite(dense_out).all(), "nothing past a valid length may reach the output"
    assert torch.equal(paged_out, dense_out)
    for b, n in enumerate(seqlens.tolist()):
        for t in range(k.shape[2]):
            page, offset = int(block_table[b, (n + t) // page_size]), (n + t) % page_size
            for cache, new in ((pages[0], k), (pages[1], v)):
                assert torch.equal(cache[page, :, offset], new[b, :, t])


@pytest.mark.parametrize("page_size", [16, 32, 96])
@pytest.mark.parametrize("mods", ["causal", "softcap-sinks"])
def test_paged_cache_matches_dense(page_size, mods):
    lengths, len_new = [0, 60, LMAX - 2], 2  # an empty entry, a partial one, one that the append fills
    k_cache, v_cache = dense_cache(lengths=lengths)
    k_pages, v_pages, block_table = paged_from_dense(k_cache, v_cache, page_size)
    q = torch.randn(B, H, 2, D)
    k, v = torch.randn(B, HK, len_new, D), torch.randn(B, HK, len_new, D)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    assert_paged_matches_dense(q, (k_cache, v_cache), (k_pages, v_pages), block_table, k, v, seqlens, page_size,
                               **mods_for(mods))


def test_paged_cache_in_token_major_layout():
    # A (num_pages, page_size, Hk, D) cache (vLLM's) passes as a transposed view, written in place through it.
    seqlens = torch.tensor([3, 40, 70], dtype=torch.int32)
    k_cache, v_cache = dense_cache(lengths=seqlens.tolist())
    k_pages, v_pages, block_table = paged_from_dense(k_cache, v_cache, 16)
    k_tok, v_tok = k_pages.transpose(1, 2).contiguous(), v_pages.transpose(1, 2).contiguous()
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D)
    want = flashattn_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, seqlens, block_table, causal=True)
    got = flashattn_ext.flash_attn_with_kvcache(q, k_tok.transpose(1, 2), v_tok.transpose(1, 2), k, v, seqlens,
                                                block_table, causal=True)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    # The same appends landed in both caches (spare pages hold NaN).
    torch.testing.assert_close(k_tok.transpose(1, 2), k_pages, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_tok.transpose(1, 2), v_pages, rtol=0, atol=0, equal_nan=True)


def test_against_reference():
    lengths = [4, 50, 96]
    k_cache, v_cache = dense_cache(torch.float64, lengths)
    q = torch.randn(B, H, 3, D, dtype=torch.float64)
    out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(
        lengths, dtype=torch.int32), causal=True, return_lse=True)
    for b, n in enumerate(lengths):
        assert_attention_close(out[b : b + 1], lse[b : b + 1], q[b : b + 1], k_cache[b : b + 1, :, :n],
                               v_cache[b : b + 1, :, :n], causal=True)


def test_default_lengths_are_the_whole_cache():
    k_cache, v_cache = dense_cache()
    q = torch.randn(B, H, 1, D)
    assert torch.equal(flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache),
                       flashattn_ext.flash_attn(q, k_cache, v_cache))


def test_gradients_are_refused():
    k_cache, v_cache = dense_cache()
    q = torch.randn(B, H, 1, D, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward only"):
        flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache)
    with pytest.raises(RuntimeError, match="forward only"):  # the op itself, not only the function
        fwd_kvcache(q, k_cache, v_cache)
    with torch.no_grad():
        out = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert not out.requires_grad


def test_the_caches_versions_move_with_each_append():
    k_cache, v_cache = dense_cache()
    k, v = torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D)
    before = k_cache._version, v_cache._version
    fwd_kvcache(torch.randn(B, H, 1, D), k_cache, v_cache, k, v, torch.tensor([0, 1, 2], dtype=torch.int32))
    assert k_cache._version > before[0] and v_cache._version > before[1]


def test_appends_under_inference_mode_move_the_versions():
    k_cache, v_cache = dense_cache()
    before = k_cache._version
    with torch.inference_mode():
        fwd_kvcache(torch.randn(B, H, 1, D), k_cache, v_cache, torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D),
                    torch.tensor([0, 1, 2], dtype=torch.int32))
    assert k_cache._version > before


def test_caches_made_under_inference_mode_are_read_outside_it():
    with torch.inference_mode():
        k_cache, v_cache = dense_cache()
    q = torch.randn(B, H, 1, D)
    with torch.no_grad():
        out = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert torch.equal(out, flashattn_ext.flash_attn(q, k_cache.clone(), v_cache.clone()))


def test_compile_fullgraph():
    k_cache, v_cache = dense_cache()
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D)
    seqlens = torch.tensor([1, 2, 3], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v):
        return flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, causal=True)

    eager_caches = (k_cache.clone(), v_cache.clone())
    want = step(q, *eager_caches, k, v)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, k, v)
    assert torch.equal(got, want) and torch.equal(k_cache, eager_caches[0]) and torch.equal(v_cache, eager_caches[1])


def test_opcheck():
    k_cache, v_cache = dense_cache()
    q, k, v = torch.randn(B, H, 2, D), torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D)
    seqlens = torch.tensor([1, 2, 3], dtype=torch.int32)
    torch.library.opcheck(fwd_kvcache.default, (q, k_cache, v_cache, k, v, seqlens), dict(causal=True))
    leftpad = torch.tensor([0, 1, 3], dtype=torch.int32)
    torch.library.opcheck(fwd_kvcache.default, (q, k_cache, v_cache, k, v, seqlens),
                          dict(causal=True, cache_leftpad=leftpad))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(cache_seqlens=torch.tensor([0, 1], dtype=torch.int32)), r"cache_seqlens must be int32 of shape \(B,\)"),
        (dict(cache_seqlens=torch.tensor([0, 1, 2], dtype=torch.int64)), r"cache_seqlens must be int32"),
        (dict(v=None), "k and v must be given together"),
        (dict(block_table=torch.zeros(3, 2, dtype=torch.int64)), "block_table must be int32"),
        (dict(k=torch.randn(B, HK, 1, 8)), r"k must have shape \(B, Hk, Lnew, D\)"),
        (dict(k_cache=torch.randn(0, HK, 16, D), v_cache=torch.randn(0, HK, 16, D),
              block_table=torch.zeros(B, 1, dtype=torch.int32)), "must hold from 1 to 2\\^31 - 1 pages"),
        (dict(num_splits=-1), "num_splits must be >= 0"),
        (dict(k_cache=torch.randn(4, HK, 0, D), v_cache=torch.randn(4, HK, 0, D),
              block_table=torch.zeros(B, 1, dtype=torch.int32)), "pages of at least one row"),
        (dict(k=torch.randn(B, HK, LMAX + 1, D), v=torch.randn(B, HK, LMAX + 1, D)), "k and v must fit in the cache"),
        (dict(k_cache=lambda device, dtype: torch.randn(B, HK, LMAX, 2 * D, dtype=dtype, device=device)[..., ::2]),
         r"k_cache must have stride\(-1\) == 1"),
        (dict(softcap=-1.0), "softcap must be 0"),
        (dict(window_size=[-2, 0]), "window_size entries must be >= 0"),
        (dict(sinks=torch.zeros(H + 1)), r"sinks must have shape \(H,\)"),
        (dict(cache_leftpad=torch.zeros(B, dtype=torch.int64)), r"cache_leftpad must be int32 of shape \(B,\)"),
        (dict(k_cache=torch.randn(B * 6, HK, 16, D), v_cache=torch.randn(B * 6, HK, 16, D),
              block_table=torch.arange(B * 6, dtype=torch.int32).view(B, 6),
              cache_leftpad=torch.zeros(B, dtype=torch.int32)), "cache_leftpad takes a dense cache"),
    ],
    ids=["seqlens-shape", "seqlens-dtype", "k-alone", "table-dtype", "k-shape", "no-pages", "negative-splits",
         "empty-pages", "lnew-over-capacity", "cache-stride", "softcap", "window", "sinks", "leftpad-dtype",
         "leftpad-paged"],
)
def test_bad_arguments(device, change, message):
    """Every rule is checked before anything is written: the caches are as they were."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    k_cache, v_cache = dense_cache(dtype)
    args = dict(q=torch.randn(B, H, 1, D, dtype=dtype), k_cache=k_cache, v_cache=v_cache,
                k=torch.randn(B, HK, 1, D, dtype=dtype), v=torch.randn(B, HK, 1, D, dtype=dtype),
                cache_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32))
    args.update(change)
    for name, value in args.items():
        if callable(value):
            args[name] = value(device, dtype)
        elif isinstance(value, torch.Tensor):
            args[name] = value.to(device, dtype if value.is_floating_point() and name != "sinks" else value.dtype)
    before = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        fwd_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


@pytest.mark.parametrize("overlap", ["expanded-cache", "one-tensor-for-both", "new-keys-in-cache"])
def test_append_into_shared_memory_is_refused(device, overlap):
    """The append writes each entry's rows through its own view, past PyTorch's overlap checks: memory that two
    written rows (or a written row and a new key) share is refused before anything is written."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    k_cache, v_cache = (t.to(device) for t in dense_cache(dtype))
    k, v = (torch.randn(B, HK, 1, D, dtype=dtype, device=device) for _ in range(2))
    if overlap == "expanded-cache":
        k_cache, message = k_cache[:1].expand_as(k_cache), "k_cache is written .* no two of its elements"
    elif overlap == "one-tensor-for-both":
        v_cache, message = k_cache, "k_cache and v_cache are written .* must not share memory"
    else:  # the first rows of the cache's memory, as a dense tensor of k's shape
        k, message = k_cache.view(-1)[:k.numel()].view(k.shape), "k must not share memory with k_cache or v_cache"
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        fwd_kvcache(torch.randn(B, H, 1, D, dtype=dtype, device=device), k_cache, v_cache, k, v,
                    torch.tensor([0, 1, 2], dtype=torch.int32, device=device))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_no_query_heads(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cache = torch.randn(B, 0, LMAX, D, dtype=dtype, device=device)
    out, lse = fwd_kvcache(torch.randn(B, 0, 1, D, dtype=dtype, device=device), cache, cache.clone())
    assert out.shape == (B, 0, 1, D) and lse.shape == (B, 0, 1)


def test_lengths_out_of_range():
    """The CPU reads cache_seqlens and checks them (CUDA reads them on the device only: never outside the tensors)."""
    k_cache, v_cache = dense_cache()
    with pytest.raises(RuntimeError, match=r"cache_seqlens\[2\] \+ Lnew must lie in"):
        fwd_kvcache(torch.randn(B, H, 1, D), k_cache, v_cache, torch.randn(B, HK, 1, D), torch.randn(B, HK, 1, D),
                    torch.tensor([0, 1, 96], dtype=torch.int32))


def test_block_table_out_of_range():
    k_cache, v_cache = dense_cache()
    k_pages, v_pages, block_table = paged_from_dense(k_cache, v_cache, 32)
    block_table[1, 0] = 1000
    with pytest.raises(RuntimeError, match=r"block_table\[1, 0\] = 1000 is not a page"):
        fwd_kvcache(torch.randn(B, H, 1, D), k_pages, v_pages, None, None, torch.tensor([1, 1, 1], dtype=torch.int32),
                    block_table)


# ---- CUDA: the decode path (Lq <= 16) over each entry's valid keys -------------------------------------------------

CUDA_LMAX, CUDA_D = 512, 64


def cuda_caches(lengths, dtype=torch.bfloat16):
    """Dense (B, Hk, CUDA_LMAX, D) caches with NaN past each entry's valid length."""
    k_cache = torch.randn(B, HK, CUDA_LMAX, CUDA_D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    for cache in (k_cache, v_cache):
        poison_past(cache, lengths)
    return k_cache, v_cache


def cuda_pages(k_cache, v_cache, page_size, seed=0, token_major=False):
    """The dense (B, Hk, L, D) caches' contents as pages in a random order (spare pages NaN; token_major:
    (num_pages, page_size, Hk, D) pages transposed) and the block table."""
    batch, heads_kv, capacity, head_dim = k_cache.shape
    per_entry = capacity // page_size
    num_pages = batch * per_entry + 5
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: batch * per_entry]
    block_table = order.view(batch, per_entry).to(torch.int32).cuda()
    opts = dict(dtype=k_cache.dtype, device="cuda")
    if token_major:
        pages = [torch.full((num_pages, page_size, heads_kv, head_dim), float("nan"), **opts).transpose(1, 2)
                 for _ in range(2)]
    else:
        pages = [torch.full((num_pages, heads_kv, page_size, head_dim), float("nan"), **opts) for _ in range(2)]
    for cache, paged in zip((k_cache, v_cache), pages):
        paged[block_table.view(-1).long()] = cache.view(batch, heads_kv, per_entry, page_size, head_dim).transpose(
            1, 2).reshape(-1, heads_kv, page_size, head_dim)
    return pages[0], pages[1], block_table


@pytest.mark.cuda
@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("len_new", [0, 1, 4])
@pytest.mark.parametrize("len_q", [1, 4, 20])  # 20: past the decode path
def test_cuda_dense_cache(len_q, len_new, mods):
    lengths = [0, 300, CUDA_LMAX - len_new]  # an empty cache, a partial one, one that the append fills
    k_cache, v_cache = cuda_caches(lengths)
    q = torch.randn(B, H, len_q, CUDA_D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HK, len_new, CUDA_D, dtype=torch.bfloat16, device="cuda") if len_new else None
    v = torch.randn_like(k) if len_new else None
    kwargs = mods_for(mods, device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True, **kwargs)
    assert torch.isfinite(out).all(), "nothing past a valid length may reach the output"
    assert torch.equal(seqlens.cpu(), torch.tensor(lengths, dtype=torch.int32)), "cache_seqlens is not changed"
    for b, n in enumerate(lengths):
        if len_new:
            assert torch.equal(k_cache[b, :, n : n + len_new], k[b])
            assert torch.equal(v_cache[b, :, n : n + len_new], v[b])
        keys, values = k_cache[b : b + 1, :, : n + len_new], v_cache[b : b + 1, :, : n + len_new]
        assert_attention_close(out[b : b + 1], lse[b : b + 1], q[b : b + 1], keys, values, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("len_new", [0, 1])
@pytest.mark.parametrize("len_q", [1, 20])  # 20: past the decode path
def test_cuda_left_padding(len_q, len_new, mods):
    # Entry b's keys start at cache_leftpad[b] (NaN before: never read): none at all, the last 30 of 300, all.
    lengths, first = [7, 300, CUDA_LMAX - len_new], [7 + len_new, 270 + len_new, 0]
    k_cache, v_cache = cuda_caches(lengths)
    for cache in (k_cache, v_cache):
        for b, start in enumerate(first):
            cache[b, :, :start] = float("nan")
    q = torch.randn(B, H, len_q, CUDA_D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HK, len_new, CUDA_D, dtype=torch.bfloat16, device="cuda") if len_new else None
    v = torch.randn_like(k) if len_new else None
    kwargs = mods_for(mods, device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    leftpad = torch.tensor(first, dtype=torch.int32, device="cuda")
    out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True,
                                                     cache_leftpad=leftpad, **kwargs)
    assert torch.isfinite(out).all(), "no key before the left padding's end may reach the output"
    for b, (n, start) in enumerate(zip(lengths, first)):
        keys, values = k_cache[b : b + 1, :, start : n + len_new], v_cache[b : b + 1, :, start : n + len_new]
        assert_attention_close(out[b : b + 1], lse[b : b + 1], q[b : b + 1], keys, values, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("mods", ["causal", "window", "softcap-sinks"])  # a window's band starts inside a page
def test_cuda_paged_cache_matches_dense(page_size, mods):
    lengths, len_new = [5, 300, CUDA_LMAX - 2], 2
    k_cache, v_cache = cuda_caches(lengths)
    k_pages, v_pages, block_table = cuda_pages(k_cache, v_cache, page_size)
    q = torch.randn(B, H, 1, CUDA_D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, HK, len_new, CUDA_D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    assert_paged_matches_dense(q, (k_cache, v_cache), (k_pages, v_pages), block_table, k, v, seqlens, page_size,
                               **mods_for(mods, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("aligned", [True, False])
def test_cuda_append_writes_only_the_new_rows(paged, aligned):
    # 16-byte copies where every stride allows them, element copies otherwise (new rows of an odd row stride).
    lengths, len_new, page_size = [0, 300, CUDA_LMAX - 3], 3, 64
    k_cache, v_cache = cuda_caches(lengths)
    k, v = (torch.randn(B, HK, len_new, CUDA_D + (0 if aligned else 1), dtype=torch.bfloat16, device="cuda")
            [..., :CUDA_D] for _ in range(2))
    q = torch.randn(B, H, 1, CUDA_D, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    caches, block_table = (k_cache, v_cache), None
    if paged:
        *caches, block_table = cuda_pages(k_cache, v_cache, page_size)
    want = [cache.clone() for cache in caches]
    for b, n in enumerate(lengths):
        for t in range(len_new):
            if paged:
                page, row = int(block_table[b, (n + t) // page_size]), (n + t) % page_size
                want[0][page, :, row], want[1][page, :, row] = k[b, :, t], v[b, :, t]
            else:
                want[0][b, :, n + t], want[1][b, :, n + t] = k[b, :, t], v[b, :, t]
    flashattn_ext.flash_attn_with_kvcache(q, caches[0], caches[1], k, v, seqlens, block_table)
    for cache, expected in zip(caches, want):  # compared as bits: the spare pages hold NaN
        assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))


CHUNKS = [(17, 0, [0, 5, 333, 700]), (200, 37, [0, 113, 333, 663])]  # (rows, appended rows, cache lengths)


def chunk_checked(head_dim, layout, chunks=CHUNKS, seed=0, num_splits=0):
    """Chunks of query rows against a dense cache of 700 rows (NaN past each entry's valid length; H8 and, `layout`
    "heads": Hk2 (B, Hk, L, D) tensors, "tokens": Hk1 (B, L, Hk, D) ones transposed; fp16 at D64, else bf16) for
    each score modification, once with left padding: entries without keys, with fewer keys than rows (the first rows
    see none) and full ones, `num_splits` key splits. Each entry checked against the reference, one also alone (the
    same bits). Run in a process of its own to pick a kernel (FLASHATTN_FWD_SM90, FLASHATTN_DECODE); returns every
    out and lse."""
    torch.manual_seed(seed)
    batch, heads, capacity = 4, 8, 700
    heads_kv = 2 if layout == "heads" else 1
    dtype = torch.float16 if head_dim == 64 else torch.bfloat16

    def tensor(rows, heads_):
        if layout == "tokens":
            return torch.randn(batch, rows, heads_, head_dim, dtype=dtype, device="cuda").transpose(1, 2)
        return torch.randn(batch, heads_, rows, head_dim, dtype=dtype, device="cuda")

    results = []
    for len_q, len_new, lengths in chunks:
        for mods in MODS:
            for padded in (False, True) if mods == "causal" else (False,):
                k_cache, v_cache = tensor(capacity, heads_kv), tensor(capacity, heads_kv)
                first = [0, 2, 100, 3] if padded else [0] * batch
                for cache in (k_cache, v_cache):
                    for b, (n, start) in enumerate(zip(lengths, first)):
                        cache[b, :, n:] = float("nan")
                        cache[b, :, :start] = float("nan")
                q = tensor(len_q, heads)
                k, v = (tensor(len_new, heads_kv), tensor(len_new, heads_kv)) if len_new else (None, None)
                kwargs = mods_for(mods, heads, "cuda")
                seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
                leftpad = torch.tensor(first, dtype=torch.int32, device="cuda") if padded else None
                out, lse = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True,
                                                                 cache_leftpad=leftpad, num_splits=num_splits, **kwargs)
                assert torch.isfinite(out).all(), "no key outside an entry's valid rows may reach the output"
                for b, (n, start) in enumerate(zip(lengths, first)):
                    if len_new:
                        appended = slice(n, n + len_new)
                        assert torch.equal(k_cache[b, :, appended], k[b]) and torch.equal(v_cache[b, :, appended], v[b])
                    rows = slice(start, n + len_new)
                    entry = slice(b, b + 1)
                    assert_attention_close(out[entry], lse[entry], q[entry], k_cache[entry, :, rows],
                                           v_cache[entry, :, rows], **kwargs)
                # An entry's bits do not depend on the batch (the append, again, writes the same rows).
                entry = slice(1, 2)
                alone = flashattn_ext.flash_attn_with_kvcache(
                    q[entry], k_cache[entry], v_cache[entry], None if k is None else k[entry],
                    None if v is None else v[entry], seqlens[entry], return_lse=True,
                    cache_leftpad=None if leftpad is None else leftpad[entry], num_splits=num_splits, **kwargs)
                assert torch.equal(alone[0], out[entry]) and torch.equal(alone[1], lse[entry])
                results.append((out, lse))
    return results


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["heads", "tokens"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_chunk_each_kernel(head_dim, layout):
    # Query chunks past the decode path: the portable kernel and, on Hopper, the TMA one (strict: it must take the
    # call), both against the reference; their bits differ (two kernels ran) while both are right.
    portable = run_isolated({"FLASHATTN_FWD_SM90": "0"}, "op.test_kvcache", "chunk_checked", head_dim, layout)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's half (the portable one's passed)")
    hopper = run_isolated({"FLASHATTN_FWD_SM90": "strict"}, "op.test_kvcache", "chunk_checked", head_dim, layout)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(portable, hopper)), "the same kernel ran twice"
    for (out_a, lse_a), (out_b, lse_b) in zip(portable, hopper):
        torch.testing.assert_close(out_a, out_b, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse_a, lse_b, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,num_splits", [(64, 3), (128, 2), (128, 64), (256, 5)])
def test_cuda_chunk_key_splits(head_dim, num_splits):
    # The Hopper kernel's key splits (64: one a key block), a CTA each with the combine pass or a tile's in turn in one
    # CTA: right and batch-invariant (chunk_checked), the same bits both ways, not the unsplit kernel's.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("key splits of query chunks are the Hopper kernel's")
    args = ("op.test_kvcache", "chunk_checked", head_dim, "heads", CHUNKS, 0)
    runs = {mode: run_isolated({"FLASHATTN_FWD_SM90": "strict", "FLASHATTN_DECODE_SPLITS": mode}, *args, num_splits)
            for mode in ("ctas", "in-turn")}
    for (out, lse), (out2, lse2) in zip(runs["ctas"], runs["in-turn"]):
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
    whole = run_isolated({"FLASHATTN_FWD_SM90": "strict"}, *args, 1)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(runs["ctas"], whole)), "the splits did not run"


@pytest.mark.cuda
def test_cuda_chunk_automatic_key_splits():
    # H8 Lq130 (16 tiles an entry) against an 8192-row cache: two automatic splits on a GPU of 32 SMs or more (at
    # least 4096 keys each), the same bits as asking for two, and right where an entry holds fewer keys than a split.
    if not hopper_forward():
        pytest.skip("key splits of query chunks are the Hopper kernel's")
    torch.manual_seed(0)
    opts = dict(dtype=torch.bfloat16, device="cuda")
    lengths = [8192, 3000]
    q = torch.randn(2, 8, 130, 128, **opts)
    k_cache, v_cache = (torch.randn(2, 2, 8192, 128, **opts) for _ in range(2))
    for cache in (k_cache, v_cache):
        poison_past(cache, lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    runs = {n: flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                     num_splits=n, return_lse=True) for n in (0, 1, 2)}
    assert torch.equal(runs[0][0], runs[2][0]) and torch.equal(runs[0][1], runs[2][1])
    assert not torch.equal(runs[0][0], runs[1][0]), "the splits did not run"
    for b, n in enumerate(lengths):
        e = slice(b, b + 1)
        assert_attention_close(runs[0][0][e], runs[0][1][e], q[e], k_cache[e, :, :n], v_cache[e, :, :n], causal=True)


def nan_keys_under_splits():
    """Two splits of an 8192-row cache (H8 / Hk2, 130 rows, D128): a NaN key in entry 0's first split, seen by every
    row (causal) or by none (a window of 3100, whose band starts past it), and one in entry 1's second split, seen by
    rows 0..38 only under that window. Returns (causal out, lse), (window out, lse), and the window's run without the
    NaN keys. Run in a process of its own (FLASHATTN_DECODE_SPLITS picks how the splits run)."""
    torch.manual_seed(0)
    opts = dict(dtype=torch.bfloat16, device="cuda")
    q = torch.randn(2, 8, 130, 128, **opts)
    k_cache, v_cache = (torch.randn(2, 2, 8192, 128, **opts) for _ in range(2))
    clean = k_cache.clone()
    k_cache[0, :, 1000] = float("nan")
    k_cache[1, :, 5000] = float("nan")
    window = dict(causal=True, window_size=(3100, 0))

    def run(keys, **kwargs):
        return flashattn_ext.flash_attn_with_kvcache(q, keys, v_cache, num_splits=2, return_lse=True, **kwargs)

    return run(k_cache, causal=True), run(k_cache, **window), run(clean, **window)


@pytest.mark.cuda
def test_cuda_chunk_key_splits_keep_nan():
    # A NaN key makes the rows that see it NaN (out and lse) through the parts' fold, both ways alike; rows that share
    # its key block without seeing it, and rows whose band never reaches it, keep their bits.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("key splits of query chunks are the Hopper kernel's")
    runs = {mode: run_isolated({"FLASHATTN_DECODE_SPLITS": mode}, "op.test_kvcache", "nan_keys_under_splits")
            for mode in ("ctas", "in-turn")}
    for ((out, lse), (w_out, w_lse), (c_out, c_lse)) in runs.values():
        assert torch.isnan(out).all() and torch.isnan(lse).all(), "every row sees a NaN key under the causal mask"
        assert torch.equal(w_out[0], c_out[0]) and torch.equal(w_lse[0], c_lse[0]), "entry 0's band skips its NaN"
        assert torch.isnan(w_out[1, :, :39]).all() and torch.isnan(w_lse[1, :, :39]).all()
        assert torch.equal(w_out[1, :, 39:], c_out[1, :, 39:]) and torch.equal(w_lse[1, :, 39:], c_lse[1, :, 39:])
    for a, b in zip(runs["ctas"], runs["in-turn"]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


PAGED_CHUNKS = [(200, 37, [0, 113, 333, 731]), (17, 0, [0, 5, 333, 768])]  # (rows, appended rows, cache lengths)


def paged_chunks(head_dim, page_size, token_major=False, seed=0, num_splits=0):
    """Chunks of query rows against a 768-row bf16 cache (H8 / Hk2; PAGED_CHUNKS' entry lengths, NaN past them), dense
    and as `page_size`-row pages in a random order (spare pages NaN; token_major: (num_pages, page_size, Hk, D) pages
    transposed), for each score modification, `num_splits` key splits; each entry of both checked against the reference.
    Run in a process of its own to pick a kernel (FLASHATTN_FWD_SM90); returns ((dense out, lse), (paged out, lse))
    pairs."""
    torch.manual_seed(seed)
    batch, heads, heads_kv, capacity = 4, 8, 2, 768
    opts = dict(dtype=torch.bfloat16, device="cuda")
    results = []
    for len_q, len_new, lengths in PAGED_CHUNKS:
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        for mods in MODS:
            kwargs = mods_for(mods, heads, "cuda")
            k_cache, v_cache = (torch.randn(batch, heads_kv, capacity, head_dim, **opts) for _ in range(2))
            for cache in (k_cache, v_cache):
                poison_past(cache, lengths)
            *pages, block_table = cuda_pages(k_cache, v_cache, page_size, seed, token_major)
            q = torch.randn(batch, heads, len_q, head_dim, **opts)
            k, v = (torch.randn(batch, heads_kv, len_new, head_dim, **opts) if len_new else None for _ in range(2))
            dense = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True,
                                                          num_splits=num_splits, **kwargs)
            paged = flashattn_ext.flash_attn_with_kvcache(q, pages[0], pages[1], k, v, seqlens, block_table,
                                                          return_lse=True, num_splits=num_splits, **kwargs)
            assert torch.isfinite(paged[0]).all(), "no row past an entry's keys may reach the output"
            for b, n in enumerate(lengths):
                for t in range(len_new):  # the appended rows, in the dense cache and in their pages
                    page, row = int(block_table[b, (n + t) // page_size]), (n + t) % page_size
                    for cache, paged_cache, new in ((k_cache, pages[0], k), (v_cache, pages[1], v)):
                        assert torch.equal(cache[b, :, n + t], new[b, :, t])
                        assert torch.equal(paged_cache[page, :, row], new[b, :, t])
                e = slice(b, b + 1)
                rows = slice(0, n + len_new)
                for out, lse in (dense, paged):
                    assert_attention_close(out[e], lse[e], q[e], k_cache[e, :, rows], v_cache[e, :, rows], **kwargs)
            results.append((dense, paged))
    return results


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,page_size,token_major,num_splits", [
    (64, 16, False, 0), (128, 8, False, 0), (128, 64, True, 0), (128, 128, False, 0), (128, 256, False, 0),
    (256, 16, False, 0), (256, 64, True, 0), (128, 64, False, 3), (256, 16, False, 4)])
def test_cuda_paged_chunk_each_kernel(head_dim, page_size, token_major, num_splits):
    # A chunk against pages (a box per page, several per key block, or a block's part of a page) gives the dense
    # cache's output: bit for bit in the Hopper kernel (strict: it must take the call; with key splits too), close in
    # the portable one.
    args = ("op.test_kvcache", "paged_chunks", head_dim, page_size, token_major, 0, num_splits)
    for dense, paged in run_isolated({"FLASHATTN_FWD_SM90": "0"}, *args):
        torch.testing.assert_close(paged, dense, rtol=2e-2, atol=2e-2)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's half (the portable one's passed)")
    for dense, paged in run_isolated({"FLASHATTN_FWD_SM90": "strict"}, *args):
        assert torch.equal(paged[0], dense[0]) and torch.equal(paged[1], dense[1])


def strict_refusal_keeps_pages(page_size):
    """A chunk that appends keys to `page_size`-row pages the Hopper kernel cannot box, under FLASHATTN_FWD_SM90=strict
    (run in a process of its own): the call raises, and the pages keep their bits (the append runs only once the call
    is known to run)."""
    torch.manual_seed(0)
    opts = dict(dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (torch.randn(2, 2, 768, 128, **opts) for _ in range(2))
    *pages, block_table = cuda_pages(k_cache, v_cache, page_size)
    before = [t.clone() for t in pages]
    q, k, v = torch.randn(2, 8, 32, 128, **opts), *(torch.randn(2, 2, 4, 128, **opts) for _ in range(2))
    try:
        flashattn_ext.flash_attn_with_kvcache(q, pages[0], pages[1], k, v,
                                              torch.tensor([100, 300], dtype=torch.int32, device="cuda"), block_table)
    except RuntimeError as exc:
        torch.cuda.synchronize()
        return str(exc), all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pages, before))
    return "taken", False


@pytest.mark.cuda
def test_cuda_pages_the_hopper_kernel_cannot_box():
    # 24-row pages neither divide the kernel's key blocks nor are divided by them: the portable kernel takes the
    # chunk (right), and strict mode says why.
    for dense, paged in run_isolated({"FLASHATTN_FWD_SM90": "1"}, "op.test_kvcache", "paged_chunks", 128, 24):
        torch.testing.assert_close(paged, dense, rtol=2e-2, atol=2e-2)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel's half (the portable one's passed)")
    with pytest.raises(RuntimeError, match="pages of 24 rows"):
        run_isolated({"FLASHATTN_FWD_SM90": "strict"}, "op.test_kvcache", "paged_chunks", 128, 24)
    message, kept = run_isolated({"FLASHATTN_FWD_SM90": "strict"}, "op.test_kvcache", "strict_refusal_keeps_pages", 24)
    assert "pages of 24 rows" in message and kept, message


@pytest.mark.cuda
def test_cuda_short_queries_without_the_decode_path():
    # FLASHATTN_DECODE=0 sends a few query rows to the forward kernels: on Hopper (strict) the TMA one, whose maps
    # then hold one query row (Lq = 1) or a 16-row chunk.
    env = {"FLASHATTN_DECODE": "0"}
    if torch.cuda.get_device_capability() == (9, 0):
        env["FLASHATTN_FWD_SM90"] = "strict"
    chunks = [(1, 0, [0, 5, 333, 700]), (16, 16, [0, 3, 333, 684])]
    run_isolated(env, "op.test_kvcache", "chunk_checked", 128, "tokens", chunks)


@pytest.mark.cuda
@pytest.mark.parametrize("len_q", [1, 20])  # 20: the chunk path, whose preparation reads the lengths on the device
def test_cuda_graph_replays_new_lengths(len_q):
    # Lengths live on the device only: a decode step captured once replays with new cache_seqlens.
    k_cache, v_cache = cuda_caches([CUDA_LMAX] * B)
    q = torch.randn(B, H, len_q, CUDA_D, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor([10, 20, 30], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    for lengths in ([1, 500, 0], [512, 512, 512], [64, 65, 129]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        want = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
        assert torch.equal(out, want)


@pytest.mark.cuda
def test_cuda_graph_replays_new_left_paddings():
    # Left paddings live on the device only too: a captured step replays with new cache_leftpad values.
    k_cache, v_cache = cuda_caches([CUDA_LMAX] * B)
    q = torch.randn(B, H, 1, CUDA_D, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor([100, 300, 512], dtype=torch.int32, device="cuda")
    leftpad = torch.zeros(B, dtype=torch.int32, device="cuda")

    def step():
        return flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                     cache_leftpad=leftpad, return_lse=True)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, lse = step()
    torch.cuda.current_stream().wait_stream(stream)
    for pads in ([0, 0, 0], [99, 1, 511], [100, 150, 0]):
        leftpad.copy_(torch.tensor(pads, dtype=torch.int32))
        graph.replay()
        want = step()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        for b, (n, start) in enumerate(zip(seqlens.tolist(), pads)):
            keys, values = k_cache[b : b + 1, :, start:n], v_cache[b : b + 1, :, start:n]
            assert_attention_close(out[b : b + 1], lse[b : b + 1], q[b : b + 1], keys, values, causal=True)


@pytest.mark.cuda
def test_cuda_graph_replays_a_paged_append():
    # A decoding step (a token appended to a paged cache, then attention) captured once replays with new lengths
    # (entries of length 0 too) and new tokens: the eager step's output and pages, bit for bit, on copies of the pages.
    k_cache, v_cache = cuda_caches([CUDA_LMAX // 2] * B)  # NaN from row 256 on
    k_pages, v_pages, block_table = cuda_pages(k_cache, v_cache, 64)
    q = torch.randn(B, H, 1, CUDA_D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, HK, 1, CUDA_D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda")

    def step(k_pages, v_pages):
        return flashattn_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, seqlens, block_table, causal=True)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step(k_pages, v_pages)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step(k_pages, v_pages)
    torch.cuda.current_stream().wait_stream(stream)
    for lengths in ([0, 100, CUDA_LMAX // 2], [200, 0, 7], [63, 64, 65]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        for t in (q, k, v):
            t.normal_()
        pages = (k_pages.clone(), v_pages.clone())
        want = step(*pages)
        graph.replay()
        assert torch.isfinite(want).all() and torch.equal(out, want)
        for got_pages, want_pages in zip((k_pages, v_pages), pages):  # as bits: rows past the lengths hold NaN
            assert torch.equal(got_pages.view(torch.int16), want_pages.view(torch.int16))


@pytest.mark.cuda
def test_cuda_paged_cache_in_token_major_layout():
    # A (num_pages, page_size, Hk, D) cache (vLLM's), passed as a transposed view: the same bits and the same appends.
    lengths = [3, 300, CUDA_LMAX - 1]
    k_pages, v_pages, block_table = cuda_pages(*cuda_caches(lengths), 64)
    k_tok, v_tok = (pages.transpose(1, 2).contiguous() for pages in (k_pages, v_pages))
    q = torch.randn(B, H, 1, CUDA_D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, HK, 1, CUDA_D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    want = flashattn_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, seqlens, block_table, causal=True)
    got = flashattn_ext.flash_attn_with_kvcache(q, k_tok.transpose(1, 2), v_tok.transpose(1, 2), k, v, seqlens,
                                                block_table, causal=True)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    for tok, pages in ((k_tok, k_pages), (v_tok, v_pages)):
        assert torch.equal(tok.transpose(1, 2).view(torch.int16), pages.view(torch.int16))


@pytest.mark.cuda
def test_cuda_block_table_as_a_column_slice():
    # A column slice of a wider block table (its rows at a stride) is read in place, by the append and the attention:
    # the same bits and pages as with its contiguous copy.
    lengths = [5, 300, CUDA_LMAX - 2]
    k_pages, v_pages, block_table = cuda_pages(*cuda_caches(lengths), 64)
    wide = torch.full((B, block_table.shape[1] + 5), -1, dtype=torch.int32, device="cuda")
    wide[:, : block_table.shape[1]] = block_table
    sliced = wide[:, : block_table.shape[1]]
    assert not sliced.is_contiguous()
    q = torch.randn(B, H, 2, CUDA_D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, HK, 2, CUDA_D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    runs = []
    for table in (block_table, sliced):
        pages = (k_pages.clone(), v_pages.clone())
        runs.append((flashattn_ext.flash_attn_with_kvcache(q, *pages, k, v, seqlens, table, causal=True), pages))
    (want, want_pages), (got, got_pages) = runs
    assert torch.isfinite(want).all() and torch.equal(got, want)
    for a, b in zip(got_pages, want_pages):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.cuda
def test_cuda_appends_past_the_cache_are_dropped():
    # Lengths that break the rules: rows whose positions fall past the cache are not written (clamped, three rows would
    # land on the last one in no fixed order); those inside are.
    k_cache, v_cache = cuda_caches([CUDA_LMAX] * B)
    k, v = (torch.randn(B, HK, 4, CUDA_D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.full((B,), CUDA_LMAX - 2, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, 1, CUDA_D, dtype=torch.bfloat16, device="cuda")
    want_k = k_cache.clone()
    want_k[:, :, -2:] = k[:, :, :2]
    flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens)
    assert torch.equal(k_cache, want_k)


@pytest.mark.cuda
def test_cuda_more_batch_entries_than_a_grid_dimension_holds():
    # 70000 entries: past CUDA's 65535 along the decode grid's z, the batch continues in a second chunk along x. Each
    # entry is right and has the bits it has in a batch of its own (the kernel does not change with the batch size).
    batch = 70000
    q = torch.randn(batch, 4, 1, 64, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, 2, 32, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for call in (lambda *a: flashattn_ext.flash_attn_with_lse(*a),
                 lambda *a: flashattn_ext.flash_attn_with_kvcache(*a, return_lse=True)):
        out, lse = call(q, k, v)
        for b in (0, 65534, 65535, 65536, batch - 1):
            entry = slice(b, b + 1)
            assert_attention_close(out[entry], lse[entry], q[entry], k[entry], v[entry])
            alone = call(q[entry], k[entry], v[entry])
            assert torch.equal(out[entry], alone[0]) and torch.equal(lse[entry], alone[1])


@pytest.mark.cuda
def test_cuda_bad_values_never_fault():
    # cache_seqlens and block_table values cannot be checked without a synchronisation: clamped, never a fault.
    k_cache, v_cache = cuda_caches([CUDA_LMAX] * B)
    k_pages, v_pages, block_table = cuda_pages(k_cache, v_cache, 64)
    q = torch.randn(B, H, 1, CUDA_D, dtype=torch.bfloat16, device="cuda")
    k = v = torch.randn(B, HK, 3, CUDA_D, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor([-7, CUDA_LMAX, 10**6], dtype=torch.int32, device="cuda")
    flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens)
    block_table[0, 0], block_table[1, 3] = -1, 10**6
    flashattn_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, seqlens, block_table)
    torch.cuda.synchronize()


# ---- a decode loop -------------------------------------------------------------------------------------------------


def tiny_decoder(vocab, dim, heads, heads_kv, layers, max_len, dtype, device, seed=0):
    """Weights of a small pre-norm decoder (learned positions, attention with GQA, a GELU MLP), logits scaled up so
    that greedy choices are not near-ties."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    head_dim = dim // heads
    return dict(
        heads=heads, heads_kv=heads_kv, head_dim=head_dim, emb=w(vocab, dim, scale=1.0), pos=w(max_len, dim, scale=0.5),
        layers=[dict(wq=w(dim, heads * head_dim, scale=dim**-0.5), wk=w(dim, heads_kv * head_dim, scale=dim**-0.5),
                     wv=w(dim, heads_kv * head_dim, scale=dim**-0.5), wo=w(heads * head_dim, dim, scale=dim**-0.5),
                     w1=w(dim, 2 * dim, scale=dim**-0.5), w2=w(2 * dim, dim, scale=(2 * dim) ** -0.5))
                for _ in range(layers)],
        unembed=w(dim, vocab, scale=4 * dim**-0.5),
    )


def decoder_step(model, tokens, start, attend):
    """Logits of the last of `tokens` (B, T), at positions start .. start + T - 1; attend(layer, q, k, v) with q
    (B, H, T, D) and the new k, v (B, Hk, T, D) keeps the layer's cache and returns (B, H, T, D)."""
    x = model["emb"][tokens] + model["pos"][start : start + tokens.shape[1]]
    batch, steps = tokens.shape
    for i, layer in enumerate(model["layers"]):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        q, k, v = (
            (h @ layer[name]).view(batch, steps, -1, model["head_dim"]).transpose(1, 2) for name in ("wq", "wk", "wv")
        )
        x = x + attend(i, q, k, v).transpose(1, 2).reshape(batch, steps, -1) @ layer["wo"]
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        x = x + torch.nn.functional.gelu(h @ layer["w1"]) @ layer["w2"]
    return (torch.nn.functional.rms_norm(x[:, -1], (x.shape[-1],)) @ model["unembed"]).float()


def greedy(model, prompt, new_tokens, attend):
    tokens, start, step = prompt, 0, prompt
    for _ in range(new_tokens):
        next_token = decoder_step(model, step, start, attend).argmax(-1, keepdim=True)
        start += step.shape[1]
        step = next_token
        tokens = torch.cat([tokens, next_token], 1)
    return tokens


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.float16])
def test_greedy_decode_loop_matches_sdpa(device, dtype, paged):
    # A small GQA model decodes 64 tokens greedily, its K/V appended into our cache (dense, or pages in a random
    # order) and attended through flash_attn_with_kvcache: the same tokens as with SDPA over concatenated K/V.
    batch, prompt_len, new_tokens, page_size = 2, 9, 64, 16
    max_len = prompt_len + new_tokens
    model = tiny_decoder(48, 128, 8, 2, 2, max_len, dtype, device)
    prompt = torch.randint(0, 48, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)

    past = {}

    def sdpa(layer, q, k, v):
        keys, values = past.get(layer, (k[:, :, :0], v[:, :, :0]))
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        past[layer] = (keys, values)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=q.shape[2] > 1,
                                                                enable_gqa=True)

    want = greedy(model, prompt, new_tokens, sdpa)

    shape = (batch, model["heads_kv"], max_len, model["head_dim"])
    pages_per_entry = (max_len + page_size - 1) // page_size
    num_pages = batch * pages_per_entry + 2
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2))[: batch * pages_per_entry]
    block_table = order.view(batch, pages_per_entry).to(torch.int32).to(device)
    page_shape = (num_pages, model["heads_kv"], page_size, model["head_dim"])
    caches = [tuple(torch.full(page_shape if paged else shape, float("nan"), dtype=dtype, device=device)
                    for _ in range(2)) for _ in model["layers"]]
    lengths = [torch.zeros(batch, dtype=torch.int32, device=device) for _ in model["layers"]]

    def ours(layer, q, k, v):
        k_cache, v_cache = caches[layer]
        out = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths[layer],
                                                    block_table=block_table if paged else None, causal=True)
        lengths[layer] += k.shape[2]
        return out

    got = greedy(model, prompt, new_tokens, ours)
    assert torch.equal(got, want)
