"""TP 8 at 64K tokens (Qwen3-8B: q 4 heads, k 1 head, d 128, bf16): the forward of q and k with
per-head norms in one call (set_rotary_qk_kernel), kernels alone, under launch-rule variants of
its tiles (the positions tile's bytes and warps, pair tiles or not); each line one CUDA graph over
rotating sets larger than L2, lines interleaved, median (rope_qknorm_rules.py's timing: 7 rounds
of 10 replays), in copies of q and k. Prints each variant's largest difference from the
rule's result, then the table.

    python artifacts/qknorm/tp8_64k_tiles_ab.py      # on a GPU, from the repository root
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton

import triton_rotary_launch as L
from rope_qknorm_rules import build, graphed_over, graphed_under_rules, time_graphs

TOKENS, HQ, HK, D = 65536, 4, 1, 128
G = L.GPU_RULE
RULES = {"rule": G,
         "pos_tile_4k": G._replace(norm_positions_tile_bytes=4096),
         "pos_warps_8": G._replace(norm_positions_warps=8),
         "pos_tile_16k_8w": G._replace(norm_positions_tile_bytes=16384, norm_positions_warps=8),
         "pos_tile_4k_2w": G._replace(norm_positions_tile_bytes=4096, norm_positions_warps=2),
         "no_pair_tiles": G._replace(norm_pair_key_heads=0),
         "no_pair_no_overlap": G._replace(norm_pair_key_heads=0, qk_norm_overlap=False)}


def main():
    torch.manual_seed(0)
    P = build(dict(hq=HQ, hk=HK, d=D, offset=0.0, over="head"), tokens=TOKENS)
    sets, module, table, nq, nk = P.sets, P.module, P.freqs, P.nq, P.nk
    qk = L.set_rotary_qk_kernel
    steps = {"exact": lambda S: qk(S.q, S.k, module, "bshd", q_norm=nq, k_norm=nk),
             "table": lambda S: qk(S.q, S.k, table, "bshd", q_norm=nq, k_norm=nk)}
    graphs = {("copy", "-"): graphed_over(lambda S: (S.qd.copy_(S.q), S.kd.copy_(S.k)), sets)}
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for name, step in steps.items():
        by_rule, results = graphed_under_rules(step, RULES, sets)
        graphs.update({(name, rule_name): g for rule_name, g in by_rule.items()})
        first = results["rule"]
        for rule_name, result in results.items():
            if rule_name != "rule":
                diff = ((result - first).abs().max() / first.abs().max()).item()
                print(f"  {name} {rule_name}: max diff {diff:.1e}", flush=True)
    median = time_graphs(graphs, len(sets))
    copy_us = median[("copy", "-")]
    for (name, rule_name), us in sorted(median.items(), key=lambda kv: (kv[0][0], kv[1])):
        print(f"  {name:6s} {rule_name:20s} {us / copy_us:6.3f} copies {us:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
