"""The QK-norm kernels alone, one source tree per process, TE's table: each tensor's norm
backward alone (q_bwd, k_bwd), q and k in one call (qk_bwd; forward qk_fwd, q alone q_fwd) and
the fused QKV's backward (qkv_bwd), at rope_qknorm_rules' points (16K tokens, bf16) and three
more (Qwen3-32B, Qwen3-8B under TP 4 and TP 2), in copies of q and k; with each point the
tiles the launcher planned (BLOCK_T x BLOCK_H, warps, FLAT_GRID, BATCH_OF_ONE).

    python artifacts/qknorm/norm_backward_load_order_ab.py TREE OUT.json   # on a GPU

TREE is a folder holding the repository's top-level sources. Run it alternately for the trees
(A B A B) on one machine. Used for the barrier in `_rope_tile` that keeps a one-token tile's
loads ahead of the table's in the norm backward's token loop.
"""
import json
import os
import sys

tree = os.path.abspath(sys.argv[1])
sys.path.insert(0, tree)
os.chdir(tree)
import torch  # noqa: E402

import rope_qknorm_rules as Q  # noqa: E402
import triton_rotary_launch as L  # noqa: E402

assert os.path.dirname(L.__file__) == tree, L.__file__
POINTS = Q.POINTS + [dict(model="Qwen3-32B", hq=64, hk=8, d=128, offset=0.0, over="head"),
                     dict(model="Qwen3-8B-TP4", hq=8, hk=2, d=128, offset=0.0, over="head"),
                     dict(model="Qwen3-8B-TP2", hq=16, hk=4, d=128, offset=0.0, over="head")]


def steps(P):
    """rope_qknorm_rules' lines of q and k in one call (and the copy, the fused QKV), under this
    script's names, with each tensor's own calls beside them."""
    shared = Q.lines(P)
    f, kw, rope = P.freqs, dict(tensor_format="bshd"), L.set_rotary_kernel
    lines = {
        "copy": shared["copy"],
        "q_bwd": lambda S: rope(S.gq, f, backward=True, norm=P.nq, norm_input=S.q, **kw),
        "k_bwd": lambda S: rope(S.gk, f, backward=True, norm=P.nk, norm_input=S.k, **kw),
        "qk_bwd": shared["qk_norm_bwd"],
        "q_fwd": lambda S: rope(S.q, f, norm=P.nq, **kw),
        "qk_fwd": shared["qk_norm_fwd"],
    }
    if P.split:
        lines["qkv_bwd"] = shared["qkv_norm_bwd"]
    return lines


def tiles():
    """The tiles of the plans made so far, as text."""
    found = set()
    for plan in L._PLANS.values():
        cfg = getattr(getattr(plan, "launch", None), "cfg", None)
        if hasattr(cfg, "BLOCK_T"):
            found.add(f"{cfg.BLOCK_T}x{cfg.BLOCK_H} w{plan.launch.num_warps} "
                      f"flat{cfg.FLAT_GRID} b1{cfg.BATCH_OF_ONE}")
    return sorted(found)


rows = []
for p in POINTS:
    torch.manual_seed(0)
    P = Q.build(p)
    L._PLANS.clear()
    graphs = {name: Q.graphed_over(step, P.sets) for name, step in steps(P).items()}
    us = Q.time_graphs(graphs, len(P.sets))
    copy = us["copy"]
    rows += [dict(model=p["model"], line=n, us=t, copies=t / copy) for n, t in us.items()]
    print(p["model"], " ".join(f"{n} {t / copy:.3f}" for n, t in us.items() if n != "copy"),
          tiles(), flush=True)
    for graph in graphs.values():
        graph.reset()
    del graphs, P
    torch.cuda.empty_cache()
with open(sys.argv[2], "w") as f:
    json.dump(rows, f)
