"""TP 8 (Qwen3-8B: q 4 heads, k 1 head, d 128, bf16) at 16K and 64K tokens: the forward of q and
k with per-head norms in one call (set_rotary_qk_kernel: one pair-tile launch, 80 registers a
thread uncapped with Triton 3.6, so six programs of 4 warps an SM), with its registers capped by
Triton's `maxnreg` at 72 (seven programs; spills 8 registers) and 64 (eight programs), kernels
alone; exact angles and TE's table. Each line one CUDA graph over rotating sets larger than L2,
lines interleaved, median (rope_qknorm_rules.py's timing: 7 rounds of 10 replays), in copies of q
and k. Prints each variant's largest difference from the uncapped result, then the table.

    python artifacts/qknorm/forward_registers_ab.py      # on a GPU, from the repository root
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton

import triton_rotary_launch as L
from rope_bench_report import flat_outputs
from rope_qknorm_rules import build, graphed_over, time_graphs

HQ, HK, D = 4, 1, 128
CAPS = (0, 72, 64)           # 0: the launch rule's (none for a forward)
PLANNED_MAX_REGISTERS = L._max_registers


def forward_capped(cap):
    """_max_registers with the norm forwards capped at `cap` (0: as planned)."""
    def max_registers(rule, cfg):
        if cap and cfg.NORM and not cfg.BACKWARD:
            return cap
        return PLANNED_MAX_REGISTERS(rule, cfg)
    return max_registers


def time_point(tokens):
    """Print the variants' differences and the table for TP 8 at `tokens` tokens."""
    P = build(dict(hq=HQ, hk=HK, d=D, offset=0.0, over="head"), tokens=tokens)
    qk = L.set_rotary_qk_kernel
    steps = {"exact": lambda S: qk(S.q, S.k, P.module, "bshd", q_norm=P.nq, k_norm=P.nk),
             "table": lambda S: qk(S.q, S.k, P.freqs, "bshd", q_norm=P.nq, k_norm=P.nk)}
    graphs = {("copy", 0): graphed_over(lambda S: (S.qd.copy_(S.q), S.kd.copy_(S.k)), P.sets)}
    for name, step in steps.items():
        first = None
        for cap in CAPS:
            L._PLANS.clear()
            L._max_registers = forward_capped(cap)
            try:
                result = flat_outputs(step(P.sets[0]))
                graphs[(name, cap)] = graphed_over(step, P.sets)
            finally:
                L._max_registers = PLANNED_MAX_REGISTERS
            if first is None:
                first = result
            else:
                diff = ((result - first).abs().max() / first.abs().max()).item()
                print(f"  {tokens} {name} cap {cap}: max diff {diff:.1e}", flush=True)
    median = time_graphs(graphs, len(P.sets))
    copy_us = median[("copy", 0)]
    print(f"TP 8, {tokens} tokens: copy of q and k {copy_us:.1f} us", flush=True)
    for (name, cap), us in sorted(median.items(), key=lambda kv: (kv[0][0], kv[1])):
        print(f"  {name:6s} cap {cap:3d}  {us / copy_us:6.3f} copies {us:7.1f} us", flush=True)
    for graph in graphs.values():
        graph.reset()
    L._PLANS.clear()


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for tokens in (16384, 65536):
        time_point(tokens)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
