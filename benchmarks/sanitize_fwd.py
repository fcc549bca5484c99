"""A few small forward calls for compute-sanitizer (memcheck, racecheck): odd lengths, causal, GQA, Lq != Lk.

Usage: compute-sanitizer --tool memcheck python benchmarks/sanitize_fwd.py
"""
import torch

import flashattn_ext

CASES = [  # (batch, heads, heads_kv, len_q, len_k, head_dim, causal)
    (1, 2, 2, 7, 7, 64, True),
    (2, 4, 2, 65, 97, 128, True),
    (1, 4, 1, 129, 63, 40, False),
    (1, 2, 2, 1, 257, 256, True),
    (1, 2, 2, 200, 33, 96, True),  # rows without keys
]


def main():
    for batch, heads, heads_kv, len_q, len_k, head_dim, causal in CASES:
        for dtype in (torch.bfloat16, torch.float16):
            q = torch.randn(batch, heads, len_q, head_dim, device="cuda", dtype=dtype)
            k = torch.randn(batch, heads_kv, len_k, head_dim, device="cuda", dtype=dtype)
            v = torch.randn(batch, heads_kv, len_k, head_dim, device="cuda", dtype=dtype)
            out, lse = torch.ops.flashattn.fwd(q, k, v, causal)
            assert out.shape == q.shape and lse.shape == (batch, heads, len_q)
    torch.cuda.synchronize()
    print(f"sanitize_fwd: {len(CASES) * 2} calls done")


if __name__ == "__main__":
    main()
