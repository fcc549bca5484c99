"""Sustained runs of our forward, cuDNN's and a bf16 matmul, with nvidia-smi sampling the SM clock, the board power
and the clock event reasons: at what clock each kernel runs once the card settles, and whether power caps it.

    python benchmarks/lab/power_probe.py                        # default shapes, 3 s each
    python benchmarks/lab/power_probe.py 128:nc:8192 256:c:4096 --seconds 5
    python benchmarks/lab/power_probe.py 128:c:16384 --softcap 30   # our forward with softcap too

A shape is D:nc|c:L with B = 16384 // L and H = 2048 // D, as in bench_sdpa.py's grid. For each run it prints the
TFLOP/s over the second half of the run and over its first 50 calls, and the medians of the samples taken after the
first third of the run. On the H200 (LOG.md, Method) every kernel probed ran at the 700 W cap (clock event reason 0x4,
software power cap), which short benchmark windows and Nsight Compute's locked clocks (benchmarks/lab/ncu_ab.py) do not
show.
"""
import argparse
import statistics
import subprocess
import tempfile
import time

DEFAULT_SHAPES = ("128:nc:8192", "128:nc:4096", "256:nc:8192", "64:nc:8192", "128:c:8192")
CALLS_PER_TIMING = 10
SAMPLE_MS = 50


def parse_shape(text):
    """'128:nc:8192' -> (128, False, 8192)."""
    head_dim, mask, length = text.split(":")
    if mask not in ("nc", "c"):
        raise argparse.ArgumentTypeError(f"shape {text!r}: the mask is 'nc' or 'c'")
    return int(head_dim), mask == "c", int(length)


def smi_fields(reason_field):
    return ["timestamp", "clocks.sm", "power.draw", "temperature.gpu", reason_field]


def reason_field():
    """The clock-reasons column: clocks_event_reasons on current drivers, clocks_throttle_reasons on older ones."""
    for field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        if subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv"], capture_output=True).returncode == 0:
            return field
    raise RuntimeError("nvidia-smi reports no clock reasons field")


def summarise_samples(lines):
    """Medians of clock (MHz), power (W) and temperature (C) over the samples after the first third (the card
    settling), and the set of clock reasons seen there. `lines`: nvidia-smi's csv,noheader,nounits rows."""
    rows = [[field.strip() for field in line.split(",")] for line in lines if line.strip()]
    if not rows:
        raise RuntimeError("nvidia-smi wrote no samples")
    rows = rows[len(rows) // 3:]
    median = lambda i: statistics.median(float(row[i]) for row in rows)
    return median(1), median(2), median(3), sorted({row[4] for row in rows})


def sustained_run(fn, flops, seconds, field):
    import torch

    with tempfile.NamedTemporaryFile("w+", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(smi_fields(field))}",
                                "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)],
                               stdout=log, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            per_call_ms = []
            deadline = time.time() + seconds
            while time.time() < deadline:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(CALLS_PER_TIMING):
                    fn()
                end.record()
                end.synchronize()
                per_call_ms.append(start.elapsed_time(end) / CALLS_PER_TIMING)
        finally:
            smi.terminate()
            smi.wait()
        log.seek(0)
        clock, power, temperature, reasons = summarise_samples(log.readlines())
    tflops = lambda times: flops / statistics.median(times) / 1e9
    first = per_call_ms[:50 // CALLS_PER_TIMING]
    sustained = tflops(per_call_ms[len(per_call_ms) // 2:])
    return (f"{sustained:5.0f} TFLOP/s sustained (first 50 calls {tflops(first):4.0f}),"
            f" SM {clock:5.0f} MHz, {power:4.0f} W, {temperature:3.0f} C, reasons {reasons}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                        help="D:nc|c:L (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    parser.add_argument("--softcap", type=float, default=0.0, help="also run our forward with this softcap")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashattn_ext

    field = reason_field()
    print("nvidia-smi:", subprocess.run(["nvidia-smi", "--query-gpu=name,power.limit,clocks.max.sm", "--format=csv"],
                                        capture_output=True, text=True).stdout.strip().replace("\n", "; "))
    torch.manual_seed(0)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    print("matmul 8192^3      ", sustained_run(lambda: a @ b, 2 * 8192**3, args.seconds, field), flush=True)
    for head_dim, causal, length in args.shapes:
        batch, heads = max(1, 16384 // length), max(1, 2048 // head_dim)
        q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * length * length * head_dim / (2 if causal else 1)
        tag = f"D{head_dim} {'c ' if causal else 'nc'} L{length}"
        ours = sustained_run(lambda: flashattn_ext.flash_attn(q, k, v, causal), flops, args.seconds, field)
        print(tag, "ours ", ours, flush=True)
        if args.softcap > 0:
            capped = lambda: flashattn_ext.flash_attn(q, k, v, causal, softcap=args.softcap)
            print(tag, f"ours softcap {args.softcap:g}", sustained_run(capped, flops, args.seconds, field), flush=True)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            print(tag, "cudnn", sustained_run(run, flops, args.seconds, field), flush=True)


if __name__ == "__main__":
    main()
