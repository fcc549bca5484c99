"""Forward calls for the schedule tests, run in a process of their own where a switch must differ (isolated.py)."""
import torch

import flashattn_ext  # noqa: F401  (registers torch.ops.flashattn)


def forward_each(cases):
    """cases: [(q, k, v, causal, scale)] -> [(out, lse, the number of allocations the call made)]."""
    results = []
    for q, k, v, causal, scale in cases:
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        out, lse = torch.ops.flashattn.fwd(q, k, v, causal, scale)
        results.append((out, lse, torch.cuda.memory_stats()["allocation.all.allocated"] - before))
    return results
