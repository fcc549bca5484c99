"""Same bits from several builds: the forward's out and lse (with --backward also the gradients) over a grid of cases,
one process per build, compared bit by bit with the first build's.

A change meant to leave the arithmetic alone (a schedule, a pipeline order, a refactor of a kernel) gives the same
bits; this checks it in seconds where the test suite takes minutes, and names the cases that differ. Each build runs
under a timeout and prints each case before running it, so a build that hangs names the case it hangs in instead of
holding the GPU until the caller's limit.

    python benchmarks/lab/same_bits.py --build main=/tmp/main --build new=. [--head-dims 64,128] [--backward]

Each build is a source tree with the extension built in place (as for ncu_ab.py). The grid, per head dim: the dense
op at (L_q, L_k) pairs from 1 to 4097 and one of 16384, causal or not, with no window and with four windows, GQA 1 and
4, every third case also with softcap 30 and with sinks, every seventh also in fp16; packed sequences (two batches of
odd lengths, three windows, softcap and sinks with GQA); a dense and a paged KV cache (three entries of 4096 rows: none,
a third and all of them valid, the decoding row appending a key; 1, 4 and 130 query rows). With --backward the runs are
deterministic (the default dQ adds in a changing order) and take the gradients of q, k, v and the sinks of the dense
and packed cases too. --device cpu runs the CPU path (the tool's own test); --quick a grid of short lengths.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_ab import add_build_argument, parse_builds  # noqa: E402  (the --build arguments, as ncu_ab.py takes them)

LENGTHS = [(1, 1), (7, 63), (65, 97), (129, 1025), (1025, 129), (300, 300), (2048, 2048), (4097, 4097),
           (16384, 16384)]
QUICK_LENGTHS = [(1, 1), (7, 63), (65, 97), (129, 65)]
WINDOWS = [(-1, -1), (1024, 0), (127, 0), (64, 64), (300, -1)]
# Packed sequences: each sequence's (L_q, L_k).
PACKED = [((1, 1), (65, 65), (300, 300), (1025, 1025)), ((7, 63), (129, 129), (1, 300), (513, 700))]
QUICK_PACKED = [((1, 1), (7, 7), (65, 65)), ((7, 63), (1, 9), (65, 129))]
# KV caches: the rows each entry holds, and the query rows.
CACHE_ROWS, QUICK_CACHE_ROWS = 4096, 128
CACHE_QUERIES, QUICK_CACHE_QUERIES = (1, 4, 130), (1, 4, 17)


def cases(head_dims, quick=False):
    """The grid: one dict per case, in a fixed order (its index seeds the case's inputs)."""
    return dense_cases(head_dims, quick) + packed_cases(head_dims, quick) + cache_cases(head_dims, quick)


def packed_cases(head_dims, quick):
    grid = []
    for head_dim in head_dims:
        for lengths in QUICK_PACKED if quick else PACKED:
            for causal in (False, True):
                for window in ((-1, -1), (1024, 0), (64, 64)):
                    for gqa in (1, 4):
                        base = dict(kind="packed", head_dim=head_dim, lengths=lengths, causal=causal, window=window,
                                    gqa=gqa, softcap=0.0, sinks=False, dtype="bf16")
                        grid += [base] + ([dict(base, softcap=30.0), dict(base, sinks=True)] if gqa == 4 else [])
    return grid


def cache_cases(head_dims, quick):
    grid = []
    for head_dim in head_dims:
        for paged in (False, True):
            for lq in QUICK_CACHE_QUERIES if quick else CACHE_QUERIES:
                for causal in (False, True):
                    for window in ((-1, -1), (1024, 0)):
                        for gqa in (1, 4):
                            grid.append(dict(kind="paged" if paged else "cache", head_dim=head_dim, lq=lq,
                                             rows=QUICK_CACHE_ROWS if quick else CACHE_ROWS, page=16 if quick else 64,
                                             causal=causal, window=window, gqa=gqa, softcap=0.0, sinks=False,
                                             dtype="bf16", append=lq == 1))
    return grid


def dense_cases(head_dims, quick):
    grid, plain = [], 0
    for head_dim in head_dims:
        for lq, lk in QUICK_LENGTHS if quick else LENGTHS:
            for causal in (False, True):
                for window in WINDOWS:
                    for gqa in (1, 4):
                        base = dict(kind="dense", head_dim=head_dim, lq=lq, lk=lk, causal=causal, window=window,
                                    gqa=gqa, softcap=0.0, sinks=False, dtype="bf16")
                        grid.append(base)
                        if plain % 3 == 0:
                            grid.append(dict(base, softcap=30.0))
                            grid.append(dict(base, sinks=True))
                        if plain % 7 == 0:
                            grid.append(dict(base, dtype="fp16"))
                        plain += 1
    return grid


def describe(case):
    kind = case["kind"]
    shape = (f"packed {case['lengths']}" if kind == "packed"
             else f"{kind} Lq {case['lq']}{' appending' if case['append'] else ''}" if kind in ("cache", "paged")
             else f"Lq {case['lq']} Lk {case['lk']}")
    text = (f"D{case['head_dim']} {shape} {'causal' if case['causal'] else 'non-causal'} "
            f"window {case['window']} GQA {case['gqa']} {case['dtype']}")
    if case["softcap"]:
        text += f" softcap {case['softcap']:g}"
    if case["sinks"]:
        text += " sinks"
    return text


def run_case(fa, torch, case, index, device, backward):
    """The case's outputs (out, lse, and with backward the gradients; with a cache, the caches), moved to the CPU."""
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float16
    heads, d, kind = 8, case["head_dim"], case["kind"]
    kv_heads = heads // case["gqa"]
    gen = torch.Generator(device=device).manual_seed(index)

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dtype, generator=gen)

    sinks = torch.randn(heads, device=device, generator=gen) if case["sinks"] else None
    options = dict(causal=case["causal"], window_size=case["window"], softcap=case["softcap"], sinks=sinks)
    if kind in ("cache", "paged"):
        return [r.cpu() for r in run_cache_case(fa, torch, case, randn, gen, heads, kv_heads, options)]
    if kind == "packed":
        lengths_q, lengths_k = zip(*case["lengths"])
        cu_q, cu_k = (torch.tensor((0, *lengths), device=device).cumsum(0).to(torch.int32)
                      for lengths in (lengths_q, lengths_k))
        q = randn(sum(lengths_q), heads, d)
        k, v = randn(sum(lengths_k), kv_heads, d), randn(sum(lengths_k), kv_heads, d)

        def attend(q, k, v):
            return fa.flash_attn_varlen_with_lse(q, k, v, cu_q, cu_k, **options)
    else:
        batch = 2 if case["lq"] * case["lk"] < 4096 * 4096 else 1
        q = randn(batch, heads, case["lq"], d)
        k, v = randn(batch, kv_heads, case["lk"], d), randn(batch, kv_heads, case["lk"], d)

        def attend(q, k, v):
            return fa.flash_attn_with_lse(q, k, v, **options)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    if backward:
        for x in inputs:
            x.requires_grad_(True)
    out, lse = attend(q, k, v)
    results = [out, lse]
    if backward:
        results += list(torch.autograd.grad(out, inputs, randn(*out.shape)))
    return [r.detach().cpu() for r in results]


def run_cache_case(fa, torch, case, randn, gen, heads, kv_heads, options):
    """Three entries against a dense or paged cache, valid for 0 rows, a third of them and all but the one each appends
    (where the case appends); returns out, lse and the caches (appended to)."""
    device, d, rows, page = gen.device, case["head_dim"], case["rows"], case["page"]
    appended = 1 if case["append"] else 0
    seqlens = torch.tensor([0, rows // 3, rows - appended], device=device, dtype=torch.int32)
    q = randn(3, heads, case["lq"], d)
    k_new, v_new = (randn(3, kv_heads, 1, d), randn(3, kv_heads, 1, d)) if appended else (None, None)
    if case["kind"] == "paged":  # the pages of all entries in a random order
        num_pages = 3 * rows // page
        table = torch.randperm(num_pages, device=device, generator=gen).to(torch.int32).view(3, rows // page)
        k_cache, v_cache = randn(num_pages, kv_heads, page, d), randn(num_pages, kv_heads, page, d)
    else:
        table = None
        k_cache, v_cache = randn(3, kv_heads, rows, d), randn(3, kv_heads, rows, d)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                          return_lse=True, **options)
    return [out, lse, k_cache, v_cache]


def run(out_path, head_dims, device, backward, quick):
    """One build's outputs over the grid, saved to out_path; each case named before it runs."""
    import torch

    import flashattn_ext

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic or backward)
    try:
        results = {}
        for index, case in enumerate(cases(head_dims, quick)):
            print(f"case {index}: {describe(case)}", flush=True)
            results[index] = run_case(flashattn_ext, torch, case, index, device, backward)
            if device == "cuda":
                torch.cuda.synchronize()
        torch.save(results, out_path)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def same_bits(x, y):
    """Whether two tensors hold the same bits (NaNs included)."""
    import torch

    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def largest_difference(x, y):
    """The largest |x - y|, NaN in both counting as equal and in one as infinite."""
    x, y = x.double(), y.double()
    both_nan = x.isnan() & y.isnan()
    diff = (x - y).abs().masked_fill(both_nan, 0.0).nan_to_num(float("inf"))
    return diff.max().item() if diff.numel() else 0.0


def compare(base, other):
    """[(case index, the largest |difference| over its outputs)] for the cases whose bits differ."""
    differing = []
    for index in sorted(base):
        pairs = list(zip(base[index], other.get(index, [])))
        if len(pairs) != len(base[index]) or not all(same_bits(x, y) for x, y in pairs):
            largest = max((largest_difference(x, y) for x, y in pairs if x.shape == y.shape), default=float("inf"))
            differing.append((index, largest))
    return differing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_build_argument(parser)
    parser.add_argument("--head-dims", default="128", help="comma list of head dims")
    parser.add_argument("--backward", action="store_true", help="the gradients too (deterministic)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="a grid of short lengths (the tool's own test)")
    parser.add_argument("--fwd-sm90", default="strict", help="FLASHATTN_FWD_SM90 for the runs (strict: Hopper only)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per build")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"), help="where each build's outputs go")
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)  # one build's run itself
    args = parser.parse_args()
    head_dims = [int(d) for d in args.head_dims.split(",")]
    if args.run:
        run(args.run, head_dims, args.device, args.backward, args.quick)
        return
    builds = parse_builds(args.build)

    import torch

    grid = cases(head_dims, args.quick)
    outputs, failed = {}, False
    for name, build_dir in builds:
        path = args.workdir / f"same_bits_{name}.pt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run", str(path), "--head-dims", args.head_dims,
               "--device", args.device]
        cmd += (["--backward"] if args.backward else []) + (["--quick"] if args.quick else [])
        env = dict(os.environ, PYTHONPATH=str(Path(build_dir).resolve()), FLASHATTN_FWD_SM90=args.fwd_sm90,
                   CUBLAS_WORKSPACE_CONFIG=":4096:8")
        try:
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            ok, text = result.returncode == 0, result.stdout + result.stderr
        except subprocess.TimeoutExpired as timeout:
            ok, text = False, (timeout.stdout or b"").decode(errors="replace") + "\n(timed out)"
        if not ok:
            failed = True
            started = [line for line in text.splitlines() if line.startswith("case ")]
            print(f"{name}: failed in {started[-1] if started else 'its start'}\n{text[-1500:]}")
            continue
        outputs[name] = torch.load(path)
    base_name = builds[0][0]
    if base_name not in outputs:
        raise SystemExit(1)
    for name, _ in builds[1:]:
        if name not in outputs:
            continue
        differing = compare(outputs[base_name], outputs[name])
        failed = failed or bool(differing)
        print(f"{name}: {len(grid) - len(differing)} of {len(grid)} cases with {base_name}'s bits")
        for index, largest in differing[:8]:
            print(f"  differs: case {index} ({describe(grid[index])}), largest difference {largest:.3g}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
