"""What the second pass of the norms' weight gradient (weight_gradient_kernel) costs a step:
kernels alone, bf16, exact angles, q and k in one call (rope_qknorm_rules.py's lines), at TP 8
(16K and 64K tokens) and Qwen3-8B (16K): the forward, the backward with and without the pass
(`_weight_gradient` replaced by one that allocates the gradients and launches nothing), both one
after the other, and copies of q and k once, twice and three times over. Each line one CUDA
graph over rotating sets larger than L2, lines interleaved, median (rope_qknorm_rules.py's
timing), in copies of q and k. Then each kernel's device time at TP 8 at 16K, eager, from
torch.profiler.

    python artifacts/qknorm/weight_gradient_pass_cost.py    # on a GPU, from the repository root
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
from torch.profiler import ProfilerActivity, profile

import triton_rotary_launch as L
from rope_qknorm_rules import POINTS, build, graphed_over, lines, time_graphs

PLANNED_WEIGHT_GRADIENT = L._weight_gradient


def no_pass(plan, partial, norm, second_norm=None):
    """`_weight_gradient` without its launch: the gradients allocated, not computed."""
    dws = [torch.empty(norm.weight.shape, device=partial.device, dtype=norm.weight.dtype)
           for _ in range(1 if second_norm is None else 2)]
    return dws[0] if second_norm is None else tuple(dws)


def captured(step, sets):
    """`step` over `sets` in one graph, planned afresh."""
    L._PLANS.clear()
    step(sets[0])
    return graphed_over(step, sets)


def captured_without_pass(step, sets):
    """`captured` with `_weight_gradient` launching nothing (`no_pass`)."""
    L._weight_gradient = no_pass
    try:
        return captured(step, sets)
    finally:
        L._weight_gradient = PLANNED_WEIGHT_GRADIENT


def report(title, graphs, nsets, width):
    """Time `graphs` (name -> graph over `nsets` sets, "copy" the unit), print them fastest
    first in copies under `title`, then release them and the plans."""
    median = time_graphs(graphs, nsets)
    copy_us = median["copy"]
    print(f"{title}: copy {copy_us:.2f} us")
    for name, us in sorted(median.items(), key=lambda kv: kv[1]):
        print(f"  {name:{width}s} {us / copy_us:6.3f} copies {us:7.2f} us")
    for graph in graphs.values():
        graph.reset()
    L._PLANS.clear()


def time_point(p, tokens):
    torch.manual_seed(0)
    P = build(p, tokens=tokens)
    st = lines(P)
    copy, fwd, bwd = st["copy"], st["qk_norm_fwd_exact"], st["qk_norm_bwd_exact"]
    steps = {"copy": copy, "fwd": fwd, "bwd": bwd,
             "fwd_bwd": lambda S: (*fwd(S), *bwd(S)),
             "fwd_fwd": lambda S: (*fwd(S), *fwd(S)),
             "copy_copy": lambda S: (*copy(S), *copy(S)),
             "copy3": lambda S: (*copy(S), *copy(S), *copy(S))}
    graphs = {name: captured(step, P.sets) for name, step in steps.items()}
    for name in ("bwd", "fwd_bwd"):
        graphs[name + "_no_pass"] = captured_without_pass(steps[name], P.sets)
    report(f"{p['model']} {tokens}", graphs, len(P.sets), 16)


def profile_kernels(p, tokens):
    """Device time per kernel of the eager forward and backward (torch.profiler)."""
    P = build(p, tokens=tokens)
    st = lines(P)
    fwd, bwd = st["qk_norm_fwd_exact"], st["qk_norm_bwd_exact"]
    for _ in range(3):
        for S in P.sets:
            fwd(S)
            bwd(S)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for S in P.sets:
            fwd(S)
            bwd(S)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    tp8 = next(p for p in POINTS if p["model"] == "Qwen3-8B-TP8")
    qwen3 = next(p for p in POINTS if p["model"] == "Qwen3-8B")
    for p, tokens in ((tp8, 16384), (tp8, 65536), (qwen3, 16384)):
        time_point(p, tokens)
        torch.cuda.empty_cache()
    profile_kernels(tp8, 16384)


if __name__ == "__main__":
    main()
