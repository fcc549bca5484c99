"""Decoding against a KV cache: one query token per sequence (Lq = 1), D128, bf16, side by side in one process.

Usage (from the repository root, on a GPU):
    python benchmarks/bench_decode.py                    # H32/Hk8 and H32/Hk32, B 1/8/64, Lk 4k/32k/128k
    python benchmarks/bench_decode.py --batches 8 --lengths 32768 --heads-kv 8
    python benchmarks/bench_decode.py --len-q 512 --causal   # a prefill chunk against the cache (TFLOP/s)

Implementations, timed in --rounds interleaved rounds (bench_sdpa.py's method):
  plain     flashattn_ext.flash_attn on the whole cache (the dense op)
  kvcache   flash_attn_with_kvcache over a dense cache, every entry's valid length Lk (cache_seqlens)
  paged     the same over a paged cache (--page-size rows per page, pages in a random order)
  cudnn     scaled_dot_product_attention(enable_gqa=True), pinned to cuDNN
--l2-clear read clears the L2 before each timed call by reading 256 MB instead of do_bench's write of them, whose
dirty lines are otherwise written back during the call (the same for every implementation).
--num-splits N fixes the key splits of kvcache and paged (the decode path's, or a chunk's on Hopper; a sweep: a run
per N; 0 lets the shape and the GPU choose them).
With --append, kvcache and paged also write one new token per call (k, v given, cache_seqlens Lk - 1): a decoding
step. Each point prints the median time and the K/V bytes read per second (2 * B * Hk * Lk * D * 2 bytes / time); with
--len-q above 1 (a chunk of queries, the cache's last rows in the causal case: bottom-right), TFLOP/s instead (4 * B * H
* D times the visible query-key pairs). cuDNN is left out of causal chunks (SDPA's causal mask is top-left). Points
whose cache would exceed --max-cache-gib, or not fit in the GPU's free memory beside its pages, are skipped (a line
says so). Before the timing each output is checked on the first and last batch entries against float32 SDPA (within 3x
the same SDPA's error in bf16, bench_sdpa.py's rule); a line names any that is not. A CSV row per point (rates and
errors) goes to --out, and a bar chart of the rates (PNG, with matplotlib; --no-plot skips it).
`bench_sdpa.py --mode decode` runs this script with its other arguments.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sdpa import (GPU_REP_MS, GPU_WARMUP_MS, ScoreMods, import_flashattn_ext, make_timer,  # noqa: E402
                        round_order, within_rule)

IMPLS = ["plain", "kvcache", "paged", "cudnn"]


def callables(fa, batch, heads, heads_kv, length, head_dim, page_size, append=False, len_q=1, causal=False,
              num_splits=0):
    """The implementations' calls by name, and (q, k_cache, v_cache) of the dense cache."""
    dtype, device = torch.bfloat16, "cuda"
    q = torch.randn(batch, heads, len_q, head_dim, dtype=dtype, device=device)
    k_cache, v_cache = (torch.randn(batch, heads_kv, length, head_dim, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.full((batch,), length - (len_q if append else 0), dtype=torch.int32, device=device)
    new = [None, None]  # the tokens appended per call, with --append
    if append:
        new = [torch.randn(batch, heads_kv, len_q, head_dim, dtype=dtype, device=device) for _ in range(2)]
    fns = {
        "plain": lambda: fa.flash_attn(q, k_cache, v_cache, causal=causal),
        "kvcache": lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=seqlens, causal=causal,
                                                      num_splits=num_splits),
    }
    if length % page_size == 0:
        per_entry = length // page_size
        order = torch.randperm(batch * per_entry, device=device)
        block_table = order.view(batch, per_entry).to(torch.int32)
        pages = [torch.empty(batch * per_entry, heads_kv, page_size, head_dim, dtype=dtype, device=device)
                 for _ in range(2)]
        for cache, paged in zip((k_cache, v_cache), pages):
            paged[order] = cache.view(batch, heads_kv, per_entry, page_size, head_dim).transpose(1, 2).reshape(
                -1, heads_kv, page_size, head_dim)
        fns["paged"] = lambda: fa.flash_attn_with_kvcache(q, pages[0], pages[1], *new, cache_seqlens=seqlens,
                                                          block_table=block_table, causal=causal,
                                                          num_splits=num_splits)
    inputs = (q, k_cache, v_cache)  # what check_outputs compares against
    if causal and len_q > 1:
        return fns, inputs

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=heads_kv != heads)
    fns["cudnn"] = cudnn
    return fns, inputs


def entry_reference(q, k_cache, v_cache, entry: int, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """Entry `entry`'s output (H, Lq, D) by SDPA on its inputs cast to `dtype`: each kv head's query heads as rows of
    one query (no K / V repeat), the causal band bottom-right by an explicit mask."""
    heads, len_q, head_dim = q.shape[1:]
    heads_kv, length = k_cache.shape[1:3]
    group = heads // heads_kv
    rows = q[entry].to(dtype).reshape(heads_kv, group * len_q, head_dim)
    mask = None
    if causal:  # row g * Lq + i sees keys j <= length - Lq + i
        query = torch.arange(group * len_q, device=q.device) % len_q
        mask = torch.arange(length, device=q.device)[None] <= (length - len_q + query)[:, None]
    out = F.scaled_dot_product_attention(rows, k_cache[entry].to(dtype), v_cache[entry].to(dtype), attn_mask=mask)
    return out.reshape(heads, len_q, head_dim)


def check_outputs(outputs: dict, q, k_cache, v_cache, causal: bool) -> dict:
    """Each implementation's largest output error on the first and last batch entries against float32 SDPA, and
    whether each entry is within bench_sdpa's rule (3x the same SDPA's error in bf16, plus the floor): name -> (error,
    ok). The caches are the dense ones, as the calls left them (appended tokens included)."""
    entries = sorted({0, q.shape[0] - 1})
    truth = [entry_reference(q, k_cache, v_cache, b, causal, torch.float32) for b in entries]
    low = [entry_reference(q, k_cache, v_cache, b, causal, q.dtype) for b in entries]
    report = {}
    for name, out in outputs.items():
        errors, ok, _ = within_rule([out[b] for b in entries], truth, low, q.dtype)
        report[name] = (max(errors, key=lambda e: (e != e, e)), ok)  # NaN the largest
    return report


_CLEAR_BUFFER = None  # 256 MB that read_cleared_median_ms reads


def read_cleared_median_ms(fn) -> float:
    """do_bench's timing (the median of single calls, each after the L2 is cleared) with the L2 cleared by reading 256
    MB rather than writing them: the write leaves the L2 full of dirty lines, whose write-back then shares the DRAM with
    the timed call (about 9 us a call at the 1 GiB points)."""
    global _CLEAR_BUFFER
    if _CLEAR_BUFFER is None:
        _CLEAR_BUFFER = torch.ones(2**26, dtype=torch.float32, device="cuda")
    buffer = _CLEAR_BUFFER
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        buffer.sum()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(GPU_WARMUP_MS / estimate_ms))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(1, int(GPU_REP_MS / estimate_ms)))]
    for first, last in events:
        buffer.sum()
        first.record()
        fn()
        last.record()
    torch.cuda.synchronize()
    return statistics.median(first.elapsed_time(last) for first, last in events)


def write_plot(path: Path, rows: list, rate: str) -> None:
    """Grouped bars: per point (kv heads, batch, keys), each implementation's rate ("tbs" or "tflops" columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "TB/s of K/V" if rate == "tbs" else "TFLOP/s"
    impls = [name for name in IMPLS if any(f"{name}_{rate}" in row for row in rows)]
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(min(14.0, 2.0 + 0.2 * len(rows) * max(1, len(impls))), 3.8))
    for i, name in enumerate(impls):
        xs = [x + (i - (len(impls) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, [row.get(f"{name}_{rate}", 0.0) for row in rows], width, label=name,
               color="tab:gray" if name == "cudnn" else None)
    labels = [f"Hk{row['heads_kv']} B{row['batch']}\n{row['length'] // 1024}k" for row in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--lengths", default="4096,32768,131072")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-kv", default="8,32", help="comma list of kv head counts")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--max-cache-gib", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--append", action="store_true", help="kvcache and paged append --len-q tokens per call")
    parser.add_argument("--len-q", type=int, default=1, help="query rows per entry (above 1: a prefill chunk)")
    parser.add_argument("--causal", action="store_true", help="causal, bottom-right (the chunk: the last rows)")
    parser.add_argument("--num-splits", type=int, default=0,
                        help="kvcache and paged: key splits (0: chosen from the shape)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--l2-clear", choices=["write", "read"], default="write",
                        help="how the L2 is cleared before each timed call: do_bench's 256 MB write, or a 256 MB read "
                             "(no dirty lines written back during the call)")
    args = parser.parse_args(argv)
    import_flashattn_ext()  # the installed package, else the in-place build
    import flashattn_ext as fa

    timer = read_cleared_median_ms if args.l2_clear == "read" else make_timer("cuda")[0]
    rows = []
    failed = 0  # outputs above the check's bound
    # The rate printed and plotted: K/V bytes per second for decoding, FLOP/s for a chunk of queries.
    rate, label, decimals = ("tbs", "TB/s", 2) if args.len_q == 1 else ("tflops", "TF/s", 0)
    print(f"{'Hk':>3} {'B':>3} {'Lk':>7} " + " ".join(f"{name + ' us':>11} {label:>5}" for name in IMPLS))
    for heads_kv in map(int, args.heads_kv.split(",")):
        for batch in map(int, args.batches.split(",")):
            for length in map(int, args.lengths.split(",")):
                cache_bytes = 2 * batch * heads_kv * length * args.head_dim * 2
                if cache_bytes > args.max_cache_gib * 2**30:
                    continue
                point = f"{heads_kv:3d} {batch:3d} {length:7d}"
                # the dense cache, its pages and one tensor's copy while they are built
                needed = cache_bytes * (5 if length % args.page_size == 0 else 2) // 2
                free = torch.cuda.mem_get_info()[0]
                if needed > free:
                    print(f"{point}  skipped: needs {needed / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free", flush=True)
                    continue
                fns, inputs = callables(fa, batch, args.heads, heads_kv, length, args.head_dim, args.page_size,
                                        args.append, args.len_q, args.causal, args.num_splits)
                # bottom-right causal: row i sees length - len_q + i + 1 keys, or none
                flops = 4 * batch * args.heads * args.head_dim * ScoreMods().visible_pairs(args.len_q, length,
                                                                                           args.causal)
                times = {name: [] for name in fns}
                for name, fn in list(fns.items()):
                    try:
                        fn()
                    except RuntimeError as exc:
                        print(f"  {name}: {str(exc).splitlines()[0][:100]}")
                        del fns[name], times[name]
                # Checked once every call has run (with --append the caches then hold the same appended tokens).
                try:
                    checks = check_outputs({name: fn() for name, fn in fns.items()}, *inputs, args.causal)
                except torch.cuda.OutOfMemoryError:
                    checks = {}
                    print("  outputs not checked: the reference does not fit in memory")
                for name, (error, ok) in checks.items():
                    if not ok:
                        print(f"  {name}: output error {error:.3g} against float32 SDPA, above the bound")
                for round_index in range(args.rounds):
                    for name in round_order(list(fns), round_index):
                        times[name].append(timer(fns[name]))
                row = dict(heads=args.heads, heads_kv=heads_kv, head_dim=args.head_dim, dtype="bf16", batch=batch,
                           length=length, len_q=args.len_q, causal=args.causal, append=args.append,
                           page_size=args.page_size, num_splits=args.num_splits, l2_clear=args.l2_clear)
                cells = []
                for name in IMPLS:
                    if name in times:
                        ms = statistics.median(times[name])
                        rates = {"tbs": cache_bytes / ms / 1e9, "tflops": flops / ms / 1e9}
                        row[f"{name}_us"] = round(ms * 1e3, 1)
                        if name in checks:
                            row[f"{name}_err"], row[f"{name}_ok"] = float(f"{checks[name][0]:.3g}"), checks[name][1]
                        row[f"{name}_tbs"], row[f"{name}_tflops"] = round(rates["tbs"], 2), round(rates["tflops"], 1)
                        cells.append(f"{ms * 1e3:11.1f} {rates[rate]:5.{decimals}f}")
                    else:
                        cells.append(f"{'-':>11} {'-':>5}")
                print(f"{point} " + " ".join(cells), flush=True)
                rows.append(row)
                failed += sum(not ok for _, ok in checks.values())
                del fns, inputs
                torch.cuda.empty_cache()
    print(f"Correctness: {failed} output(s) above tolerance (entries 0 and B - 1 against float32 SDPA)")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "bench_decode.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({key for row in rows for key in row}, key=str))
        writer.writeheader()
        writer.writerows(rows)
    if not args.no_plot and rows:
        try:
            write_plot(args.out / "bench_decode.png", rows, rate)
        except ImportError:
            print("matplotlib is missing: no plot")


if __name__ == "__main__":
    main()
