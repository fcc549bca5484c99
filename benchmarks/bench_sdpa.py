"""Compare the flashattn_ext forward with torch SDPA (each backend pinned) and naive attention.

Usage (from the repository root):
    python benchmarks/bench_sdpa.py                        # full grid: bf16, B*L = 16k tokens, H*D = 2048
    python benchmarks/bench_sdpa.py --quick                # small subset, a smoke test
    python benchmarks/bench_sdpa.py --head-dims 128 --lengths 1024,16384 --causal on --dtypes bf16,fp16
    python benchmarks/bench_sdpa.py --backends flash,cudnn --naive-mem-gib 0 --no-plot
    python benchmarks/bench_sdpa.py --device cpu           # the CPU variant (the default without a GPU)

Every configuration gets fresh random inputs; our op, each SDPA backend (pinned with
torch.nn.attention.sdpa_kernel) and the naive path (softmax(Q K^T) V in the input dtype, scores materialised)
are then timed side by side in this process: triton.testing.do_bench medians on the GPU (CUDA events when triton
is missing), perf_counter medians on the CPU, in --rounds interleaved rounds (ours, each backend, then the same in
reverse, ...) whose median is kept, so that the card's drift between measurements touches every implementation
alike and what runs just before each measurement changes from round to round (under a power cap the latter moves a
measurement; benchmarks/lab/bench_method_probe.py). A backend that rejects a configuration shows '-'; so does the naive
path when its score matrix would exceed --naive-mem-gib.

FLOPs are 4*B*H*Lq*Lk*D per forward, halved for causal (Lq == Lk here). Each row also reports the peak memory
above the inputs (CUDA only) and a correctness check: our output's (and in fwdbwd our gradients') max abs error
against a reference path on upcast inputs (SDPA's efficient backend on the GPU, math on the CPU, FlexAttention with
score modifications), within 3x that path's own error in the input dtype (diff_ok).

Outputs, in --out (default benchmarks/out/): bench_sdpa_<device>_<mode>[_<mods>][_deterministic][_bshd].csv, .json
(rows and metadata) and .png
(TFLOP/s against L, one panel per dtype, head dim and causal). The table and a summary are printed last.

A timed quantity is a *mode*: a function make_fn(impl, q, k, v, causal) -> Timed registered in MODES: "fwd" (the
forward) and "fwdbwd" (forward + backward, 3.5x the forward FLOPs; its memory columns are then the peak memory of a
training step's attention). fwdbwd also times the backward alone (2.5x the forward FLOPs, through a graph kept from
one forward) and reports it in the *_bwd_* columns. --deterministic runs everything under
torch.use_deterministic_algorithms(True) (an SDPA backend without a deterministic backward then shows '-').

--layout bshd times every implementation as a model calls it: q, k, v views of (B, L, H, D) projections (fwdbwd:
their gradients flow back into (B, L, H * D) leaves), the output viewed back to (B, L, H * D); a copy wherever an
output or gradient comes in another memory order. The default, bhsd, gives contiguous (B, H, L, D) tensors.

--varlen runs benchmarks/bench_varlen.py (packed sequences against torch's varlen_attn) with the other arguments,
--mode decode benchmarks/bench_decode.py (decoding against a KV cache, against cuDNN).

--flash-provider NAME activates an SDPA flash provider (such as flashattn_ext itself) for the whole run, so that the
`flash` column times SDPA's flash backend through it.

Score modifications: --window L,R, --softcap C and --sinks run our op with them, and compare it with FlexAttention
(`flex`: torch.compile'd flex_attention with the same block mask and score_mod; sinks through its lse) and with our own
op without them (`dense`: the plain causal or full attention of the same shape). FLOPs then count the band's visible
(query, key) pairs; `dense` is counted on its own area, so /dense compares TFLOP/s on each one's unmasked area. SDPA
backends take a window as a boolean mask where they accept one (efficient, math) and show '-' for softcap and sinks.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).resolve().parent / "out"

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The correctness check, FlashAttention's rule as the tests apply it: against a reference path run on the inputs upcast
# (float32 for fp16 / bf16, float64 for fp32), our error stays within ERROR_FACTOR times that path's own error in the
# input dtype, plus a floor; the output in every mode, dq, dk and dv too in fwdbwd.
ERROR_FACTOR = 3.0
ERROR_FLOOR = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 1e-5}


def error_bound(reference_error: float, dtype: torch.dtype) -> float:
    """The largest error the rule allows us, given the reference path's own error in `dtype`."""
    return ERROR_FACTOR * reference_error + ERROR_FLOOR[dtype]

# Defaults of the two variants; --quick replaces the grid entries with its own.
GPU_DEFAULTS = dict(
    dtypes="bf16", head_dims="64,128,256", lengths="512,1024,2048,4096,8192,16384", tokens=16384, hidden=2048,
    backends="flash,efficient,cudnn", summary_min_len=1024,
)
GPU_QUICK = dict(head_dims="64,128", lengths="1024,4096")
CPU_DEFAULTS = dict(
    dtypes="fp32", head_dims="32,64", lengths="128,256,512", tokens=2048, hidden=256,
    backends="flash,math", summary_min_len=256,
)
CPU_QUICK = dict(head_dims="32", lengths="128,256", tokens=1024)

# do_bench budgets per measurement. Under the H200's 700 W cap the clock swings for a few hundred milliseconds after
# the card switches kernels (faster after a slower one, e.g. SDPA's efficient backend, then a dip): 250 ms of warm-up
# lets most of that pass before the timed window (benchmarks/lab/LOG.md, Method).
GPU_WARMUP_MS, GPU_REP_MS = 250, 100
CPU_WARMUP_CALLS, CPU_REPS = 1, 5

flashattn_ext = None  # imported in main() so that --help works without a build


@dataclass(frozen=True)
class ScoreMods:
    """The score modifications every implementation of a run applies (--window, --softcap, --sinks)."""
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False

    @property
    def active(self) -> bool:
        return self.window != (-1, -1) or self.softcap > 0 or self.sinks

    def band(self, causal: bool) -> Tuple[int, int]:
        left, right = self.window
        return left, 0 if causal else right

    def visible_pairs(self, len_q: int, len_k: int, causal: bool) -> int:
        """How many (query, key) pairs the band leaves visible."""
        left, right = self.band(causal)
        i = torch.arange(len_q, dtype=torch.int64)
        shift = len_k - len_q
        lo = (i + shift - left).clamp(0, len_k) if left >= 0 else torch.zeros_like(i)
        hi = (i + shift + right + 1).clamp(0, len_k) if right >= 0 else torch.full_like(i, len_k)
        return int((hi - lo).clamp(min=0).sum())

    @property
    def label(self) -> str:
        parts = [f"window {self.window[0]},{self.window[1]}"] if self.window != (-1, -1) else []
        parts += [f"softcap {self.softcap:g}"] if self.softcap > 0 else []
        return ", ".join(parts + (["sinks"] if self.sinks else []))


MODS = ScoreMods()  # set in main()
LAYOUT = "bhsd"  # set in main(): "bshd" for the (B, L, H, D) memory a model's projections give
PEERS = ("flex", "dense")  # implementations besides SDPA's backends, for runs with score modifications


# ----------------------------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Config:
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    heads_kv: int = 0  # K/V heads (GQA); 0: as many as query heads

    @property
    def kv_heads(self) -> int:
        return self.heads_kv or self.heads

    @property
    def label(self) -> str:
        gqa = f" Hk={self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"{self.dtype} D={self.head_dim} L={self.seqlen}{gqa} causal={'on' if self.causal else 'off'}"

    def forward_flops(self, mods: Optional[ScoreMods] = None) -> float:
        """4 B H D times the visible pairs: L^2 (halved for causal), or the band's of `mods` (default: the run's)."""
        mods = MODS if mods is None else mods
        if mods.window != (-1, -1):
            return 4.0 * self.batch * self.heads * self.head_dim * mods.visible_pairs(self.seqlen, self.seqlen,
                                                                                      self.causal)
        flops = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        return flops / 2 if self.causal else flops

    def score_bytes(self, element_size: int) -> int:
        return self.batch * self.heads * self.seqlen * self.seqlen * element_size


def build_grid(dtypes: List[str], head_dims: List[int], lengths: List[int], causals: List[bool], tokens: int,
               hidden: int, kv_heads: int = 0) -> List[Config]:
    """B = tokens // L and H = hidden // D (at least 1 each), so every row does comparable work; kv_heads K/V heads
    (0: H)."""
    return [
        Config(dtype, d, causal, seqlen, max(1, tokens // seqlen), max(1, hidden // d), kv_heads)
        for dtype in dtypes
        for d in head_dims
        for causal in causals
        for seqlen in lengths
    ]


# ------------------------------------------------------------------------------------------------ what is timed
def naive_attention(q, k, v, causal: bool):
    """softmax(scale * Q K^T) V in the input dtype with the full score matrix in memory."""
    if k.shape[1] != q.shape[1]:  # GQA: each K/V head serves q.shape[1] // k.shape[1] query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(q.shape[-1] ** -0.5)
    if causal:
        len_q, len_k = scores.shape[-2:]
        masked = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).triu_(len_k - len_q + 1)
        scores.masked_fill_(masked, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def make_sinks(q) -> torch.Tensor:
    """The sinks of a --sinks run: one fixed logit per head (float32), the same for every implementation."""
    return torch.linspace(-1.0, 2.0, q.shape[1], device=q.device, dtype=torch.float32)


def flex_callable(q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    """FlexAttention (compiled) with the run's band as a block mask, softcap as a score_mod and sinks through lse:
    out * sigmoid(lse - sink) is the output with the sink in the denominator."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # The fwdbwd mode's backward alone reuses one graph (retain_graph), which donated buffers would free.
    torch._functorch.config.donated_buffer = False

    left, right = MODS.band(causal)
    shift = k.shape[2] - q.shape[2]
    cap = MODS.softcap

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kv_idx >= 0
        if right >= 0:
            visible = visible & (kv_idx <= q_idx + shift + right)
        if left >= 0:
            visible = visible & (kv_idx >= q_idx + shift - left)
        return visible

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    masked = left >= 0 or right >= 0
    block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device) if masked else None
    compiled = torch.compile(flex_attention)
    sinks = make_sinks(q) if MODS.sinks else None
    score_mod = softcap_mod if cap > 0 else None
    enable_gqa = q.shape[1] != k.shape[1]

    def flex():
        if sinks is None:
            return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
        out, lse = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                            return_lse=True)
        return out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1).to(out.dtype)

    return flex


def forward_callable(impl: str, q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    """A zero-argument forward of `impl`: 'ours', 'naive', 'flex', 'dense' (ours without the run's score
    modifications) or an SDPA backend name (pinned, no fallback)."""
    if impl == "ours":
        sinks = make_sinks(q) if MODS.sinks else None
        return lambda: flashattn_ext.flash_attn(q, k, v, causal=causal, window_size=MODS.window,
                                                softcap=MODS.softcap, sinks=sinks)
    if impl == "dense":
        return lambda: flashattn_ext.flash_attn(q, k, v, causal=causal)
    if impl == "flex":
        return flex_callable(q, k, v, causal)
    if impl == "naive":
        if MODS.active:
            raise NotImplementedError("naive attention with score modifications")
        return lambda: naive_attention(q, k, v, causal)
    backend = SDPA_BACKENDS[impl]
    if MODS.softcap > 0 or MODS.sinks:
        raise NotImplementedError("SDPA has no softcap or sinks")
    mask = None
    if MODS.window != (-1, -1):
        left, right = MODS.band(causal)
        i = torch.arange(q.shape[2], device=q.device)[:, None] + (k.shape[2] - q.shape[2])
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = (j <= i + right if right >= 0 else j >= 0) & (j >= i - left if left >= 0 else j >= 0)

    def sdpa():
        with sdpa_kernel(backend):
            gqa = q.shape[1] != k.shape[1]
            if mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return sdpa


@dataclass
class Timed:
    """What a mode times for one implementation: `step` (its FLOPs `flops` times the forward's) and, where the mode
    has one, `backward` alone (2.5x the forward's FLOPs)."""
    step: Callable[[], object]
    flops: float
    backward: Optional[Callable[[], object]] = None
    area: float = 1.0  # this implementation's visible pairs over the run's (the backward's FLOPs scale with it)


BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's: five GEMMs of the forward's size to its two


def area_factor(impl: str, q, causal: bool) -> float:
    """`dense` runs without the band: its FLOPs over the band's (1 for everything else)."""
    if impl != "dense" or MODS.window == (-1, -1):
        return 1.0
    length = q.shape[2]
    dense = length * length / (2 if causal else 1)
    return dense / max(1, MODS.visible_pairs(length, length, causal))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> the (B, L, H * D) rows a model's projection gives or takes (a copy unless in that order)."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def as_heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, H * D) rows -> the (B, H, L, D) view a model passes to attention."""
    return rows.view(rows.shape[0], rows.shape[1], heads, -1).transpose(1, 2)


def make_fwd_fn(impl: str, q, k, v, causal: bool) -> Timed:
    """Mode 'fwd': the forward alone (under --layout bshd, its output viewed back to rows); its FLOPs are the forward
    FLOPs."""
    forward = forward_callable(impl, q, k, v, causal)
    step = forward if LAYOUT == "bhsd" else lambda: as_rows(forward())
    return Timed(step, area_factor(impl, q, causal))


def make_fwdbwd_fn(impl: str, q, k, v, causal: bool) -> Timed:
    """Mode 'fwdbwd': forward plus the gradients of q, k, v for a fixed random dout (a training step's attention),
    3.5x the forward's FLOPs; and the backward alone, through the graph of one forward kept for it."""
    if LAYOUT == "bhsd":
        leaves = inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        output = lambda out: out  # noqa: E731
    else:  # q, k, v are views of rows (run_config); the views stay in every step's graph, their backward holds nothing
        leaves = [as_rows(t).detach().requires_grad_() for t in (q, k, v)]
        inputs = [as_heads(rows, t.shape[1]) for rows, t in zip(leaves, (q, k, v))]
        output = as_rows
    attention = forward_callable(impl, *inputs, causal)
    dout = output(torch.randn_like(q))
    kept = []

    def forward():
        return output(attention())

    def step():
        return torch.autograd.grad(forward(), leaves, dout)

    def backward():
        if not kept:
            kept.append(forward())
        return torch.autograd.grad(kept[0], leaves, dout, retain_graph=True)

    return Timed(step, (1.0 + BACKWARD_FLOPS) * area_factor(impl, q, causal), backward,
                 area_factor(impl, q, causal))


MODES = {"fwd": make_fwd_fn, "fwdbwd": make_fwdbwd_fn}


# ------------------------------------------------------------------------------------------------------ timers
def cpu_median_ms(fn: Callable[[], object]) -> float:
    for _ in range(CPU_WARMUP_CALLS):
        fn()
    times = []
    for _ in range(CPU_REPS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cuda_event_median_ms(fn: Callable[[], object]) -> float:
    """Fallback when triton is missing: warm up for GPU_WARMUP_MS, then time single calls with CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(1, int(GPU_WARMUP_MS / estimate))):
        fn()
    times = []
    for _ in range(max(5, int(GPU_REP_MS / estimate))):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_timer(device: str) -> Tuple[Callable[[Callable[[], object]], float], str]:
    """The timing function for `device` and its description (for the metadata)."""
    if device == "cpu":
        return cpu_median_ms, f"time.perf_counter median of {CPU_REPS} after {CPU_WARMUP_CALLS} warmup call(s)"
    try:
        from triton.testing import do_bench
    except ImportError:
        return cuda_event_median_ms, "CUDA events median (triton missing)"

    def triton_median_ms(fn):
        return do_bench(fn, warmup=GPU_WARMUP_MS, rep=GPU_REP_MS, return_mode="median")

    return triton_median_ms, f"triton.testing.do_bench median (warmup {GPU_WARMUP_MS} ms, rep {GPU_REP_MS} ms)"


# ------------------------------------------------------------------------------------------------- measurement
@dataclass
class Measurement:
    ms: Optional[float] = None
    tflops: Optional[float] = None
    mem_mib: Optional[float] = None
    error: Optional[str] = None
    bwd_ms: Optional[float] = None  # the backward alone, where the mode times it
    bwd_tflops: Optional[float] = None


@dataclass
class Row:
    config: Config
    results: Dict[str, Measurement] = field(default_factory=dict)
    max_abs_diff: Optional[float] = None  # our output's error against the check's reference
    grad_abs_diff: Optional[float] = None  # the largest of our dq, dk and dv errors (fwdbwd)
    diff_ref: Optional[str] = None
    diff_ok: Optional[bool] = None
    diff_over: Optional[str] = None  # where diff_ok is False: each tensor past its bound, "dk 0.057 > 0.045"

    def tflops(self, impl: str, part: str = "") -> Optional[float]:
        """TFLOP/s of the mode's step, or of the backward alone with part="bwd"."""
        result = self.results.get(impl)
        return getattr(result, f"{part}_tflops" if part else "tflops") if result else None

    def best_sdpa(self, backends: List[str], part: str = "") -> Optional[str]:
        """The fastest of the SDPA backends in `backends` (never a peer such as flex or dense)."""
        timed = [b for b in backends if b in SDPA_BACKENDS and self.tflops(b, part) is not None]
        return max(timed, key=lambda b: self.tflops(b, part)) if timed else None

    def ratio(self, impl: Optional[str], part: str = "") -> Optional[float]:
        ours, other = self.tflops("ours", part), self.tflops(impl, part) if impl else None
        return ours / other if ours is not None and other else None


def short_error(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def release_cuda_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def peak_memory_mib(fn: Callable[[], object]) -> float:
    """Peak CUDA memory allocated during one call, above what was allocated before it (the inputs)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    del result
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def round_order(impls: List[str], round_index: int) -> List[str]:
    """The order of one round: as given in even rounds, reversed in odd ones. An implementation inside the list then
    follows its neighbour on one side, then on the other; the first and last follow themselves across every other
    round's boundary."""
    return impls if round_index % 2 == 0 else impls[::-1]


def measure(impls: List[str], q, k, v, config: Config, make_fn, timer, device: str,
            rounds: int) -> Dict[str, Measurement]:
    """Time each implementation `rounds` times, interleaved, and keep the median: a card's speed drifts between
    measurements seconds apart, and interleaving spreads that drift over all of them. The order turns round every
    round (round_order): what runs just before a measurement moves it under a power cap (by up to 9% in a fixed order
    on the H200; benchmarks/lab/bench_method_probe.py). An implementation that raises (an unsupported configuration, an
    OOM) gets an error, shown as '-'."""
    results: Dict[str, Measurement] = {}

    def attempt(impl: str, step: Callable[[], object]):
        try:
            return step()
        except Exception as exc:
            release_cuda_memory(device)
            results[impl] = Measurement(error=short_error(exc))
            return None

    def prepare(impl: str) -> Timed:
        timed = make_fn(impl, q, k, v, config.causal)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA explains each refusal in a UserWarning; we keep the error
            for fn in (timed.step, timed.backward):  # raises here if the implementation rejects the configuration
                if fn is not None:
                    fn()
        return timed

    prepared = {impl: attempt(impl, lambda: prepare(impl)) for impl in impls}
    times: Dict[str, List[float]] = {impl: [] for impl in impls}
    bwd_times: Dict[str, List[float]] = {impl: [] for impl in impls}
    for round_index in range(rounds):
        for impl in round_order(impls, round_index):
            if impl not in results:
                times[impl].append(attempt(impl, lambda: timer(prepared[impl].step)))
            if impl not in results and prepared[impl].backward is not None:
                bwd_times[impl].append(attempt(impl, lambda: timer(prepared[impl].backward)))

    def rate(ms: float, flops: float) -> float:
        return config.forward_flops() * flops / (ms * 1e-3) / 1e12

    for impl in impls:
        if impl in results:
            continue
        timed = prepared[impl]
        mem = attempt(impl, lambda: peak_memory_mib(timed.step)) if device == "cuda" else None
        if impl not in results:
            ms = statistics.median(times[impl])
            results[impl] = Measurement(ms=ms, tflops=rate(ms, timed.flops), mem_mib=mem)
            if bwd_times[impl]:
                bwd_ms = statistics.median(bwd_times[impl])
                results[impl].bwd_ms, results[impl].bwd_tflops = bwd_ms, rate(bwd_ms, BACKWARD_FLOPS * timed.area)
    return results


def results_of(impl: str, q, k, v, causal: bool, dout: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """impl's output for q, k, v and, given dout, its gradients of q, k and v. The SDPA backends get K / V repeated
    for GQA (their gradients are summed back by autograd) rather than enable_gqa, which not all of them take."""
    leaves = [t.detach().requires_grad_(dout is not None) for t in (q, k, v)]
    q_in, k_in, v_in = leaves
    if impl in SDPA_BACKENDS and k.shape[1] != q.shape[1]:
        k_in, v_in = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k_in, v_in))
    with torch.set_grad_enabled(dout is not None):
        out = forward_callable(impl, q_in, k_in, v_in, causal)()
    if dout is None:
        return [out]
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


CHECKED = ["out", "dq", "dk", "dv"]  # the tensors of results_of, in its order


def within_rule(ours: List[torch.Tensor], truth: List[torch.Tensor], low: List[torch.Tensor],
                dtype: torch.dtype) -> Tuple[List[float], bool, str]:
    """Our max abs errors against `truth` (the reference path on upcast inputs), tensor by tensor; whether each is
    within ERROR_FACTOR times that path's own error in the input dtype (`low`) plus the floor; and those that are not,
    each with its bound ("dk 0.057 > 0.045"; empty when all are within)."""
    errors = [(mine.float() - want).abs().max().item() for mine, want in zip(ours, truth)]
    bounds = [error_bound((theirs.float() - want).abs().max().item(), dtype) for theirs, want in zip(low, truth)]
    over = "; ".join(f"{name} {e:.3g} > {b:.3g}" for name, e, b in zip(CHECKED, errors, bounds) if not e <= b)  # NaN too
    return errors, not over, over


def check_correctness(row: Row, q, k, v, with_grads: bool, math_budget_bytes: float) -> None:
    """Fill the row's errors against the reference path on upcast inputs, and whether each is within ERROR_FACTOR
    times that path's own error in the input dtype plus the floor (diff_ok). The reference is FlexAttention with score
    modifications, else SDPA's efficient backend on the GPU (never a flash provider's), else math where its float32
    scores fit math_budget_bytes."""
    causal = row.config.causal
    dout = torch.randn_like(q) if with_grads else None
    try:
        ours = results_of("ours", q, k, v, causal, dout)
    except Exception:
        return
    upcast = torch.float64 if q.dtype == torch.float32 else torch.float32
    candidates = ["flex"] if MODS.active else ["efficient"] if q.is_cuda else []
    if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4 <= math_budget_bytes:
        candidates.append("math")
    row.diff_ref = "-"
    for impl in candidates:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                truth = results_of(impl, *(t.to(upcast) for t in (q, k, v)), causal,
                                   dout.to(upcast) if with_grads else None)
                low = results_of(impl, q, k, v, causal, dout)
        except Exception:
            release_cuda_memory(q.device.type)
            continue
        errors, row.diff_ok, over = within_rule(ours, truth, low, q.dtype)
        row.diff_over = over or None
        row.diff_ref = f"{impl} {str(upcast).replace('torch.', '')}"
        row.max_abs_diff = errors[0]
        row.grad_abs_diff = max(errors[1:]) if with_grads else None
        return


def run_config(config: Config, impls: List[str], args, make_fn, timer) -> Row:
    shape = (config.batch, config.heads, config.seqlen, config.head_dim)
    kv_shape = (config.batch, config.kv_heads, config.seqlen, config.head_dim)
    options = dict(dtype=DTYPES[config.dtype], device=args.device)
    q, k, v = (torch.randn(s, **options) for s in (shape, kv_shape, kv_shape))
    budget = args.naive_mem_gib * 2**30
    row = Row(config)
    if "flex" in impls or MODS.active:
        # FlexAttention compiles per configuration: one dynamo cache per row (its recompile limit, shared across
        # rows, would otherwise send later rows down flex's unfused path).
        torch._dynamo.reset()
    if LAYOUT == "bshd":  # views of (B, L, H * D) rows, checked and timed as such
        q, k, v = (as_heads(as_rows(t), t.shape[1]) for t in (q, k, v))
    check_correctness(row, q, k, v, args.mode == "fwdbwd", budget)
    timed = list(impls)
    if "naive" in impls and config.score_bytes(q.element_size()) > budget:
        gib = config.score_bytes(q.element_size()) / 2**30
        timed.remove("naive")
        row.results["naive"] = Measurement(error=f"skipped: scores {gib:.3g} GiB > --naive-mem-gib")
    row.results.update(measure(timed, q, k, v, config, make_fn, timer, args.device, args.rounds))
    row.results = {impl: row.results[impl] for impl in impls}  # table order
    del q, k, v
    release_cuda_memory(args.device)
    return row


def progress(total: int):
    """A tqdm bar on stderr, or plain progress prints when tqdm is missing."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="bench_sdpa", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return PlainProgress(total)


class PlainProgress:
    def __init__(self, total: int):
        self.total, self.done, self.label = total, 0, ""

    def set_postfix_str(self, label: str) -> None:
        self.label = label
        print(f"[{self.done + 1}/{self.total}] {label}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        pass


def run_grid(configs: List[Config], impls: List[str], args, make_fn, timer) -> List[Row]:
    rows = []
    bar = progress(len(configs))
    for config in configs:
        bar.set_postfix_str(config.label)
        rows.append(run_config(config, impls, args, make_fn, timer))
        bar.update(1)
    bar.close()
    return rows


# ----------------------------------------------------------------------------------------------------- outputs
def fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def fmt_rate(value: Optional[float]) -> str:
    """TFLOP/s with one decimal on the GPU scale, three significant digits below 10 (the CPU scale)."""
    return fmt(value, ".1f" if value is not None and value >= 10 else ".3g")


def significant(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None else float(format(value, f".{digits}g"))


def row_record(row: Row, impls: List[str], backends: List[str], with_bwd: bool = False) -> Dict[str, object]:
    """One flat dict per row, numbers to 4 significant digits, the ratios to 5 (so that a ratio just below a bar such
    as 1.10 does not read as 1.1): the CSV columns (the JSON adds the errors). with_bwd adds the backward alone."""
    c = row.config
    best = row.best_sdpa(backends)
    record = dict(dtype=c.dtype, head_dim=c.head_dim, causal=c.causal, seqlen=c.seqlen, batch=c.batch,
                  heads=c.heads, heads_kv=c.kv_heads, fwd_gflop=round(c.forward_flops() / 1e9, 3))
    for impl in impls:
        result = row.results[impl]
        record[f"{impl}_ms"] = significant(result.ms)
        record[f"{impl}_tflops"] = significant(result.tflops)
        record[f"{impl}_mem_mib"] = significant(result.mem_mib)
        if with_bwd:
            record[f"{impl}_bwd_ms"] = significant(result.bwd_ms)
            record[f"{impl}_bwd_tflops"] = significant(result.bwd_tflops)
    record.update(
        best_sdpa=best, ours_over_best=significant(row.ratio(best), 5),
        ours_over_flash=significant(row.ratio("flash"), 5) if "flash" in backends else None,
    )
    if with_bwd:
        best_bwd = row.best_sdpa(backends, "bwd")
        record.update(best_sdpa_bwd=best_bwd, ours_bwd_over_best=significant(row.ratio(best_bwd, "bwd"), 5))
    for peer in PEERS:
        if peer in backends:
            record[f"ours_over_{peer}"] = significant(row.ratio(peer), 5)
    record.update(max_abs_diff=significant(row.max_abs_diff, 3), diff_ref=row.diff_ref, diff_ok=row.diff_ok)
    if with_bwd:
        record["grad_abs_diff"] = significant(row.grad_abs_diff, 3)
    record["diff_over"] = row.diff_over
    return record


def write_csv(path: Path, records: List[Dict[str, object]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def metadata(args, timer_name: str) -> Dict[str, object]:
    on_gpu = args.device == "cuda"
    return dict(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if on_gpu else cpu_name(),
        device_uuid=gpu_uuid() if on_gpu else None,
        cpu_threads=torch.get_num_threads(),
        torch=torch.__version__,
        cuda=torch.version.cuda if on_gpu else None,
        cudnn=torch.backends.cudnn.version() if on_gpu else None,
        python=platform.python_version(),
        flashattn_ext=getattr(flashattn_ext, "__version__", None),
        flashattn_ext_path=getattr(flashattn_ext, "__file__", None),
        git_commit=git_commit(),
        dtypes=args.dtypes, mode=args.mode, deterministic=args.deterministic, timer=timer_name, rounds=args.rounds,
        naive_mem_gib=args.naive_mem_gib, score_mods=MODS.label,
        tokens=args.tokens, hidden=args.hidden, kv_heads=args.kv_heads, flash_provider=args.flash_provider,
        layout=args.layout,
    )


def gpu_uuid() -> Optional[str]:
    """The card's UUID: which physical GPU a run had. Each run may land on another card, and runs on different cards
    differed by up to a few percent in ours / cuDNN (benchmarks/lab/LOG.md, Method)."""
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return None if uuid is None else str(uuid)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        models = []
    model = models[0] if models else platform.processor() or platform.machine()
    return f"CPU {model} ({torch.get_num_threads()} threads)"


def git_commit() -> Optional[str]:
    """The checkout's commit, with "-dirty" where tracked files differ from it (the results are then not that
    commit's)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_json(path: Path, meta, rows: List[Row], records: List[Dict[str, object]]) -> None:
    payload = dict(metadata=meta, rows=[
        dict(record, errors={impl: r.error for impl, r in row.results.items() if r.error})
        for row, record in zip(rows, records)
    ])
    path.write_text(json.dumps(payload, indent=2) + "\n")


IMPL_STYLE = {  # colour and marker per line of the plot
    "ours": ("black", "o"), "flash": ("tab:blue", "s"), "efficient": ("tab:orange", "^"),
    "cudnn": ("tab:green", "D"), "math": ("tab:purple", "v"), "naive": ("tab:red", "x"),
    "flex": ("tab:cyan", "P"), "dense": ("tab:gray", "*"),
}


def write_plot(path: Path, rows: List[Row], impls: List[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.config.dtype, r.config.head_dim) for r in rows})
    causals = sorted({r.config.causal for r in rows})
    header_inches = 0.7  # the title and the legend above the panels
    width, height = max(10.0, 5.5 * len(causals)), 3.8 * len(panels) + header_inches
    fig, axes = plt.subplots(len(panels), len(causals), figsize=(width, height), squeeze=False, sharex=True)
    for (dtype, head_dim), ax_row in zip(panels, axes):
        for causal, ax in zip(causals, ax_row):
            panel_rows = sorted((r for r in rows if (r.config.dtype, r.config.head_dim, r.config.causal)
                                 == (dtype, head_dim, causal)), key=lambda r: r.config.seqlen)
            lengths = [r.config.seqlen for r in panel_rows]
            for impl in impls:
                values = [r.tflops(impl) for r in panel_rows]
                color, marker = IMPL_STYLE[impl]
                ax.plot(lengths, [math.nan if t is None else t for t in values], label=impl, color=color,
                        marker=marker, linewidth=2.2 if impl == "ours" else 1.4)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.set_title(f"{dtype}  D={head_dim}  causal={'on' if causal else 'off'}")
            ax.set_xlabel("sequence length L")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(impls), bbox_to_anchor=(0.5, 1 - 0.3 / height),
               frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - header_inches / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)


SHORT_NAMES = {"efficient": "effic"}


def table_columns(backends: List[str], impls: List[str], with_bwd: bool = False
                  ) -> List[Tuple[str, Callable[[Row], str]]]:
    """(header, cell function) per printed column; the TFLOP/s columns follow the chosen implementations; with_bwd
    adds the backward alone: ours, the fastest SDPA backend's, and their ratio."""
    columns: List[Tuple[str, Callable[[Row], str]]] = [
        ("dtype", lambda r: r.config.dtype),
        ("D", lambda r: str(r.config.head_dim)),
        ("causal", lambda r: "on" if r.config.causal else "off"),
        ("L", lambda r: str(r.config.seqlen)),
        ("B", lambda r: str(r.config.batch)),
        ("H", lambda r: f"{r.config.heads}/{r.config.kv_heads}" if r.config.kv_heads != r.config.heads
         else str(r.config.heads)),
        ("ours ms", lambda r: fmt(r.results["ours"].ms, ".3f")),
    ]
    for impl in impls:
        columns.append((f"{SHORT_NAMES.get(impl, impl)} TF", lambda r, i=impl: fmt_rate(r.tflops(i))))
    columns += [
        ("best", lambda r: r.best_sdpa(backends) or "-"),
        ("/best", lambda r: fmt(r.ratio(r.best_sdpa(backends)), ".2f")),
    ]
    for peer in ("flash", *PEERS):
        if peer in backends:
            columns.append((f"/{peer}", lambda r, p=peer: fmt(r.ratio(p), ".2f")))
    if with_bwd:
        columns += [
            ("bwd TF", lambda r: fmt_rate(r.tflops("ours", "bwd"))),
            ("best bwd TF", lambda r: fmt_rate(r.tflops(r.best_sdpa(backends, "bwd"), "bwd")
                                               if r.best_sdpa(backends, "bwd") else None)),
            ("bwd /best", lambda r: fmt(r.ratio(r.best_sdpa(backends, "bwd"), "bwd"), ".2f")),
        ]
    columns += [
        ("MiB ours", lambda r: fmt(r.results["ours"].mem_mib, ".0f")),
        ("MiB best", lambda r: fmt(r.results[r.best_sdpa(backends)].mem_mib if r.best_sdpa(backends) else None,
                                   ".0f")),
        ("max diff", lambda r: fmt(r.max_abs_diff, ".1e") + ("" if r.diff_ok in (None, True) else " !")),
    ]
    return columns


def print_table(rows: List[Row], backends: List[str], impls: List[str], with_bwd: bool = False) -> None:
    columns = table_columns(backends, impls, with_bwd)
    cells = [[cell(row) for _, cell in columns] for row in rows]
    widths = [max(len(header), *(len(line[i]) for line in cells)) for i, (header, _) in enumerate(columns)]
    print(" ".join(h.rjust(w) for (h, _), w in zip(columns, widths)))
    print(" ".join("-" * w for w in widths))
    for line in cells:
        print(" ".join(c.rjust(w) for c, w in zip(line, widths)))
    print("TF = TFLOP/s; best = fastest SDPA backend; /best, /flash = our TFLOP/s over theirs; "
          "MiB = peak memory above the inputs (CUDA only); max diff = max |ours - SDPA|, '!' above tolerance."
          + ("\nbwd = the backward alone (2.5x the forward FLOPs), ours and the fastest SDPA backend's." if with_bwd
             else ""))


def print_errors(rows: List[Row]) -> None:
    """Why our op showed '-' (other implementations' reasons are in the JSON)."""
    failures = [(r.config.label, r.results["ours"].error) for r in rows if r.results["ours"].error]
    for label, error in failures:
        print(f"ours failed at {label}: {error}")


def print_summary(rows: List[Row], backends: List[str], min_len: int, with_bwd: bool = False) -> None:
    print(f"\nSummary: lowest ratio of our TFLOP/s over rows with L >= {min_len}")
    groups = sorted({(r.config.dtype, r.config.head_dim, r.config.causal) for r in rows})
    for dtype, head_dim, causal in groups:
        group = [r for r in rows if (r.config.dtype, r.config.head_dim, r.config.causal) == (dtype, head_dim, causal)
                 and r.config.seqlen >= min_len]
        parts = []
        for peer in ("flash", *PEERS):
            if peer in backends:
                parts.append(f"ours/{peer} " + min_ratio(group, lambda r, p=peer: r.ratio(p)))
        parts.append("ours/best-SDPA " + min_ratio(group, lambda r: r.ratio(r.best_sdpa(backends))))
        if with_bwd:
            parts.append("bwd " + min_ratio(group, lambda r: r.ratio(r.best_sdpa(backends, "bwd"), "bwd")))
        print(f"  {dtype} D={head_dim:<3} causal={'on ' if causal else 'off'}  " + "   ".join(parts))
    flagged = [f"{r.config.label} ({r.diff_over})" for r in rows if r.diff_ok is False]
    print(f"Correctness: {len(flagged)} row(s) above tolerance" + (": " + "; ".join(flagged) if flagged else ""))
    # Rows our op ran but no reference path took (e.g. Flex failing on a score modification): not passes.
    unchecked = [r.config.label for r in rows if r.diff_ok is None and not r.results["ours"].error]
    if unchecked:
        print(f"Not checked (no reference path ran): {len(unchecked)} row(s): " + "; ".join(unchecked))


def min_ratio(rows: List[Row], ratio: Callable[[Row], Optional[float]]) -> str:
    values = [(ratio(r), r.config.seqlen) for r in rows if ratio(r) is not None]
    if not values:
        return "-"
    value, seqlen = min(values)
    return f"{value:.4f} (L={seqlen})"  # four decimals: 1.0998 is below 1.10


# --------------------------------------------------------------------------------------------------------- CLI
def int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def name_list(text: str, allowed, option: str) -> List[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"{option}: unknown {unknown}; choose from {sorted(allowed)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Grid defaults: GPU bf16, D 64,128,256, L 512..16384, tokens 16384, hidden 2048; "
               "CPU fp32, D 32,64, L 128,256,512, tokens 2048, hidden 256.",
    )
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where to run; auto = cuda when available, else the CPU variant")
    parser.add_argument("--dtypes", help="comma list of bf16, fp16, fp32")
    parser.add_argument("--head-dims", help="comma list of head dims D")
    parser.add_argument("--lengths", help="comma list of sequence lengths L (Lq == Lk)")
    parser.add_argument("--tokens", type=int, help="B*L per configuration (B = tokens // L, at least 1)")
    parser.add_argument("--hidden", type=int, help="H*D per configuration (H = hidden // D, at least 1)")
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="K/V heads (GQA: each serves H / kv-heads query heads; SDPA with enable_gqa); default H")
    parser.add_argument("--causal", choices=["both", "on", "off"], default="both", help="causal masking")
    parser.add_argument("--backends", help=f"comma list of SDPA backends from {', '.join(SDPA_BACKENDS)}, or the "
                                           f"peers {', '.join(PEERS)} (default with score modifications)")
    parser.add_argument("--naive-mem-gib", type=float, default=8.0,
                        help="skip the naive path when its score matrix exceeds this many GiB (0: never run it); "
                             "also bounds the math-backend reference of the correctness check")
    parser.add_argument("--rounds", type=int, default=4,
                        help="timings per implementation, interleaved across implementations in an order that turns "
                             "round every round; the median is kept")
    parser.add_argument("--quick", action="store_true", help="a small subset of the grid, for smoke tests")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the CSV, JSON and PNG")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--summary-min-len", type=int,
                        help="smallest L counted in the summary (default 1024 on GPU, 256 on CPU)")
    parser.add_argument("--mode", choices=sorted(MODES), default="fwd",
                        help="fwd: forward only; fwdbwd: forward + backward (3.5x forward FLOPs), and the backward "
                             "alone (2.5x); decode: bench_decode.py with the other arguments")
    parser.add_argument("--window", help="L,R: a sliding window (-1: unbounded on that side)")
    parser.add_argument("--softcap", type=float, default=0.0, help="cap the scores: C * tanh(score / C)")
    parser.add_argument("--sinks", action="store_true", help="one learnable sink logit per head")
    parser.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                        help="bshd: (B, L, H, D) views in, the output viewed back to (B, L, H * D), as a model")
    parser.add_argument("--varlen", action="store_true",
                        help="packed sequences against varlen_attn: runs bench_varlen.py with the other arguments")
    parser.add_argument("--flash-provider", metavar="NAME",
                        help="activate this SDPA flash provider for the run (torch.nn.attention."
                             "activate_flash_attention_impl, e.g. flashattn_ext): the flash column then times it")
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True); the files' names end in "
                             "_deterministic")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU visible")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    window = (-1, -1)
    if args.window:
        parts = int_list(args.window)
        if len(parts) != 2 or min(parts) < -1:
            parser.error("--window: L,R with entries >= -1")
        window = (parts[0], parts[1])
    if args.softcap < 0:
        parser.error("--softcap: >= 0")
    args.mods = ScoreMods(window, args.softcap, args.sinks)
    defaults = dict(GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS)
    if args.mods.active:
        defaults["backends"] = ",".join(PEERS)
    if args.quick:
        defaults.update(GPU_QUICK if args.device == "cuda" else CPU_QUICK)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def import_flashattn_ext():
    """Import the package installed, else the one built in place in this checkout."""
    global flashattn_ext
    try:
        import flashattn_ext as module
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        sys.modules.pop("flashattn_ext", None)
        try:
            import flashattn_ext as module
        except ImportError as exc:
            raise SystemExit(f"cannot import flashattn_ext ({exc}); build it first: "
                             "python setup.py build_ext --inplace (FLASHATTN_BUILD_CUDA=0 for CPU only)")
    flashattn_ext = module


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--varlen" in argv:  # packed sequences against varlen_attn: bench_varlen.py takes the other arguments
        from bench_varlen import main as varlen_main

        varlen_main([a for a in argv if a != "--varlen"])
        return
    decode = ["--mode", "decode"]
    at = next((i for i in range(len(argv)) if argv[i : i + 2] == decode or argv[i] == "--mode=decode"), None)
    if at is not None:  # decoding against a KV cache: bench_decode.py takes the other arguments
        from bench_decode import main as decode_main

        decode_main(argv[:at] + argv[at + (1 if argv[at] == "--mode=decode" else 2) :])
        return
    args = parse_args(argv)
    dtypes = name_list(args.dtypes, DTYPES, "--dtypes")
    global MODS, LAYOUT
    MODS, LAYOUT = args.mods, args.layout
    backends = name_list(args.backends, [*SDPA_BACKENDS, *PEERS], "--backends")
    import_flashattn_ext()
    if args.flash_provider:
        torch.nn.attention.activate_flash_attention_impl(args.flash_provider)
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        # FlexAttention past dynamo's recompile limit falls back to an unfused path: an error ('-'), not a timing.
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    impls = ["ours", *backends] + ([] if MODS.active else ["naive"])
    causals = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    configs = build_grid(dtypes, int_list(args.head_dims), int_list(args.lengths), causals, args.tokens,
                         args.hidden, args.kv_heads)
    for c in configs:
        if c.heads % c.kv_heads:
            raise SystemExit(f"--kv-heads {args.kv_heads} must divide H = {c.heads} (D = {c.head_dim})")
    timer, timer_name = make_timer(args.device)
    meta = metadata(args, timer_name)
    variant = "GPU" if args.device == "cuda" else "CPU variant (no GPU in use: small fp32 sizes by default)"
    card = f" ({meta['device_uuid']})" if meta["device_uuid"] else ""
    print(f"bench_sdpa: {variant} on {meta['device']}{card}; torch {meta['torch']}, cuDNN {meta['cudnn']}; "
          f"{len(configs)} configs x {len(impls)} implementations; timer: {timer_name}"
          + (f"; score modifications: {MODS.label}" if MODS.active else ""), flush=True)

    torch.manual_seed(0)
    if args.deterministic:  # cuBLAS (our chunked backward, SDPA's math) needs a fixed workspace for determinism
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(args.deterministic)
    try:
        rows = run_grid(configs, impls, args, MODES[args.mode], timer)
    finally:
        torch.use_deterministic_algorithms(False)

    with_bwd = args.mode == "fwdbwd"
    args.out.mkdir(parents=True, exist_ok=True)
    mods_tag = "_" + MODS.label.replace(", ", "_").replace(" ", "").replace(",", "-") if MODS.active else ""
    stem = args.out / (f"bench_sdpa_{args.device}_{args.mode}{mods_tag}{'_deterministic' if args.deterministic else ''}"
                       f"{'_bshd' if args.layout == 'bshd' else ''}")
    records = [row_record(row, impls, backends, with_bwd) for row in rows]
    write_csv(stem.with_suffix(".csv"), records)
    write_json(stem.with_suffix(".json"), meta, rows, records)
    written = [stem.with_suffix(".csv"), stem.with_suffix(".json")]
    if not args.no_plot:
        mode = args.mode + (", deterministic" if args.deterministic else "")
        title = f"flashattn_ext vs SDPA, {mode}, {meta['device']}, torch {meta['torch']}"
        write_plot(stem.with_suffix(".png"), rows, impls, title)
        written.append(stem.with_suffix(".png"))

    print()
    print_table(rows, backends, impls, with_bwd)
    print_errors(rows)
    print("wrote " + ", ".join(str(p) for p in written))
    print_summary(rows, backends, args.summary_min_len, with_bwd)


if __name__ == "__main__":
    main()
