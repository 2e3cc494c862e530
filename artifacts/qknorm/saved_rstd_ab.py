"""The QK-norm backward reading each row's rstd saved by its forward (`RMSNorm.rstd`,
`Variant.SAVED_RSTD`) against working it out again (`SAVED_RSTD_OVER` in
triton_rotary_launch.py); bf16, in one process.

    python artifacts/qknorm/saved_rstd_ab.py OUT      # on a GPU, from the repository root

1. Kernels alone (the launcher's calls, as rope_qknorm_rules.py times them), at the points of
   rope_qknorm_rules.py (16K tokens) and TP 8 at 64K: the norm's forward and backward of q
   and of k as two calls and as one call for both, exact angles and TE's table, with the
   rows' rstd worked out again in the backward (`recomputed`) or saved by the forward and read
   by the backward (`saved`), for norms over the head and over the token alike. Forward and
   backward are timed apart and added.
2. Through autograd (rope_qknorm_bench.py's `ours` and `ours_table` lines, forward +
   backward, and forward alone), at its points: `before` (the entry points saving no rstd)
   against `now` (saving it where `saves_rstd` says).
Each line is one CUDA graph over rotating buffer sets larger than L2, lines interleaved over
the rounds, median; in copies of q and k. Saved results are compared with recomputed ones
first (outputs and gradients). Writes OUT/saved_rstd_ab.log and .json.
"""
import contextlib
import os
import sys

sys.path.insert(0, os.getcwd())
import torch

import rope_qknorm_bench as QB
import rope_qknorm_rules as QR
import triton_rotary_launch as L
import triton_rotary_main as M
from rope_bench_report import ScriptLog, device_header, flat_outputs

VARIANTS = {"recomputed": False, "saved": True}    # name -> whether the forward saves rstd
POINTS = QR.POINTS + [dict(QR.POINTS[1], model="Qwen3-8B-TP8-64K", tokens=65536)]


def with_rstd(norm, x):
    return norm._replace(rstd=L.norm_rstd(x, norm))


def kernel_lines(P, saved):
    """name -> step(S), the launcher's calls; with `saved`, forwards write rstd buffers of the
    set and backwards read them."""
    kw = dict(tensor_format="bshd")
    rope, qk = L.set_rotary_kernel, L.set_rotary_qk_kernel

    def norms(S):
        if not saved:
            return P.nq, P.nk
        if not hasattr(S, "nq"):
            S.nq, S.nk = with_rstd(P.nq, S.q), with_rstd(P.nk, S.k)
        return S.nq, S.nk

    out = {}
    for tag, src in (("exact", P.module), ("table", P.freqs)):
        out[f"fwd_{tag}"] = lambda S, src=src: (rope(S.q, src, norm=norms(S)[0], **kw),
                                                rope(S.k, src, norm=norms(S)[1], **kw))
        out[f"bwd_{tag}"] = lambda S, src=src: (
            *rope(S.gq, src, backward=True, norm=norms(S)[0], norm_input=S.q, **kw),
            *rope(S.gk, src, backward=True, norm=norms(S)[1], norm_input=S.k, **kw))
        out[f"qk_fwd_{tag}"] = lambda S, src=src: qk(S.q, S.k, src, q_norm=norms(S)[0],
                                                     k_norm=norms(S)[1], **kw)
        out[f"qk_bwd_{tag}"] = lambda S, src=src: qk(S.gq, S.gk, src, backward=True,
                                                     q_norm=norms(S)[0], k_norm=norms(S)[1],
                                                     q_input=S.q, k_input=S.k, **kw)
    return out


@contextlib.contextmanager
def entry_points_saving(saved):
    """The entry points' forwards with (as now) or without (as before) an rstd buffer."""
    keep = M.norm_rstd
    if not saved:
        M.norm_rstd = lambda t, norm: None
    try:
        yield
    finally:
        M.norm_rstd = keep


def kernels_alone(say, rows):
    for p in POINTS:
        P = QR.build(p, tokens=p.get("tokens", QR.TOKENS))
        graphs = {("copy", "-"): QR.graphed_over(lambda S: (S.qd.copy_(S.q), S.kd.copy_(S.k)),
                                                  P.sets)}
        first = {}
        for variant, saved in VARIANTS.items():
            L._PLANS.clear()
            lines = kernel_lines(P, saved)
            for name, step in lines.items():
                if "bwd" in name:
                    # Every set's forward first: a backward reads the rstd it saved (a graph's
                    # capture runs nothing).
                    for S in P.sets:
                        lines[name.replace("bwd", "fwd")](S)
                result = flat_outputs(step(P.sets[0]))
                if not saved:
                    first[name] = result
                else:
                    rel = ((result - first[name]).abs().max() / first[name].abs().max()).item()
                    say(f"  {p['model']} {name}: saved against recomputed, max difference "
                        f"{rel:.1e} of the largest value")
                graphs[(name, variant)] = QR.graphed_over(step, P.sets)
        us = QR.time_graphs(graphs, len(P.sets))
        copy = us[("copy", "-")]
        say(f"\n{p['model']} ({p.get('tokens', QR.TOKENS)} tokens): q {p['hq']} + k {p['hk']} heads, "
            f"d {p['d']}, norm over {p['over']}; copy of q and k {copy:.1f} us; kernels alone, copies")
        for prefix in ("", "qk_"):
            for tag in ("exact", "table"):
                fwd, bwd = f"{prefix}fwd_{tag}", f"{prefix}bwd_{tag}"
                cells = []
                for variant in VARIANTS:
                    f, b = us[(fwd, variant)] / copy, us[(bwd, variant)] / copy
                    cells.append(f"{variant} {f:.3f} + {b:.3f} = {f + b:.3f}")
                    rows.append(dict(part="kernels", model=p["model"], line=f"{prefix}{tag}",
                                     variant=variant, fwd=f, bwd=b))
                say(f"  {prefix + tag:11s} " + " | ".join(cells))
        for g in graphs.values():
            g.reset()
        del graphs, P
        torch.cuda.empty_cache()


def through_autograd(say, rows):
    for cfg in QB.MODELS:
        for s in cfg["tokens"]:
            P = QB.build_point(cfg, s, "cuda")
            for mode in ("fwd", "fwdbwd"):
                runners, graphs = {}, []
                copy_step = QB.make_step(None, mode)
                g = QB.graphed(lambda sets=P.sets: [copy_step(S) for S in sets])
                graphs.append(g)
                runners["copy"] = g
                for variant in ("before", "now"):
                    L._PLANS.clear()
                    with entry_points_saving(variant == "now"):
                        lines = QB.make_lines(P, mode)
                        for name in ("ours", "ours_table"):
                            step = QB.make_step(lines[name], mode)
                            g = QB.graphed(lambda step=step, sets=P.sets: [step(S) for S in sets])
                            graphs.append(g)
                            runners[f"{name} {variant}"] = g
                times = {k: [] for k in runners}
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                for _ in range(QB.ROUNDS):
                    for k, g in runners.items():
                        e0.record()
                        for _ in range(QB.REPLAYS):
                            g.replay()
                        e1.record()
                        e1.synchronize()
                        times[k].append(e0.elapsed_time(e1) * 1e3 / (QB.REPLAYS * len(P.sets)))
                med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
                unit = med["copy"]
                say(f"{cfg['model']} s={s} {mode}: " + "  ".join(
                    f"{k} {v / unit:.3f}" for k, v in med.items() if k != "copy")
                    + f"  (copy {unit:.1f} us)")
                for k, v in med.items():
                    rows.append(dict(part="autograd", model=cfg["model"], tokens=s, mode=mode,
                                     line=k, copies=v / unit))
                for g in graphs:
                    g.reset()
            del P
            torch.cuda.empty_cache()


def main():
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        sys.exit("usage: python artifacts/qknorm/saved_rstd_ab.py OUT  (on a CUDA device)")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    log = ScriptLog()
    log.say(f"{device_header()}; bf16")
    kernels_alone(log.say, log.rows)
    log.say("\nThrough autograd (rope_qknorm_bench.py's lines), copies of q and k:")
    through_autograd(log.say, log.rows)
    log.write(out_dir, "saved_rstd_ab")


if __name__ == "__main__":
    main()
