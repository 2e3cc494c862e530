"""The second pass of the norms' weight gradient under variants of its launch constants
(WEIGHT_GRADIENT_PROGRAMS, _TILE and _WARPS in triton_rotary_launch.py: programs per weight,
elements per step, warps) and without it (`_weight_gradient` launching nothing): forward +
backward of q and k in one call each way, kernels alone, bf16, exact angles, at TP 8, Qwen3-8B
and OLMo 2 at 16K tokens. Each line one CUDA graph over rotating sets larger than L2, lines
interleaved, median (rope_qknorm_rules.py's timing), in copies of q and k; before timing, each
variant's outputs and gradients against the rule's.

    python artifacts/qknorm/weight_gradient_pass_tiles.py   # on a GPU, from the repository root
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton

import triton_rotary_launch as L
from rope_bench_report import flat_outputs
from rope_qknorm_rules import POINTS, build, graphed_over, lines

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from weight_gradient_pass_cost import captured_without_pass, report  # noqa: E402

RULE = (L.WEIGHT_GRADIENT_PROGRAMS, L.WEIGHT_GRADIENT_TILE, L.WEIGHT_GRADIENT_WARPS)
VARIANTS = {"rule": RULE, "p32_w4": (32, 8192, 4), "p32_w2": (32, 8192, 2),
            "p16_w8": (16, 8192, 8), "p8_w8": (8, 8192, 8), "p32_t16k_w8": (32, 16384, 8),
            "p32_t4k_w4": (32, 4096, 4), "p1_w8": (1, 8192, 8), "p4_w4": (4, 8192, 4)}


def set_constants(programs, tile, warps):
    L.WEIGHT_GRADIENT_PROGRAMS, L.WEIGHT_GRADIENT_TILE, L.WEIGHT_GRADIENT_WARPS = (
        programs, tile, warps)


def time_point(p, tokens):
    torch.manual_seed(0)
    P = build(p, tokens=tokens)
    st = lines(P)
    fwd, bwd = st["qk_norm_fwd_exact"], st["qk_norm_bwd_exact"]

    def step(S):
        return (*fwd(S), *bwd(S))
    graphs = {"copy": graphed_over(st["copy"], P.sets)}
    first = None
    try:
        for name, constants in VARIANTS.items():
            set_constants(*constants)
            L._PLANS.clear()
            result = flat_outputs(step(P.sets[0]))
            if first is None:
                first = result
            else:
                diff = ((result - first).abs().max() / first.abs().max()).item()
                print(f"  {name}: max diff {diff:.1e}")
            graphs[name] = graphed_over(step, P.sets)
    finally:
        set_constants(*RULE)
    graphs["no_pass"] = captured_without_pass(step, P.sets)
    report(f"{p['model']} {tokens} fwd+bwd exact", graphs, len(P.sets), 14)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for model in ("Qwen3-8B-TP8", "Qwen3-8B", "OLMo-2"):
        time_point(next(p for p in POINTS if p["model"] == model), 16384)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
