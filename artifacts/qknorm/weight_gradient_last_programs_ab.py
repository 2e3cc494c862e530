"""The norms' weight gradient added up by the backward's last programs instead of a second
pass: A/B against main (weight_gradient_last_programs.patch holds the change as measured).

In the patched kernels each backward program, after writing its row of partial sums, counts
itself in its group of rows (an atomic add); the last of a group adds up the group's rows in
row order into a row of its own, then counts the group; the last group adds the groups' rows
in group order into dL/dweight (fixed orders: deterministic). The counters here are zeroed
once and reset by the last arrivals, which is enough to time it (a kept version would need
counters no two launches in flight share). Run each tree in its own process, interleaved:

    mkdir -p /tmp/last && cp triton_rotary_*.py /tmp/last/
    (cd /tmp/last && patch -p1 < $PWD/artifacts/qknorm/weight_gradient_last_programs.patch)
    python artifacts/qknorm/weight_gradient_last_programs_ab.py . main
    python artifacts/qknorm/weight_gradient_last_programs_ab.py /tmp/last last

Per point (rope_qknorm_rules.py's, bf16, 16K tokens, TP 8 also at 64K): dq/dk/dw the same
over repeated calls, dL/dweight's error against float64 (fused=False), then kernels alone in
copies of q and k (one CUDA graph per line over rotating sets larger than L2, lines
interleaved, median): forward, backward, both, with exact angles and with TE's table, and t
alone (`set_rotary_kernel` of q).
"""
import os
import sys

sys.path.insert(0, os.path.abspath(sys.argv[1]))
sys.path.insert(1, os.getcwd())
import torch
import triton

import triton_rotary_launch as L
import triton_rotary_main as M
from rope_qknorm_rules import POINTS, build, lines, time_graphs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from weight_gradient_pass_cost import captured  # noqa: E402

label = sys.argv[2]
print(label, L.__file__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
      torch.__version__, triton.__version__, flush=True)


def check(P, p):
    """dq/dk/dw determinism over 10 calls, and dw's error against float64 (unfused)."""
    S = P.sets[0]
    kw = dict(tensor_format="bshd")
    outs = [L.set_rotary_qk_kernel(S.gq, S.gk, P.module, backward=True, q_norm=P.nq,
                                   k_norm=P.nk, q_input=S.q, k_input=S.k, **kw)
            for _ in range(10)]
    same = all(all(torch.equal(a, b) for a, b in zip(outs[0], o)) for o in outs[1:])
    q64, k64 = (x.detach().double().requires_grad_(True) for x in (S.q, S.k))
    wq64, wk64 = (n.weight.detach().double().requires_grad_(True) for n in (P.nq, P.nk))
    oq, ok = M.apply_rotary_pos_emb_qk(q64, k64, P.module, "bshd", q_norm_weight=wq64,
                                       k_norm_weight=wk64, norm_eps=P.nq.eps,
                                       norm_offset=P.nq.offset, norm_over=P.nq.over, fused=False)
    ref = torch.autograd.grad((oq, ok), (wq64, wk64), (S.gq.double(), S.gk.double()))
    errs = [((a.double() - b).abs().max() / b.abs().max()).item()
            for a, b in zip(outs[0][2:], ref)]
    # t alone (rotary_kernel)
    t_outs = [L.set_rotary_kernel(S.gq, P.module, backward=True, norm=P.nq, norm_input=S.q, **kw)
              for _ in range(5)]
    t_same = all(torch.equal(t_outs[0][1], o[1]) for o in t_outs[1:])
    t_err = ((t_outs[0][1].double() - ref[0]).abs().max() / ref[0].abs().max()).item()
    print(f"  check {p['model']}: deterministic {same} {t_same}; dw rel err q {errs[0]:.2e} "
          f"k {errs[1]:.2e} t {t_err:.2e}", flush=True)


def time_point(p, tokens):
    torch.manual_seed(0)
    P = build(p, tokens=tokens)
    if tokens == 16384:
        check(P, p)
    st = lines(P)
    copy = st["copy"]
    steps = {"copy": copy,
             "fwd": st["qk_norm_fwd_exact"], "bwd": st["qk_norm_bwd_exact"],
             "fwd_bwd": lambda S: (*st["qk_norm_fwd_exact"](S), *st["qk_norm_bwd_exact"](S)),
             "bwd_table": st["qk_norm_bwd"],
             "fwd_bwd_table": lambda S: (*st["qk_norm_fwd"](S), *st["qk_norm_bwd"](S)),
             "t_bwd_exact": st["norm_bwd_exact"]}
    graphs = {name: captured(step, P.sets) for name, step in steps.items()}
    med = time_graphs(graphs, len(P.sets))
    c = med["copy"]
    print(f"{label} {p['model']} {tokens}: copy {c:.2f} us  " + "  ".join(
        f"{k} {v / c:.3f}" for k, v in med.items() if k != "copy"), flush=True)
    for g in graphs.values():
        g.reset()
    L._PLANS.clear()
    del P
    torch.cuda.empty_cache()


if __name__ == "__main__":
    for p in POINTS:
        time_point(p, 16384)
    time_point(next(p for p in POINTS if p["model"] == "Qwen3-8B-TP8"), 65536)
