"""A sliding window's output and gradients at a benchmark's shape, tensor by tensor, against an exact reference.

The benchmark's check compares with FlexAttention in float32 and tells only whether a row passed. This one computes
the band exactly (query blocks of `--chunk` rows against their keys only, float32 autograd, so L16k fits), reports
each of out, dq, dk, dv and the forward's lse with its largest error and where it lies, the same reference run in the
input dtype (the low-precision error that FlashAttention's rule allows 3x of), whether repeated runs give the same bits,
and with --flex FlexAttention's own errors against the same reference (float32 and the input dtype). Each line ends with
a digest of that tensor's bits (first run), and the report opens with the inputs', so two GPUs' runs of the same
build and seed compare bit for bit without a reference (dq under --deterministic only: its default reduction order
varies).
--deterministic runs ours under deterministic algorithms (the ordered dQ). --poison G fills G GiB of the caching
allocator's free memory with NaN bytes before each of our runs, so that a buffer a kernel reads before writing shows
at this shape (the test suite poisons 512 MiB, enough for its small shapes; a call here allocates 1.1 GiB).
A lab build from bwd_jitter.patch (`git apply`, build, revert before any commit) sleeps for random spans, up to ~4 us,
at the Hopper backward's handoffs (the producer's loads, each consumer step, the dS stores, the dQ writer, the end of
a key block): its digests equal to the plain build's say the result does not depend on the roles' timing.

    python benchmarks/lab/band_check.py --length 16384 --window 1024 [--runs 3] [--flex] [--deterministic] [--poison 8]

Defaults: the score-modification table's shape (B2 H16 D128 bf16, causal). --device cpu runs the CPU path (the
tool's own test, at small shapes).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_sdpa  # noqa: E402
from bench_sdpa import CHECKED, DTYPES, ScoreMods, error_bound, results_of  # noqa: E402

TENSORS = [*CHECKED, "lse"]  # what reference() and ours() return, in order


def band(len_q: int, len_k: int, window: int, causal: bool, rows: range, device) -> torch.Tensor:
    """Which keys the queries `rows` see (shift = len_k - len_q, left edge `window`, right edge 0 under causal)."""
    shift = len_k - len_q
    i = torch.arange(rows.start, rows.stop, device=device)[:, None] + shift
    j = torch.arange(len_k, device=device)[None]
    seen = j >= i - window if window >= 0 else torch.ones_like(j >= i)
    return seen & (j <= i) if causal else seen


def reference(q, k, v, dout, window: int, causal: bool, dtype, chunk: int) -> List[torch.Tensor]:
    """out, dq, dk, dv of softmax(q k^T scale) v over the band, in `dtype` (the scores and softmax in at least
    float32), and lse (the scores' logsumexp, -inf for a row without keys), one query chunk at a time over the keys
    it can see."""
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    len_q, len_k = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.promote_types(dtype, torch.float32), device=q.device)
    for start in range(0, len_q, chunk):
        rows = range(start, min(len_q, start + chunk))
        seen = band(len_q, len_k, window, causal, rows, q.device)
        cols = seen.any(0).nonzero()
        if cols.numel() == 0:
            continue
        first, last = cols[0].item(), cols[-1].item() + 1
        qc = q[:, :, rows.start:rows.stop].detach().requires_grad_()
        kc, vc = (t[:, :, first:last].detach().requires_grad_() for t in (k, v))
        scores = (qc @ kc.transpose(-1, -2)).to(torch.promote_types(dtype, torch.float32)) * scale
        scores = scores.masked_fill(~seen[:, first:last], float("-inf"))
        lse[:, :, rows.start:rows.stop] = scores.detach().logsumexp(-1)
        probs = scores.softmax(-1).nan_to_num(0.0)
        oc = probs.to(dtype) @ vc
        oc.backward(dout[:, :, rows.start:rows.stop])
        out[:, :, rows.start:rows.stop] = oc.detach()
        dq[:, :, rows.start:rows.stop] += qc.grad
        dk[:, :, first:last] += kc.grad
        dv[:, :, first:last] += vc.grad
    return [out, dq, dk, dv, lse]


def poison_free_memory(gib: float) -> None:
    """The caching allocator's cached blocks back to the driver, then a 32 MiB small-block pool and a `gib` GiB block
    filled with 0xFF bytes (NaN in bf16, fp16 and fp32) and freed: what is allocated next starts as NaN."""
    torch.cuda.empty_cache()
    blocks = [torch.full((2**20,), 255, dtype=torch.uint8, device="cuda") for _ in range(32)]
    blocks.append(torch.full((int(gib * 2**30),), 255, dtype=torch.uint8, device="cuda"))
    del blocks


def ours(q, k, v, dout, window: int, causal: bool, poison: float = 0.0) -> List[torch.Tensor]:
    bench_sdpa.import_flashattn_ext()  # the package installed, else the one built in this checkout
    if poison > 0:
        poison_free_memory(poison)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = bench_sdpa.flashattn_ext.flash_attn_with_lse(*leaves, causal=causal,
                                                            window_size=(window, 0 if causal else -1))
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves), lse.detach()]


def flex(q, k, v, dout, window: int, causal: bool, dtype) -> List[torch.Tensor]:
    """out, dq, dk, dv of the benchmark's FlexAttention (its block mask for the band) on inputs cast to `dtype`."""
    mods = bench_sdpa.MODS
    bench_sdpa.MODS = ScoreMods(window=(window, -1))
    try:
        return results_of("flex", *(t.to(dtype) for t in (q, k, v)), causal, dout.to(dtype))
    finally:
        bench_sdpa.MODS = mods


def largest(mine: torch.Tensor, want: torch.Tensor, bound: float = float("inf")) -> Dict[str, object]:
    """The largest error of `mine` against `want` (NaN counts as the largest, equal infinities as none), where it
    lies, the two values, and how many entries lie past `bound` with the sequence positions they span (one tile's
    fault or the whole tensor's)."""
    mine, want = mine.float(), want.float()
    error = torch.where(mine == want, 0.0, (mine - want).abs().nan_to_num(float("inf")))
    at = tuple(torch.nonzero(error == error.max())[0].tolist())
    past = torch.nonzero(error > bound)
    span = (past[:, 2].min().item(), past[:, 2].max().item()) if len(past) else None
    return dict(error=error.max().item(), at=at, want=want[at].item(), got=mine[at].item(), past=len(past), span=span)


def digest(*tensors: torch.Tensor) -> str:
    """The first 12 hex digits of the SHA-256 of the tensors' bytes, in order."""
    hashed = hashlib.sha256()
    for t in tensors:
        hashed.update(t.detach().contiguous().cpu().view(torch.uint8).numpy())  # the buffer itself, no bytes copy
    return hashed.hexdigest()[:12]


def inputs(args) -> List[torch.Tensor]:
    """q, k, v and dout of the seed (on CUDA the same values where PyTorch and the SM count are the same: the
    generator's grid follows the SM count; the inputs' digest shows it)."""
    torch.manual_seed(args.seed)
    shape = (args.batch, args.heads, args.length, args.head_dim)
    return [torch.randn(shape, device=args.device, dtype=DTYPES[args.dtype]) for _ in range(4)]


def check(args, drawn: Optional[List[torch.Tensor]] = None) -> Dict[str, object]:
    """Every tensor's largest error against the float32 reference, the bound of FlashAttention's rule, and the bits
    of the repeated runs; FlexAttention's errors with --flex. `drawn`: the seed's inputs, where the caller has them."""
    dtype = DTYPES[args.dtype]
    q, k, v, dout = drawn if drawn is not None else inputs(args)
    causal = not args.no_causal
    upcast = torch.float64 if dtype == torch.float32 else torch.float32
    truth = reference(q, k, v, dout, args.window, causal, upcast, args.chunk)
    low = reference(q, k, v, dout, args.window, causal, dtype, args.chunk)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(before or args.deterministic)
    try:
        runs = [ours(q, k, v, dout, args.window, causal, args.poison) for _ in range(args.runs)]
    finally:
        torch.use_deterministic_algorithms(before)
    report: Dict[str, object] = {}
    for n, name in enumerate(TENSORS):
        bound = error_bound(largest(low[n], truth[n])["error"], dtype)
        worst = max((largest(run[n], truth[n], bound) for run in runs), key=lambda r: r["error"])
        same = all(torch.equal(run[n], runs[0][n]) for run in runs[1:])
        report[name] = dict(worst, bound=bound, ok=worst["error"] <= bound, same_bits=same, digest=digest(runs[0][n]))
    if args.flex:
        for flex_dtype in (upcast, dtype):
            results = flex(q, k, v, dout, args.window, causal, flex_dtype)
            for n, name in enumerate(CHECKED):  # no lse from Flex here
                theirs = largest(results[n], truth[n], report[name]["bound"])
                report[name][f"flex {str(flex_dtype).replace('torch.', '')}"] = (theirs["error"], theirs["past"])
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=16384, help="L_q = L_k")
    parser.add_argument("--window", type=int, default=1024, help="the left edge (-1: none)")
    parser.add_argument("--no-causal", action="store_true", help="no right edge")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--runs", type=int, default=3, help="our runs, compared bit by bit")
    parser.add_argument("--chunk", type=int, default=1024, help="query rows per reference step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flex", action="store_true", help="FlexAttention's errors too (compiled; CUDA)")
    parser.add_argument("--deterministic", action="store_true", help="ours under deterministic algorithms")
    parser.add_argument("--poison", type=float, default=0.0, metavar="GIB",
                        help="NaN-fill this much free CUDA memory before each of our runs")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.poison > 0 and not args.device.startswith("cuda"):
        parser.error("--poison fills CUDA memory: it needs --device cuda")
    drawn = inputs(args)
    print(f"inputs (q, k, v, dout): bits {digest(*drawn)}")
    report = check(args, drawn)
    for name, r in report.items():
        flex_runs = [(key, value) for key, value in r.items() if key.startswith("flex")]
        extra = "".join(f", {key} {error:.3g} ({past} past)" for key, (error, past) in flex_runs)
        print(f"{name}: {'ok  ' if r['ok'] else 'OVER'} {r['error']:.3g} (bound {r['bound']:.3g}) at {r['at']}: "
              f"want {r['want']:.5g} got {r['got']:.5g}; runs {'same bits' if r['same_bits'] else 'differ'}{extra}"
              + (f"; {r['past']} past the bound at positions {r['span'][0]}..{r['span'][1]}" if r["past"] else "")
              + f"; bits {r['digest']}")
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
