"""Forward and backward calls for the schedule tests, run in a process of their own where a switch must differ
(isolated.py)."""
import json
import os
import tempfile

import torch

import flashattn_ext


def forward_each(cases):
    """cases: [(q, k, v, causal, scale)] -> [(out, lse, the number of allocations the call made)]."""
    results = []
    for q, k, v, causal, scale in cases:
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        out, lse = torch.ops.flashattn.fwd(q, k, v, causal, scale)
        results.append((out, lse, torch.cuda.memory_stats()["allocation.all.allocated"] - before))
    return results


def kvcache_each(cases):
    """cases: [(q, k_cache, v_cache, kwargs)] -> ([(out, lse)], the names of the CUDA kernels the calls ran)."""
    results = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for q, k_cache, v_cache, kwargs in cases:
            results.append(flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, return_lse=True, **kwargs))
        torch.cuda.synchronize()
    return results, sorted({event.name for event in prof.events()})


def backward_each(cases):
    """cases: [(name of a torch.ops.flashattn backward, args, kwargs)] -> [(dq, dk, dv)]."""
    return [getattr(torch.ops.flashattn, op)(*args, **kwargs)[:3] for op, args, kwargs in cases]


def launches(prof, arg):
    """{kernel name: the values of `arg` ("shared memory", "grid", ...) its launches had} from a CUDA profile."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    values = {}
    for event in events:
        if event.get("cat") == "kernel" and arg in event.get("args", {}):
            value = event["args"][arg]
            values.setdefault(event["name"], set()).add(tuple(value) if isinstance(value, list) else value)
    return values


def profiled(run, cases, arg):
    """(run(cases), launches(its profile, arg))."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        results = run(cases)
        torch.cuda.synchronize()
    return results, launches(prof, arg)


def calls_each(cases):
    """cases: [(name of a flashattn_ext function, args, kwargs)] -> ([its result], {kernel name: the shared memory its
    launches had, as the profiler reports it})."""
    return profiled(lambda cases: [getattr(flashattn_ext, name)(*args, **kwargs) for name, args, kwargs in cases],
                    cases, "shared memory")


def backward_grids(cases):
    """backward_each(cases) and {kernel name: the grids (x, y, z) its launches had}."""
    return profiled(backward_each, cases, "grid")
