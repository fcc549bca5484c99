"""Packed variable-length sequences: flashattn_ext.flash_attn_varlen against torch's varlen_attn on the same packed
batch, with our dense op called once per sequence and on a dense batch at the mean length for scale.

Usage (from the repository root, on a GPU):
    python benchmarks/bench_varlen.py                              # 16k tokens, lengths 100-4000, H16 D128, causal
    python benchmarks/bench_varlen.py --mode fwdbwd --head-dim 64 --heads 32 --causal off

The lengths are drawn uniformly from [--min-len, --max-len] with a fixed seed until --tokens are packed (the last one
cut to fit). Implementations, timed side by side in --rounds interleaved rounds (bench_sdpa.py's method: triton's
do_bench median per round, the median of the rounds kept):
  ours        flash_attn_varlen, one call
  varlen_attn torch.nn.attention.varlen.varlen_attn (PyTorch's flash kernel for packed sequences)
  loop        our dense op once per sequence (what a user without varlen writes)
  dense       our dense op on B = tokens // mean length sequences of the mean length (the work without the packing)
FLOPs are 4 * H * D * sum(Lq_b * Lk_b) per forward, halved for causal; fwdbwd counts 3.5x that. A CSV row per
implementation goes to --out, and a bar chart of the TFLOP/s (PNG, with matplotlib; --no-plot skips it). Before the
timing, our output (and in fwdbwd our gradients) is checked against SDPA's efficient backend run sequence by sequence
on float32 inputs, within 3x that path's own error in the input dtype (bench_sdpa.py's rule; ours' CSV row).
--deterministic runs everything under torch.use_deterministic_algorithms(True) (the files' names end in
_deterministic; an implementation without a deterministic backward shows '-').
`bench_sdpa.py --varlen` runs this script with the arguments that follow.
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sdpa import import_flashattn_ext, make_timer, results_of, round_order, within_rule  # noqa: E402

IMPLS = ["ours", "varlen_attn", "loop", "dense"]


def draw_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(low, high), tokens - sum(lengths)))
    return lengths


def make_callable(impl, fa, q, k, v, cu, lengths, causal, mode):
    heads, head_dim = q.shape[1], q.shape[2]
    leaves = (q, k, v)  # what the backward differentiates (the dense path's own inputs below)
    if impl == "ours":
        def forward():
            return fa.flash_attn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
    elif impl == "varlen_attn":
        from torch.nn.attention.varlen import varlen_attn

        window = (-1, 0) if causal else (-1, -1)

        def forward():
            return varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=window)
    elif impl == "loop":
        bounds = [0] + list(torch.tensor(lengths).cumsum(0).tolist())

        def forward():
            outs = [fa.flash_attn(*(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), causal=causal)
                    for a, b in zip(bounds[:-1], bounds[1:])]
            return torch.cat([o[0].transpose(0, 1) for o in outs])
    else:  # dense at the mean length
        mean = max(1, round(sum(lengths) / len(lengths)))
        batch = max(1, sum(lengths) // mean)
        qd, kd, vd = (torch.randn(batch, heads if t is q else k.shape[1], mean, head_dim, dtype=q.dtype,
                                  device=q.device, requires_grad=q.requires_grad) for t in (q, k, v))
        leaves = (qd, kd, vd)

        def forward():
            return fa.flash_attn(qd, kd, vd, causal=causal)
    if mode == "fwd":
        return forward
    grad = None

    def forward_backward():  # the gradients returned, not accumulated into .grad (no extra read and write a call)
        nonlocal grad
        out = forward()
        grad = torch.ones_like(out) if grad is None or grad.shape != out.shape else grad
        return torch.autograd.grad(out, leaves, grad)
    return forward_backward


def check_correctness(fa, q, k, v, cu, lengths, causal, with_grads):
    """Our packed call against SDPA's efficient backend sequence by sequence on float32 inputs: (output error,
    largest gradient error or None, within bench_sdpa's rule), or None where either side refuses the configuration."""
    dout = torch.randn_like(q) if with_grads else None
    leaves = [t.detach().requires_grad_(with_grads) for t in (q, k, v)]
    try:  # a configuration our op refuses shows '-' in the timing below
        with torch.set_grad_enabled(with_grads):
            out = fa.flash_attn_varlen(*leaves, cu, cu, max(lengths), max(lengths), causal=causal)
        ours = [out.detach(), *(torch.autograd.grad(out, leaves, dout) if with_grads else ())]
    except Exception:
        return None
    bounds = [0] + list(torch.tensor(lengths).cumsum(0).tolist())

    def per_sequence(dtype):
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            seq = [t.detach()[a:b].transpose(0, 1).unsqueeze(0).to(dtype) for t in (q, k, v)]
            grad = dout[a:b].transpose(0, 1).unsqueeze(0).to(dtype) if with_grads else None
            parts.append(results_of("efficient", *seq, causal, grad))
        return [torch.cat([p[i][0].transpose(0, 1) for p in parts]) for i in range(len(parts[0]))]

    try:
        truth, low = per_sequence(torch.float32), per_sequence(q.dtype)
    except Exception:
        return None
    errors, ok, _ = within_rule(ours, truth, low, q.dtype)
    return errors[0], (max(errors[1:]) if with_grads else None), ok


def flops(lengths, heads, head_dim, causal, mode, impl):
    if impl == "dense":
        mean = max(1, round(sum(lengths) / len(lengths)))
        pairs = (sum(lengths) // mean) * mean * mean
    else:
        pairs = sum(n * n for n in lengths)
    total = 4 * heads * head_dim * pairs * (0.5 if causal else 1.0)
    return total * (3.5 if mode == "fwdbwd" else 1.0)


def write_plot(path: Path, rows: list[dict], title: str) -> None:
    """A bar per implementation: its TFLOP/s, labelled with its ratio to varlen_attn where that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r["tflops"] for r in rows if r["impl"] == "varlen_attn"), None)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar([r["impl"] for r in rows], [r["tflops"] for r in rows],
                  color=["tab:red" if r["impl"] == "ours" else "tab:gray" for r in rows])
    if base:
        ax.bar_label(bars, [f"{r['tflops'] / base:.2f}x" for r in rows])
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=4000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, help="kv heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--causal", choices=["on", "off"], default="on")
    parser.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True)")
    args = parser.parse_args(argv)
    if args.deterministic:  # cuBLAS (the loop's chunked backward) needs a fixed workspace for determinism
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(args.deterministic)

    import_flashattn_ext()  # the installed package, else the in-place build
    import flashattn_ext as fa
    causal = args.causal == "on"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    lengths = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    total, heads_kv = sum(lengths), args.heads_kv or args.heads
    grad = args.mode == "fwdbwd"
    q = torch.randn(total, args.heads, args.head_dim, dtype=dtype, device="cuda", requires_grad=grad)
    k, v = (torch.randn(total, heads_kv, args.head_dim, dtype=dtype, device="cuda", requires_grad=grad)
            for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    timer, _ = make_timer("cuda")
    impls = args.impls.split(",")
    check = check_correctness(fa, q, k, v, cu, lengths, causal, grad) if "ours" in impls else None
    fns, errors = {}, {}
    for impl in impls:
        try:
            fns[impl] = make_callable(impl, fa, q, k, v, cu, lengths, causal, args.mode)
            fns[impl]()
        except Exception as exc:  # an implementation that refuses the configuration shows '-'
            errors[impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    times = {impl: [] for impl in fns}
    for round_index in range(args.rounds):
        for impl in round_order([i for i in impls if i in fns], round_index):
            times[impl].append(timer(fns[impl]))

    title = (f"{len(lengths)} sequences, {total} tokens (lengths {min(lengths)}-{max(lengths)}, mean "
             f"{total / len(lengths):.0f}), H{args.heads}/{heads_kv} D{args.head_dim} {args.dtype} "
             f"causal {args.causal}, {args.mode}{', deterministic' if args.deterministic else ''}")
    print(title)
    rows = []
    for impl in impls:
        if impl not in times:
            print(f"  {impl:12s} -  ({errors[impl]})")
            continue
        ms = statistics.median(times[impl])
        tflops = flops(lengths, args.heads, args.head_dim, causal, args.mode, impl) / ms / 1e9
        rows.append(dict(impl=impl, dtype=args.dtype, head_dim=args.head_dim, heads=args.heads, heads_kv=heads_kv,
                         causal=causal, deterministic=args.deterministic, ms=round(ms, 4), tflops=round(tflops, 1)))
        if impl == "ours" and check is not None:
            rows[-1].update(max_abs_diff=float(f"{check[0]:.3g}"), diff_ok=check[2],
                            grad_abs_diff=float(f"{check[1]:.3g}") if check[1] is not None else None)
        print(f"  {impl:12s} {ms:8.3f} ms  {tflops:6.1f} TFLOP/s")
    if check is not None:
        grads = f", gradients {check[1]:.1e}" if check[1] is not None else ""
        print(f"  ours against float32 SDPA (efficient): output {check[0]:.1e}{grads}, "
              f"{'within' if check[2] else 'OUTSIDE'} 3x its own error in {args.dtype}")
    if "ours" in times and "varlen_attn" in times:
        ratio = statistics.median(times["varlen_attn"]) / statistics.median(times["ours"])
        print(f"  ours / varlen_attn: {ratio:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = f"{args.mode}_d{args.head_dim}_h{args.heads}-{heads_kv}_{args.dtype}_{'causal' if causal else 'full'}"
    path = args.out / f"bench_varlen_{settings}{'_deterministic' if args.deterministic else ''}.csv"
    with path.open("w", newline="") as f:
        fields = list(dict.fromkeys(key for row in rows for key in row)) or ["impl", "ms", "tflops"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    if not args.no_plot and rows:
        try:
            write_plot(path.with_suffix(".png"), rows, title)
        except ImportError:
            print("matplotlib is missing: no plot")


if __name__ == "__main__":
    main()
