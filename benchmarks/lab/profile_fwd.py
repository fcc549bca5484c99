"""A forward workload for Nsight Compute: our kernel and SDPA's at the benchmark grid's shapes, each run twice
(with --backward, forward and backward: profile the backward kernels with -k regex:"flash_bwd|sdpa.*bwd|cudnn").

B = tokens // L and H = hidden // D, as in bench_sdpa.py. The comparison in benchmarks/lab/LOG.md (v9) was taken with

    ncu --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \\
        --section ComputeWorkloadAnalysis -k regex:"flash_fwd_sm90|sdpa" -c 8 \\
        python benchmarks/lab/profile_fwd.py --head-dim 128 --lengths 1024,16384

Add `--set full --import-source yes` (and build with -lineinfo, the default) for the stall reasons per source line;
benchmarks/lab/ncu_stalls.py sums them per SASS instruction and per stretch of code.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", default="1024,16384", help="comma-separated sequence lengths")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--backend", default="cudnn", choices=sorted(BACKENDS), help="the SDPA backend next to ours")
    parser.add_argument("--tokens", type=int, default=16384, help="B * L")
    parser.add_argument("--hidden", type=int, default=2048, help="H * D")
    parser.add_argument("--backward", action="store_true", help="each call also runs the backward for a random dout")
    parser.add_argument("--window", default="-1,-1", metavar="L,R",
                        help="a sliding window for our calls (the options kernels; SDPA's run without it)")
    parser.add_argument("--softcap", type=float, default=0.0, help="cap our scores: C * tanh(score / C)")
    args = parser.parse_args()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    window = tuple(int(x) for x in args.window.split(","))
    for length in (int(x) for x in args.lengths.split(",")):
        batch, heads = max(1, args.tokens // length), max(1, args.hidden // args.head_dim)
        q, k, v = (torch.randn(batch, heads, length, args.head_dim, device="cuda", dtype=dtype,
                               requires_grad=args.backward) for _ in range(3))
        dout = torch.randn_like(q)
        for _ in range(2):  # the first SDPA call also builds cuDNN's graph; profile the second with -s or -c
            outputs = [flashattn_ext.flash_attn(q, k, v, args.causal, window_size=window, softcap=args.softcap)]
            with sdpa_kernel(BACKENDS[args.backend]):
                outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=args.causal))
            if args.backward:
                for out in outputs:
                    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
