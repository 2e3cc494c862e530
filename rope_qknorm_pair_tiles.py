#!/usr/bin/env python3
"""q and k with per-head norms where the key has one head, under launch-rule variants: the
evidence for NORM_PAIR_KEY_HEADS, NORM_PAIR_FEW_HEADS and NORM_PAIR_EXACT_MAX_HEADS in
triton_rotary_launch.py.

    python rope_qknorm_pair_tiles.py OUT        # on a GPU, from the repository root

For one rank of tensor parallelism (a query of 2-8 heads, a key of one), bf16, times
`apply_rotary_pos_emb_qk` with norms, forward and forward + backward, with exact angles (the
module) and with TE's table, under each rule of RULES, in units of one device copy of q and k.
Each line is one CUDA graph over rotating buffer sets larger than L2, captured under its rule
and timed as rope_qknorm_rules.py times its lines (round-robin rounds, median). Each rule's
forward outputs are compared with the first rule's; a difference (the key's norm sums add up in
another order in another tile) is printed. Writes OUT/pair_tiles.log.
"""
import os
import sys

sys.path.insert(0, os.getcwd())

import torch

import rope_qknorm_bench as qb
import triton_rotary_launch as L
import triton_rotary_main as trm
from rope_qknorm_rules import ROUNDS, graphed_over, time_graphs

POINTS = [  # a model of rope_qknorm_bench.MODELS, its query heads at one rank, tokens; one key head
    ("Qwen3-8B", 4, (16384, 65536)),
    ("Qwen3-32B", 8, (32768,)),
    ("Gemma-3-12B", 2, (32768,)),
    ("Qwen3-8B", 2, (65536,)),
]
G = L.GPU_RULE
RULES = {
    "separate": G._replace(norm_pair_key_heads=0),          # q's and k's own tiles
    "pair": G,
    "pair_exact_8_heads": G._replace(norm_pair_exact_max_heads=8),   # exact angles up to 8
    "pair_q_tile": G._replace(norm_pair_few_heads=0),       # q's own tile at every head count
    "pair_16k_positions": G._replace(norm_positions_tile_bytes=16384),
    "pair_8k_plain_4_warps": G._replace(tile_bytes=8192, norm_warps=4),
}
FORWARD_BACKWARD_RULES = ("separate", "pair", "pair_exact_8_heads")


def point(model, hq, s, log):
    """Time and compare the rules at `model`'s shapes (a dict of rope_qknorm_bench.MODELS) with
    hq query heads and one key head: one rank of tensor parallelism over model["hq"] // hq."""
    cfg = dict(model, model=f"{model['model']}-TP{model['hq'] // hq}", hq=hq, hk=1)
    offset = cfg["offset"]
    P = qb.build_point(cfg, s, torch.device("cuda"))
    for angles, freqs in (("exact", P.rope), ("table", P.freqs)):
        def line(S, freqs=freqs):
            outs = trm.apply_rotary_pos_emb_qk(S.q, S.k, freqs, q_norm_weight=P.wq,
                                               k_norm_weight=P.wk, norm_eps=qb.EPS,
                                               norm_offset=offset, norm_over="head",
                                               tensor_format="bshd")
            return outs, (S.q, S.k, P.wq, P.wk), (S.gq, S.gk)
        outputs = {}
        for mode, names in (("fwd", list(RULES)), ("fwd_bwd", FORWARD_BACKWARD_RULES)):
            graphs = {"copy": graphed_over(qb.make_step(None, mode), P.sets)}
            for name in names:
                step = qb.make_step(line, mode)
                with L.use_launch_rule(RULES[name]):     # plans are keyed by the rule
                    if mode == "fwd":
                        with torch.no_grad():
                            outputs[name] = [o.float() for o in line(P.sets[0])[0]]
                    graphs[name] = graphed_over(step, P.sets)
            us = time_graphs(graphs, len(P.sets))
            cells = "  ".join(f"{name}={us[name] / us['copy']:.3f}" for name in names)
            log.append(f"{cfg['model']:<16} {s:>6} {angles:<5} {mode:<7} {cells}   "
                       f"(copy {us['copy']:.1f} us)")
            print(log[-1], flush=True)
            for graph in graphs.values():
                graph.reset()
        first = next(iter(RULES))
        for name, outs in outputs.items():
            diff = max((a - b).abs().max().item() for a, b in zip(outs, outputs[first]))
            if diff:
                log.append(f"    {name}: max |out - {first}'s| = {diff:.3g}")
                print(log[-1], flush=True)


def main():
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage: python rope_qknorm_pair_tiles.py OUT  (a CUDA device)")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    log = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}: forward (fwd) and forward "
           f"+ backward (fwd_bwd) in copies of q and k, median of {ROUNDS} rounds"]
    print(log[0], flush=True)
    models = {m["model"]: m for m in qb.MODELS}
    for name, hq, tokens in POINTS:
        for s in tokens:
            point(models[name], hq, s, log)
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "pair_tiles.log"), "w") as f:
        f.write("\n".join(log) + "\n")


if __name__ == "__main__":
    main()
