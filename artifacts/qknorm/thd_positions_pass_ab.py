"""A/B: the forward of q and k with norms on packed thd (cu_seqlens), its tiles searching
cu_seqlens for their tokens' sequences (the rule without qk_norm_positions_pass) or reading
the positions a pre-pass worked out once per token for both tensors (sequence_positions_kernel,
as the backward does: the rule's qk_norm_positions_pass). Qwen3-8B's attention inputs (32
query heads, 8 key heads, d 128, bf16, 16K tokens in sequences of lognormal lengths:
rope_qknorm_bench.py's packed point); exact angles and TE's table; q and k in one call, and one
call each. Kernels alone, each line one CUDA graph over rotating buffer sets larger than L2,
interleaved round-robin, median, in copies of q and k (rope_qknorm_rules.py's timing). Results
are compared bit for bit.

The `each_*` lines (q's and k's own calls) keep the search under either rule; in the
committed logs (thd_positions_pass_ab_h100.log, _h200.log) they took a pass of their own,
which is why the rule leaves them out.

    python artifacts/qknorm/thd_positions_pass_ab.py OUT     # on a GPU, from the repository root
"""
import math
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())
import torch

import triton_rotary_launch as L
from rope_bench_report import device_header
from rope_qknorm_bench import packed_cu_seqlens
from rope_qknorm_rules import graphed_over, graphed_under_rules, time_graphs
from triton_rotary_main import RotaryPositionEmbedding

TOKENS, HQ, HK, D, EPS = 16384, 32, 8, 128, 1e-6
RULES = {"search": L.GPU_RULE._replace(qk_norm_positions_pass=False),
         "pre_pass": L.GPU_RULE._replace(qk_norm_positions_pass=True)}


def main():
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage: python artifacts/qknorm/thd_positions_pass_ab.py OUT  (on a CUDA device)")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    cu = packed_cu_seqlens(TOKENS, dev)
    module = RotaryPositionEmbedding(D, rotary_base=1e6, device=dev)
    table = module(TOKENS)
    nq, nk = (L.RMSNorm((1.0 + 0.1 * torch.randn(D, device=dev)).to(bf16), EPS, 0.0, "head")
              for _ in range(2))
    sets = []
    for _ in range(max(4, math.ceil((256 << 20) / (2 * TOKENS * (HQ + HK) * D)))):
        S = SimpleNamespace(q=torch.randn(TOKENS, HQ, D, device=dev, dtype=bf16),
                            k=torch.randn(TOKENS, HK, D, device=dev, dtype=bf16))
        S.qd, S.kd = torch.empty_like(S.q), torch.empty_like(S.k)
        sets.append(S)
    kw = dict(tensor_format="thd", cu_seqlens=cu)
    rope, qk = L.set_rotary_kernel, L.set_rotary_qk_kernel
    steps = {
        "copy": lambda S: (S.qd.copy_(S.q), S.kd.copy_(S.k)),
        "qk_exact": lambda S: qk(S.q, S.k, module, q_norm=nq, k_norm=nk, **kw),
        "qk_table": lambda S: qk(S.q, S.k, table, q_norm=nq, k_norm=nk, **kw),
        "each_exact": lambda S: (rope(S.q, module, norm=nq, **kw), rope(S.k, module, norm=nk, **kw)),
        "each_table": lambda S: (rope(S.q, table, norm=nq, **kw), rope(S.k, table, norm=nk, **kw)),
    }
    log = [f"{device_header()}; Qwen3-8B packed thd, {TOKENS} tokens in {cu.numel() - 1} "
           f"sequences, bf16; kernels alone, in copies of q and k"]
    graphs = {("copy", "-"): graphed_over(steps["copy"], sets)}
    for name, step in steps.items():
        if name == "copy":
            continue
        by_rule, results = graphed_under_rules(step, RULES, sets)
        graphs.update({(name, rule_name): g for rule_name, g in by_rule.items()})
        first_rule, *others = RULES
        for rule_name in others:
            log.append(f"  {name} {rule_name}: bit-identical to {first_rule}: "
                       f"{torch.equal(results[rule_name], results[first_rule])}")
    us = time_graphs(graphs, len(sets))
    copy_us = us[("copy", "-")]
    log.append(f"copy of q and k {copy_us:.1f} us")
    for (name, rule_name), t in sorted(us.items()):
        log.append(f"  {name:11s} {rule_name:9s} {t / copy_us:6.3f} copies {t:8.1f} us")
    print("\n".join(log))
    with open(os.path.join(out_dir, "thd_positions_pass_ab.log"), "w") as f:
        f.write("\n".join(log) + "\n")


if __name__ == "__main__":
    main()
