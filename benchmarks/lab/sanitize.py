"""A few small forward and backward calls for compute-sanitizer (memcheck, racecheck): odd lengths, causal, GQA,
Lq != Lk, rows without keys. FLASHATTN_CUDA_BWD=fused checks the fused backward kernel.

Usage: compute-sanitizer --tool memcheck python benchmarks/lab/sanitize.py [--head-dims 128,256] [--deterministic]
[--options] [--varlen] [--kvcache]

--head-dims keeps the cases whose head dim runs in those Hopper kernels (64, 128, 256: the smallest that holds it), with
--varlen and --kvcache too, for a change to one of them: racecheck over every case takes about 150 s of device time on
the H200. A build of some head-dim buckets (FLASHATTN_HEADDIMS) runs only the cases those buckets hold. --options runs
each case with one of OPTION_SETS (windows, softcap, sinks: the kernels' options variants) in turn. --varlen runs packed
sequences instead (VARLEN_CASES, each plain and with every option set), and cu_seqlens whose values break the rules
(they must give wrong rows, never an access outside the tensors). --kvcache runs KV cache calls (KVCACHE_CASES: the
decode path, and query chunks, also in key splits) over dense and paged caches, with new keys appended, left padding,
and a block table with pages out of range.

Under racecheck the process's host memory grows with the run: over all cases with --options --deterministic (124 calls)
it reached the GPU machine's 128 GiB and was killed; run such sets a head dim at a time (--head-dims 64, 128, 256).
"""
import argparse
import json
import os
from pathlib import Path

import torch

import flashattn_ext

CASES = [  # (batch, heads, heads_kv, len_q, len_k, head_dim, causal)
    (1, 2, 2, 7, 7, 64, True),
    (2, 4, 2, 65, 97, 128, True),
    (1, 4, 1, 129, 63, 40, False),
    (1, 2, 2, 1, 257, 256, True),
    (1, 2, 2, 200, 33, 96, True),  # rows without keys
    (2, 12, 6, 1300, 1300, 64, True),  # 264 causal tiles: two zigzag rounds per CTA on the Hopper forward
    (2, 12, 6, 1300, 300, 128, True),  # the same with 7 of each head's 11 tiles seeing no key
    (4, 16, 4, 1000, 300, 120, False),  # 512 tiles of 128-key blocks: an O buffer per consumer, Q in registers
    (2, 4, 2, 300, 2300, 120, False),  # 18 key blocks, the last of 124 keys
    (4, 8, 8, 1000, 200, 64, False),  # 192 tiles of three consumers; in each head's last, two without rows idle
    (4, 8, 4, 1000, 1000, 256, True),  # 256 causal tiles at D256: one O buffer and the V stages
    (1, 2, 2, 100, 8300, 256, True),  # causal D256 over more than 2048 keys: 80-key blocks, O in Q rows and V
    (2, 8, 4, 2400, 2100, 256, True),  # 304 such tiles, two per head seeing no key
    (2, 4, 2, 300, 500, 256, False),  # D256 up to 512 keys: 64-key blocks, O in one buffer and the V stages
    (1, 2, 2, 30, 1100, 256, False),  # D256 over 512 keys: 80-key blocks, O in the last K and V; a consumer rowless
    (4, 16, 4, 600, 1100, 256, False),  # 320 such tiles: two or three per CTA
    (1, 2, 1, 2100, 2100, 64, True),  # causal D64 from 1024 queries and keys: 192-row tiles, three consumers
    (2, 4, 2, 1030, 1030, 64, True),  # each head's first tile: consumer 0 without rows; consumers skip key blocks
    (1, 2, 2, 1500, 2900, 64, True),  # consumers skip key blocks, keys offset by 1400 (bottom-right)
    (2, 12, 6, 2048, 2048, 64, True),  # 264 tiles, two zigzag rounds per CTA; a head's first: consumer 0 without rows
    (2, 16, 8, 1024, 1024, 64, True),  # 192 tiles from the counter; a head's first: consumers 0 and 1 without rows
    (1, 2, 2, 4200, 2100, 64, True),  # 192-row tiles, some that see no key
    (2, 12, 6, 2100, 2100, 64, True),  # 264 tiles of 192 rows: two zigzag rounds per CTA
    (2, 12, 6, 4200, 2100, 64, True),  # 528 of them, those that see no key mixed in
    (1, 4, 2, 1000, 1300, 64, True),  # keys offset by 300, below 1024 queries: the two-consumer causal D64 kernel
    (2, 4, 2, 1153, 1153, 64, True),  # a head's first tile starts at row -176: only consumer 2's last O box stored
    (1, 2, 2, 2900, 3000, 64, True),  # keys offset by 100: consumer 2's rows cross row 0 and see keys
    (1, 2, 1, 700, 8300, 128, True),  # causal D128, keys offset by 7600 (176-key blocks here until v25)
    (1, 40, 20, 1000, 2150, 128, False),  # 320 tiles of 13 key blocks on 132 SMs: the last 188 split (stream-K)
    (1, 40, 20, 1000, 2000, 128, False),  # the same in the 128-key kernel (16 key blocks)
    (8, 64, 8, 40, 600, 64, False),  # 512 tiles with rows for consumer 0 only, about four per CTA
]


# Score modifications for --options, case i taking set i mod 4: a causal window, a two-sided one with softcap, a
# left-only one with sinks, softcap with sinks.
OPTION_SETS = [
    dict(window_size=(37, 0)),
    dict(window_size=(50, 20), softcap=5.0),
    dict(window_size=(300, -1), sinks=True),
    dict(softcap=30.0, sinks=True),
]


# Packed sequences for --varlen: (Lq_b, Lk_b) per sequence, heads, kv heads, head dim. Empty sequences, Lq != Lk both
# ways, one sequence longer than a block, and a batch with no keys at all.
VARLEN_CASES = [
    ([(1, 1), (7, 9), (0, 5), (130, 40), (4, 0), (300, 300)], 4, 2, 64),
    ([(65, 130), (129, 129), (1, 600)], 4, 1, 128),
    ([(200, 200), (0, 0), (33, 17)], 2, 2, 256),  # the backward above D128: Hopper only
    ([(5, 0), (70, 0)], 2, 2, 128),
]
BAD_CU_SEQLENS = [[0, 1000, 7], [0, -5, 7], [0, 3, 2], [5, 2, 1]]  # for 7 packed rows


def run_varlen(head_dims=None, built=None):
    calls = 0
    for pairs, heads, heads_kv, head_dim in select_cases(head_dims, VARLEN_CASES, 3, built):
        for mods, causal in [({}, False), ({}, True)] + [(m, True) for m in OPTION_SETS]:
            mods = dict(mods)
            if mods.get("sinks") is not None:
                mods["sinks"] = torch.linspace(-1, 1, heads, device="cuda").requires_grad_()
            cu = [torch.tensor([0] + torch.tensor([p[i] for p in pairs]).cumsum(0).tolist(), dtype=torch.int32,
                               device="cuda") for i in (0, 1)]
            grad = head_dim <= 128 or torch.cuda.get_device_capability() == (9, 0)  # above D128: Hopper only
            q = torch.randn(int(cu[0][-1]), heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            k, v = (torch.randn(int(cu[1][-1]), heads_kv, head_dim, device="cuda", dtype=torch.bfloat16,
                                requires_grad=grad) for _ in range(2))
            out, lse = flashattn_ext.flash_attn_varlen_with_lse(q, k, v, cu[0], cu[1], causal=causal, **mods)
            calls += 1
            if grad:
                (out.float().square().sum() + lse.masked_fill(lse.isinf(), 0).sum()).backward()
                calls += 1
    q = k = v = torch.randn(7, 2, 64, device="cuda", dtype=torch.bfloat16)
    for bad in BAD_CU_SEQLENS if select_cases(head_dims, [(64,)], 0, built) else []:  # a head dim of 64
        cu = torch.tensor(bad, dtype=torch.int32, device="cuda")
        flashattn_ext.flash_attn_varlen(q, k, v, cu, cu, causal=True)
        calls += 1
    return calls


# KV cache calls for --kvcache: (batch, heads, heads_kv, len_q, new keys, cache rows, head dim, page size), cache
# lengths from 0 to full; a page size of 0 runs the dense cache.
KVCACHE_CASES = [
    (3, 8, 2, 1, 0, 300, 128, 0),
    (3, 8, 2, 1, 1, 300, 128, 16),
    (2, 32, 8, 4, 0, 1030, 128, 64),  # two row groups of 16 packed rows, several splits
    (2, 4, 4, 1, 2, 200, 64, 7),  # pages that cut a key block anywhere
    (2, 6, 2, 3, 0, 500, 256, 256),
    (1, 4, 1, 1, 0, 4100, 128, 1),  # one row a page, 64 splits
    (3, 8, 2, 37, 37, 700, 128, 0),  # query chunks past the decode path: on Hopper, its TMA forward
    (2, 4, 2, 200, 0, 333, 64, 0),
    (2, 4, 4, 130, 5, 300, 256, 0),
    (2, 8, 2, 40, 40, 512, 128, 64),  # chunks against pages: a box per page (Hopper)
    (3, 4, 2, 150, 7, 528, 256, 16),
    (2, 4, 2, 100, 3, 480, 64, 24),  # pages the Hopper kernel cannot box: the portable forward
]


def run_kvcache(head_dims=None, built=None):
    calls = 0
    for batch, heads, heads_kv, len_q, new, rows, head_dim, page in select_cases(head_dims, KVCACHE_CASES, 6, built):
        for mods in [{"causal": True}] + OPTION_SETS:
            mods = dict(mods)
            if mods.get("sinks") is not None:
                mods["sinks"] = torch.linspace(-1, 1, heads, device="cuda")
            opts = dict(device="cuda", dtype=torch.bfloat16)
            q = torch.randn(batch, heads, len_q, head_dim, **opts)
            k_new, v_new = (torch.randn(batch, heads_kv, new, head_dim, **opts) if new else None for _ in range(2))
            lengths = torch.linspace(0, rows - new, batch).to(device="cuda", dtype=torch.int32)
            if page == 0:
                k_cache, v_cache = (torch.randn(batch, heads_kv, rows, head_dim, **opts) for _ in range(2))
                table = None
            else:
                per_entry = -(-rows // page)
                k_cache, v_cache = (torch.randn(batch * per_entry, heads_kv, page, head_dim, **opts) for _ in range(2))
                table = torch.randperm(batch * per_entry, device="cuda", dtype=torch.int32).view(batch, per_entry)
            flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                 block_table=table, **mods)
            calls += 1
            if len_q > 16:  # a chunk's key splits (on Hopper; FLASHATTN_DECODE_SPLITS picks how they run)
                flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                     num_splits=3, **mods)
                calls += 1
            if table is None:  # left padding: none, inside the entry, past its end (clamped)
                share = torch.arange(batch, device="cuda") * 3 / (2 * max(1, batch - 1))
                leftpad = (lengths * share).to(torch.int32)
                flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                     cache_leftpad=leftpad, **mods)
                calls += 1
            if table is not None:  # pages out of range: wrong rows, never an access outside the cache
                bad = table.clone()
                bad[:, ::2] = 10**6
                bad[:, 1::2] = -3
                flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=bad)
                calls += 1
    return calls


def bucket(head_dim):
    """The head dim of the Hopper kernels that run head_dim (kernel_table.h, sm90_kernel_head_dim: the smallest of 64,
    128 and 256 that holds it)."""
    return next(b for b in (64, 128, 256) if head_dim <= b)


KERNEL_TABLE = Path(__file__).resolve().parents[2] / "csrc/cuda/kernels.json"
BUILD_BUCKETS = sorted(json.loads(KERNEL_TABLE.read_text())["buckets"])


def build_bucket(head_dim):
    """The build's head-dim bucket that holds head_dim (FLASHATTN_HEADDIMS names these): the smallest at least it."""
    return next(b for b in BUILD_BUCKETS if head_dim <= b)


def select_cases(head_dims=None, cases=CASES, dim_index=5, built=None):
    """The cases (CASES, VARLEN_CASES or KVCACHE_CASES, their head dim at dim_index) whose head dim runs in one of
    the buckets head_dims (all with None) and, with built (the build's buckets), whose build bucket is there: a build
    of some buckets raises for the others."""
    return [case for case in cases if (head_dims is None or bucket(case[dim_index]) in head_dims)
            and (built is None or build_bucket(case[dim_index]) in built)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", default=None,
                        help="comma-separated buckets (64, 128, 256) whose cases run; default: every case")
    parser.add_argument("--options", action="store_true", help="each case with windows, softcap or sinks")
    parser.add_argument("--deterministic", action="store_true",
                        help="under torch.use_deterministic_algorithms(True): the Hopper backward's ordered dQ")
    parser.add_argument("--varlen", action="store_true", help="packed sequences, and cu_seqlens that break the rules")
    parser.add_argument("--kvcache", action="store_true", help="KV cache calls over dense and paged caches")
    args = parser.parse_args()
    if args.deterministic:  # the chunked backward (D256) then runs cuBLAS, which needs a fixed workspace for it
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(args.deterministic)
    head_dims = None if args.head_dims is None else {int(d) for d in args.head_dims.split(",")}
    if head_dims is not None and not head_dims <= {64, 128, 256}:
        raise SystemExit(f"--head-dims: buckets are 64, 128 and 256, not {args.head_dims}")
    built = set(torch.ops.flashattn.cuda_head_dims())
    if built != set(BUILD_BUCKETS):
        print(f"sanitize: a build of buckets {sorted(built)}: cases of the others left out")
    if args.varlen:
        calls = run_varlen(head_dims, built)
        torch.cuda.synchronize()
        print(f"sanitize: {calls} packed forward/backward calls done")
        return
    if args.kvcache:
        calls = run_kvcache(head_dims, built)
        torch.cuda.synchronize()
        print(f"sanitize: {calls} decode calls done")
        return
    calls = 0
    cases = select_cases(head_dims, built=built)
    for index, (batch, heads, heads_kv, len_q, len_k, head_dim, causal) in enumerate(cases):
        mods = dict(OPTION_SETS[index % len(OPTION_SETS)]) if args.options else {}
        for dtype in (torch.bfloat16, torch.float16):
            if mods.get("sinks") is not None:
                mods["sinks"] = torch.linspace(-1, 1, heads, device="cuda").requires_grad_()
            q = torch.randn(batch, heads, len_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(batch, heads_kv, len_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(batch, heads_kv, len_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
            out, lse = flashattn_ext.flash_attn_with_lse(q, k, v, causal, **mods)
            assert out.shape == q.shape and lse.shape == (batch, heads, len_q)
            (out.float().square().sum() + lse.masked_fill(lse.isinf(), 0).sum()).backward()
            assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
            calls += 2
    torch.cuda.synchronize()
    print(f"sanitize: {calls} forward/backward calls done")


if __name__ == "__main__":
    main()
