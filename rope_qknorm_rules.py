#!/usr/bin/env python3
"""QK-norm kernels alone under launch-rule variants: the evidence for the norm's constants in
triton_rotary_launch.py (NORM_WARPS and the ones after it).

    python rope_qknorm_rules.py OUT [LINE ...]   # on a GPU, from the repository root

(LINEs: time only these of `lines`' names, and the copy.)

For the attention inputs of rope_qknorm_bench.py at 16K tokens (bf16), times the launcher's
calls for q and k (fused QKV: one call) with and without the norm, forward and backward (with
TE's table; the `_exact` lines with the module's exact angles, the path the backward's
pipelining serves; the `qk_` lines as one call for q and k), under each rule in RULES,
in units of one device copy of q and k. Each line is one CUDA graph over rotating buffer sets
larger than L2, replayed REPLAYS times per round, lines interleaved round-robin over ROUNDS
rounds, median reported. Before timing, each variant's result is compared with the first
rule's (the same up to the order of the sums of dL/dweight). Writes OUT/rules.log and OUT/rules.json.
"""
import math
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())

import torch

import triton_rotary_launch as L
from rope_bench import graphed, replay_ms
from rope_bench_report import ScriptLog, device_header, flat_outputs
from triton_rotary_main import RotaryPositionEmbedding

BF16, EPS, TOKENS = torch.bfloat16, 1e-6, 16384
ROUNDS, REPLAYS = 7, 10
POINTS = [  # q heads, kv heads, head dim, norm offset, norm over
    dict(model="Qwen3-8B", hq=32, hk=8, d=128, offset=0.0, over="head"),
    dict(model="Qwen3-8B-TP8", hq=4, hk=1, d=128, offset=0.0, over="head"),
    dict(model="Gemma-3", hq=16, hk=8, d=256, offset=1.0, over="head"),
    dict(model="OLMo-2", hq=32, hk=32, d=128, offset=0.0, over="token"),
]
G = L.GPU_RULE
RULES = {
    "rule": G,
    "fwd_4_warps": G._replace(norm_warps=4),
    "fwd_one_head_2_warps": G._replace(norm_one_head_warps=2),
    "bwd_8_rows": G._replace(norm_backward_rows=8),
    # 8 KiB in 8 warps at d 128 (bf16), two programs per SM: the rule before rows and warps
    # followed the head dim
    "bwd_32_rows": G._replace(norm_backward_rows=32),
    "bwd_table_4_rows": G._replace(norm_table_backward_rows=4),
    "bwd_table_16_rows": G._replace(norm_table_backward_rows=16),
    "bwd_8_elements": G._replace(norm_backward_thread_elements=8),
    "bwd_32_warps_per_sm": G._replace(norm_backward_warps_per_sm=32),
    "bwd_unpipelined": G._replace(norm_pipeline_stages=0),
    "bwd_2_stages": G._replace(norm_pipeline_stages=2),
    "bwd_4_stages": G._replace(norm_pipeline_stages=4),
    "bwd_5_stages": G._replace(norm_pipeline_stages=5),
    "qkv_bwd_32_elements": G._replace(norm_backward_thread_elements=32),
    "no_overlap": G._replace(qk_norm_overlap=False),
}
ROPE_RULES = ("rule", "fwd_4_warps", "fwd_one_head_2_warps", "bwd_table_4_rows",
              "bwd_table_16_rows", "bwd_8_elements", "bwd_32_warps_per_sm")
EXACT_RULES = ("rule", "bwd_unpipelined", "bwd_2_stages", "bwd_4_stages", "bwd_5_stages",
               "bwd_8_rows", "bwd_32_rows", "bwd_32_warps_per_sm")
FORWARD_EXACT_RULES = ("rule", "fwd_4_warps", "fwd_one_head_2_warps")
QKV_RULES = ("rule", "fwd_4_warps", "qkv_bwd_32_elements")
QKV_EXACT_RULES = ("rule", "bwd_unpipelined")
# q and k with norms in one call (set_rotary_qk_kernel): the key's launch started early or not.
QK_RULES = ("rule", "no_overlap")


def build(p, dev="cuda", tokens=TOKENS):
    """Tables, norms and rotating buffer sets (> 256 MB of q and k in all) for one point."""
    s, hq, hk, d = tokens, p["hq"], p["hk"], p["d"]
    width = (lambda h: d) if p["over"] == "head" else (lambda h: h * d)
    module = RotaryPositionEmbedding(d, rotary_base=1e6, device=dev)
    P = SimpleNamespace(freqs=module(s), module=module)
    P.nq, P.nk = (L.RMSNorm((1.0 + 0.1 * torch.randn(width(h), device=dev)).to(BF16), EPS,
                            p["offset"], p["over"]) for h in (hq, hk))
    P.split = [hq // hk * d, d, d] if p["over"] == "head" else None
    P.sets = []
    for _ in range(max(4, math.ceil((256 << 20) / (2 * s * (hq + hk) * d)))):
        S = SimpleNamespace(q=torch.randn(1, s, hq, d, device=dev, dtype=BF16),
                            k=torch.randn(1, s, hk, d, device=dev, dtype=BF16))
        S.gq, S.gk = torch.randn_like(S.q), torch.randn_like(S.k)
        S.qd, S.kd = torch.empty_like(S.q), torch.empty_like(S.k)
        if P.split:
            S.qkv = torch.cat([S.q.reshape(1, s, hk, -1), S.k, torch.randn_like(S.k)], -1)
            S.grads = (S.gq, S.gk, torch.randn_like(S.k))
        P.sets.append(S)
    return P


def lines(P):
    """name -> step(S); each returns the call's outputs."""
    f, kw = P.freqs, dict(tensor_format="bshd")
    rope = L.set_rotary_kernel
    out = {
        "copy": lambda S: (S.qd.copy_(S.q), S.kd.copy_(S.k)),
        "rope_fwd": lambda S: (rope(S.q, f, **kw), rope(S.k, f, **kw)),
        "rope_bwd": lambda S: (rope(S.gq, f, backward=True, **kw),
                               rope(S.gk, f, backward=True, **kw)),
        "norm_fwd": lambda S: (rope(S.q, f, norm=P.nq, **kw), rope(S.k, f, norm=P.nk, **kw)),
        "norm_bwd": lambda S: (
            *rope(S.gq, f, backward=True, norm=P.nq, norm_input=S.q, **kw),
            *rope(S.gk, f, backward=True, norm=P.nk, norm_input=S.k, **kw)),
        "norm_fwd_exact": lambda S: (rope(S.q, P.module, norm=P.nq, **kw),
                                     rope(S.k, P.module, norm=P.nk, **kw)),
        "qk_norm_fwd_exact": lambda S: L.set_rotary_qk_kernel(S.q, S.k, P.module, q_norm=P.nq,
                                                              k_norm=P.nk, **kw),
        "norm_bwd_exact": lambda S: (
            *rope(S.gq, P.module, backward=True, norm=P.nq, norm_input=S.q, **kw),
            *rope(S.gk, P.module, backward=True, norm=P.nk, norm_input=S.k, **kw)),
    }
    qk = L.set_rotary_qk_kernel
    out["qk_norm_fwd"] = lambda S: qk(S.q, S.k, f, q_norm=P.nq, k_norm=P.nk, **kw)
    out["qk_norm_bwd"] = lambda S: qk(S.gq, S.gk, f, backward=True, q_norm=P.nq, k_norm=P.nk,
                                      q_input=S.q, k_input=S.k, **kw)
    out["qk_norm_bwd_exact"] = lambda S: qk(S.gq, S.gk, P.module, backward=True, q_norm=P.nq,
                                            k_norm=P.nk, q_input=S.q, k_input=S.k, **kw)
    out["qk_norm_fwd_exact_overlap"] = out["qk_norm_fwd_exact"]     # again, under QK_RULES
    if P.split:
        qkv = L.set_rotary_qkv_kernel
        out["qkv_rope_fwd"] = lambda S: qkv(S.qkv, f, f, P.split, "bshd")
        out["qkv_norm_fwd"] = lambda S: qkv(S.qkv, f, f, P.split, "bshd", q_norm=P.nq, k_norm=P.nk)
        out["qkv_norm_bwd_exact"] = lambda S: qkv(S.qkv, P.module, P.module, P.split, "bshd",
                                                  grads=S.grads, q_norm=P.nq, k_norm=P.nk)
        out["qkv_norm_bwd"] = lambda S: qkv(S.qkv, f, f, P.split, "bshd", grads=S.grads,
                                            q_norm=P.nq, k_norm=P.nk)
    return out


def graphed_over(step, sets):
    """One CUDA graph of the step over every buffer set."""
    return graphed(lambda: [step(S) for S in sets])


def graphed_under_rules(step, rules, sets):
    """`step` captured over `sets` under each rule (name -> LaunchRule), each with plans made
    afresh under it: ({name: graph}, {name: the flat result of step(sets[0]) under it})."""
    graphs, results = {}, {}
    for rule_name, rule in rules.items():
        L._PLANS.clear()
        with L.use_launch_rule(rule):
            results[rule_name] = flat_outputs(step(sets[0]))
            graphs[rule_name] = graphed_over(step, sets)
    return graphs, results


def time_graphs(graphs, nsets, rounds=ROUNDS):
    """Median µs per step of each graph (anything with a `replay()`), interleaved round-robin."""
    timed = replay_ms(graphs, nsets, replays=REPLAYS, rounds=rounds)
    return {k: t[0] * 1e3 for k, t in timed.items()}


def main():
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        sys.exit("usage: python rope_qknorm_rules.py OUT [LINE ...]  (on a CUDA device)")
    out_dir, only = sys.argv[1], set(sys.argv[2:])
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    out = ScriptLog()
    say, rows = out.say, out.rows
    say(f"{device_header()}; {TOKENS} tokens, bf16; time per step / time of a copy of q and k")
    say(f"GPU_RULE {G}")
    for p in POINTS:
        P = build(p)
        steps, graphs = lines(P), {}
        plain = ["copy", "rope_fwd", "rope_bwd"] + (["qkv_rope_fwd"] if P.split else [])
        for name in plain:
            if name == "copy" or not only or name in only:
                graphs[(name, "-")] = graphed_over(steps[name], P.sets)
        for names, rules in ((("norm_fwd", "norm_bwd"), ROPE_RULES),
                             (("norm_bwd_exact",), EXACT_RULES),
                             (("norm_fwd_exact", "qk_norm_fwd_exact"), FORWARD_EXACT_RULES),
                             (("qkv_norm_fwd", "qkv_norm_bwd") if P.split else (), QKV_RULES),
                             (("qkv_norm_bwd_exact",) if P.split else (), QKV_EXACT_RULES),
                             (("qk_norm_fwd", "qk_norm_bwd", "qk_norm_bwd_exact",
                               "qk_norm_fwd_exact_overlap"), QK_RULES)):
            for name in names:
                if only and name not in only:
                    continue
                by_rule, results = graphed_under_rules(steps[name],
                                                       {r: RULES[r] for r in rules}, P.sets)
                graphs.update({(name, rule_name): g for rule_name, g in by_rule.items()})
                first = results[rules[0]]
                for rule_name in rules[1:]:
                    rel = ((results[rule_name] - first).abs().max() / first.abs().max()).item()
                    say(f"  {p['model']} {name} {rule_name}: max difference from 'rule' "
                        f"{rel:.1e} of the largest value")
        us = time_graphs(graphs, len(P.sets))
        copy_us = us[("copy", "-")]
        say(f"\n{p['model']}: q {p['hq']} heads + k {p['hk']} heads, d {p['d']}, norm over "
            f"{p['over']}; copy of q and k {copy_us:.1f} us")
        for (name, rule_name), t in sorted(us.items(), key=lambda kv: (kv[0][0], kv[1])):
            say(f"  {name:13s} {rule_name:17s} {t / copy_us:6.3f} copies {t:8.1f} us")
            rows.append(dict(device=torch.cuda.get_device_name(), model=p["model"], line=name,
                             rule=rule_name, us=t, copies=t / copy_us))
        for graph in graphs.values():
            graph.reset()
        del graphs, P
        torch.cuda.empty_cache()
    out.write(out_dir, "rules")


if __name__ == "__main__":
    main()
