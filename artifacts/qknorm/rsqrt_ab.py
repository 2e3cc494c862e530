"""The norm's rstd from the hardware's reciprocal square root (`_rstd` in
triton_rotary_kernel.py) against a correctly rounded sqrt and two divisions, and the pipelined
norm backward's register cap (NORM_BACKWARD_MAX_REGISTERS in triton_rotary_launch.py); bf16.

The code under test is the checkout the script runs from, so one run per checkout, all on one
machine, alternating, each timing the copy of q and k too (fractions compare across runs):

    git worktree add /tmp/base <commit before the change>
    (cd /tmp/base && python $REPO/artifacts/qknorm/rsqrt_ab.py OUT base)
    python artifacts/qknorm/rsqrt_ab.py OUT rsqrt
    python artifacts/qknorm/rsqrt_ab.py OUT rsqrt_uncapped --uncapped   # the cap at 0
    python artifacts/qknorm/rsqrt_ab.py --compare OUT                  # the table

Kernels alone (the launcher's calls), at rope_qknorm_rules.py's points (16K tokens) and TP 8 at
64K: q and k in one call forward and backward, exact angles and TE's table, and the fused QKV
(exact angles); a norm over the token saves rstd as the entry points do (`saves_rstd`). Each
line is one CUDA graph over rotating buffer sets larger than L2, lines interleaved over the
rounds, median, in copies of q and k. Each run writes OUT/rsqrt_ab_NAME.json and the first
set's outputs (OUT/rsqrt_ab_NAME.pt), which --compare checks against the first run's.
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch

POINTS_TP8_64K = dict(model="Qwen3-8B-TP8-64K", hq=4, hk=1, d=128, offset=0.0, over="head",
                      tokens=65536)


def lines(L, P):
    """name -> step(S), the launcher's calls."""
    kw = dict(tensor_format="bshd")
    qk = L.set_rotary_qk_kernel

    def norms(S):
        if not hasattr(S, "nq"):
            S.nq, S.nk = ((n._replace(rstd=L.norm_rstd(x, n)) if L.saves_rstd(n) else n)
                          for n, x in ((P.nq, S.q), (P.nk, S.k)))
        return S.nq, S.nk

    out = {}
    for tag, src in (("exact", P.module), ("table", P.freqs)):
        out[f"fwd_{tag}"] = lambda S, src=src: qk(S.q, S.k, src, q_norm=norms(S)[0],
                                                  k_norm=norms(S)[1], **kw)
        out[f"bwd_{tag}"] = lambda S, src=src: qk(S.gq, S.gk, src, backward=True,
                                                  q_norm=norms(S)[0], k_norm=norms(S)[1],
                                                  q_input=S.q, k_input=S.k, **kw)
    if P.split:
        qkv = L.set_rotary_qkv_kernel
        out["qkv_fwd_exact"] = lambda S: qkv(S.qkv, P.module, P.module, P.split, "bshd",
                                             q_norm=P.nq, k_norm=P.nk)
        out["qkv_bwd_exact"] = lambda S: qkv(S.qkv, P.module, P.module, P.split, "bshd",
                                             grads=S.grads, q_norm=P.nq, k_norm=P.nk)
    return out


def run(out_dir, name, uncapped):
    import rope_qknorm_rules as QR
    import triton_rotary_launch as L
    from rope_bench_report import device_header, flat_outputs
    torch.manual_seed(0)
    rule = L.GPU_RULE._replace(norm_backward_max_registers=0) if uncapped else L.GPU_RULE
    result = dict(name=name, device=device_header(), rows=[])
    outputs = {}
    with L.use_launch_rule(rule):
        for p in QR.POINTS + [POINTS_TP8_64K]:
            P = QR.build(p, tokens=p.get("tokens", QR.TOKENS))
            steps = lines(L, P)
            graphs = {"copy": QR.graphed_over(lambda S: (S.qd.copy_(S.q), S.kd.copy_(S.k)),
                                              P.sets)}
            for line, step in steps.items():
                if "bwd" in line and line.replace("bwd", "fwd") in steps:
                    for S in P.sets:        # the forward first: a backward reads its rstd
                        steps[line.replace("bwd", "fwd")](S)
                outputs[f"{p['model']} {line}"] = flat_outputs(step(P.sets[0])).cpu()
                graphs[line] = QR.graphed_over(step, P.sets)
            us = QR.time_graphs(graphs, len(P.sets))
            for line, t in us.items():
                result["rows"].append(dict(model=p["model"], line=line, us=t,
                                           copies=t / us["copy"]))
            print(p["model"], {k: round(v / us["copy"], 3) for k, v in us.items()}, flush=True)
            for g in graphs.values():
                g.reset()
            del graphs, P
            torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rsqrt_ab_{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    torch.save(outputs, os.path.join(out_dir, f"rsqrt_ab_{name}.pt"))


def compare(out_dir):
    runs = sorted((json.load(open(os.path.join(out_dir, f))) for f in os.listdir(out_dir)
                   if f.startswith("rsqrt_ab_") and f.endswith(".json")),
                  key=lambda r: os.path.getmtime(os.path.join(out_dir, f"rsqrt_ab_{r['name']}.json")))
    first = runs[0]
    print(first["device"])
    ref = torch.load(os.path.join(out_dir, f"rsqrt_ab_{first['name']}.pt"))
    for r in runs[1:]:
        outs = torch.load(os.path.join(out_dir, f"rsqrt_ab_{r['name']}.pt"))
        worst = max(((outs[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
        print(f"  {r['name']}: outputs within {worst:.1e} of {first['name']}'s (of the largest value)")
    names = [r["name"] for r in runs]
    table = {}
    for r in runs:
        for row in r["rows"]:
            table.setdefault((row["model"], row["line"]), {})[r["name"]] = row["copies"]
    print(f"{'point':18s} {'line':14s} " + " ".join(f"{n:>15s}" for n in names))
    for (model, line), cells in table.items():
        if line != "copy":
            print(f"{model:18s} {line:14s} " + " ".join(f"{cells.get(n, float('nan')):15.3f}"
                                                       for n in names))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--compare":
        compare(sys.argv[2])
    elif len(sys.argv) >= 3 and torch.cuda.is_available():
        run(sys.argv[1], sys.argv[2], "--uncapped" in sys.argv[3:])
    else:
        sys.exit(__doc__)
