#!/usr/bin/env python3
"""QK-norm + RoPE benchmark: the repo's fused Triton call against transformers eager,
torch.compile, Liger and axolotl's fused kernel, for q and k together, in units of one device
copy of q and k.

    python rope_qknorm_bench.py OUT            # on a GPU, from the repository root
    TRITON_INTERPRET=1 python rope_qknorm_bench.py OUT --dry-run    # CPU, tiny, one call per line

Timing: each line's step over every rotating buffer set (> L2 in total) is captured into one
CUDA graph and replayed REPLAYS times; lines are interleaved round-robin in each of ROUNDS
rounds; the median per-step time is reported. A line whose capture fails is timed eagerly
("graph": false). Writes OUT/qknorm.json (rows), OUT/qknorm.log (table, also printed) and
OUT/qknorm.png.

Peers are optional, as in the main benchmark (docs/benchmarks.md): Liger from its wheel, and
axolotl's `src/axolotl/kernels/gemma4_fused_rope.py` (which imports Liger) as
`.peers/axolotl/kernels/gemma4_fused_rope.py` with empty `__init__.py` files, on PYTHONPATH.
"""
import functools
import gc
import json
import math
import os
import sys
import time
from types import SimpleNamespace

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.getcwd())

import torch
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3
from transformers.models.olmo2 import modeling_olmo2 as hf_olmo2
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

import triton_rotary_main as trm
from rope_bench import EagerSteps, graphed, replay_ms

try:
    import liger_kernel  # noqa: F401
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    LIGER_NOTE = None
except Exception as e:                      # not installed, or broken: the line is skipped
    LIGER_NOTE = f"liger skipped: {type(e).__name__}: {e}"
try:
    from axolotl.kernels.gemma4_fused_rope import fused_rms_norm_rope as axolotl_norm_rope
    AXOLOTL_NOTE = None
except Exception as e:                      # not on PYTHONPATH (see above): the line is skipped
    AXOLOTL_NOTE = f"axolotl skipped: {type(e).__name__}: {e}"

BF16, EPS = torch.bfloat16, 1e-6
ROUNDS, REPLAYS = 7, 10
MIN_SETS, MIN_ROT_BYTES = 4, 256 << 20      # rotating q+k buffers: >= 4 sets and > 200 MB
BUDGET_S = 420                              # skip the remaining points past this
QWEN3 = dict(offset=0.0, over="head", base=1e6, hf=hf_qwen3, norm=hf_qwen3.Qwen3RMSNorm,
             liger_cast="llama")
MODELS = [  # q heads, kv heads, head dim, norm offset, norm over, transformers module
    dict(QWEN3, model="Qwen3-8B", hq=32, hk=8, d=128, tokens=(8192, 16384, 32768)),
    # One rank of 8 under tensor parallelism: 4 query heads and 1 key head.
    dict(QWEN3, model="Qwen3-8B-TP8", hq=4, hk=1, d=128, tokens=(16384, 65536)),
    dict(QWEN3, model="Qwen3-32B", hq=64, hk=8, d=128, tokens=(16384,)),
    # Sequences of lognormal lengths packed into one batch row (thd with cu_seqlens for ours;
    # positions restarting per sequence for the others, as transformers packs them).
    dict(QWEN3, model="Qwen3-8B-packed", hq=32, hk=8, d=128, tokens=(16384,), packed=True),
    dict(model="Gemma-3-12B", hq=16, hk=8, d=256, offset=1.0, over="head", base=1e6, hf=hf_gemma3,
         norm=hf_gemma3.Gemma3RMSNorm, liger_cast="gemma", tokens=(16384,)),
    dict(model="OLMo-2-7B", hq=32, hk=32, d=128, offset=0.0, over="token", base=5e5, hf=hf_olmo2,
         norm=hf_olmo2.Olmo2RMSNorm, liger_cast="llama", tokens=(16384,)),
]
if DRY:
    MODELS = [dict(m, hq=4, hk=2, d=32, tokens=(64,)) for m in MODELS]
LINES = ["copy", "ours", "ours_table", "ours_qkv", "eager_norm_ours_rope", "transformers_eager",
         "torch_compile", "liger", "axolotl"]


def build_point(cfg, s, dev):
    """Weights, tables, transformers/Liger norm modules and the rotating buffer sets."""
    hq, hk, d = cfg["hq"], cfg["hk"], cfg["d"]
    nw = (lambda h: d) if cfg["over"] == "head" else (lambda h: h * d)
    P = SimpleNamespace(cfg=cfg, s=s, cu=None)
    P.pos = torch.arange(s, device=dev)
    if cfg.get("packed"):
        P.cu = packed_cu_seqlens(s, dev)
        starts = torch.repeat_interleave(P.cu[:-1], (P.cu[1:] - P.cu[:-1]).long())
        P.pos = P.pos - starts
    # Our lines take the module: angles from positions, exact, and no table to read (which at
    # few heads per token costs as much traffic as the heads). ours_table takes TE's table.
    P.rope = trm.RotaryPositionEmbedding(d, rotary_base=cfg["base"], device=dev)
    P.freqs = P.rope(s)
    P.ang = P.freqs[P.pos, 0, 0]                                    # [s, d]: float32, as transformers
    P.exact_ang = P.pos[:, None].double() * torch.cat([P.rope.inv_freq.double()] * 2)
    P.cos = P.ang.cos()[None].to(BF16)                              # [1, s, d], as transformers
    P.sin = P.ang.sin()[None].to(BF16)
    centre = 0.0 if cfg["offset"] else 1.0
    P.wq, P.wk = (torch.nn.Parameter((centre + 0.1 * torch.randn(nw(h), device=dev)).to(BF16))
                  for h in (hq, hk))
    P.nq, P.nk = cfg["norm"](nw(hq), EPS), cfg["norm"](nw(hk), EPS)
    P.nq.weight, P.nk.weight = P.wq, P.wk                           # shared with every line
    P.qkv_ok = cfg["over"] == "head" and hq % hk == 0
    P.bytes_qk = 2 * s * (hq + hk) * d
    n = 1 if DRY else max(MIN_SETS, math.ceil(MIN_ROT_BYTES / P.bytes_qk))
    P.sets = []
    for _ in range(n):
        S = SimpleNamespace(q=torch.randn(1, s, hq, d, device=dev, dtype=BF16),
                            k=torch.randn(1, s, hk, d, device=dev, dtype=BF16))
        S.gq, S.gk = torch.randn_like(S.q), torch.randn_like(S.k)
        S.qd, S.kd = torch.empty_like(S.q), torch.empty_like(S.k)
        if P.qkv_ok:        # packed as [q heads of the group | k | v] per kv head
            v = torch.randn_like(S.k)
            S.qkv = torch.cat([S.q.reshape(1, s, hk, -1), S.k, v], -1).requires_grad_()
        S.q.requires_grad_(), S.k.requires_grad_()
        P.sets.append(S)
    return P


def packed_cu_seqlens(total, dev):
    """cu_seqlens (int32) of lognormal sequence lengths (median 1024 tokens, at most an eighth
    of the total) filling `total` tokens."""
    gen, median = torch.Generator().manual_seed(0), min(1024, max(16, total // 8))
    lengths, left = [], total
    while left > 0:
        n = int(torch.empty(1).log_normal_(math.log(median), 0.8, generator=gen).clamp(16, left))
        lengths.append(n)
        left -= n
    return torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)


def make_lines(P, mode):
    """name -> fn(S) returning (outputs, inputs to differentiate, output grads), or a skip note."""
    cfg, hf, wq, wk = P.cfg, P.cfg["hf"], P.wq, P.wk
    kw = dict(tensor_format="bshd", norm_eps=EPS, norm_offset=cfg["offset"], norm_over=cfg["over"])

    def by_shape(norm, x):          # OLMo 2 norms a token's h * d channels, before the head split
        return norm(x) if cfg["over"] == "head" else norm(x.flatten(2)).view(x.shape)

    def eager_norm(x, w):           # Qwen3RMSNorm's math: float32 stats, to(bf16), times weight
        def f(y):
            yf = y.float()
            yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + EPS)
            return yf.to(y.dtype) * (w + cfg["offset"] if cfg["offset"] else w)
        return by_shape(f, x)

    nq, nk, cos, sin, rope = P.nq, P.nk, P.cos, P.sin, hf.apply_rotary_pos_emb

    def hf_fn(q, k):                # plain locals only: what torch.compile traces
        qn, kn = by_shape(nq, q), by_shape(nk, k)
        return rope(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)

    ins = lambda S: (S.q, S.k, wq, wk)
    g_bshd = lambda S: (S.gq, S.gk)
    g_bhsd = lambda S: (S.gq.transpose(1, 2), S.gk.transpose(1, 2))
    if P.cu is None:
        ours_fmt, view = dict(tensor_format="bshd"), (lambda x: x)
    else:                           # the packed row as thd: [t, h, d] and the sequences' bounds
        # A view, not x[0]: select's backward would add a zero fill and a copy of the gradient.
        ours_fmt, view = dict(tensor_format="thd", cu_seqlens=P.cu), (lambda x: x.view(x.shape[1:]))
    kw.update(ours_fmt)
    g_ours = lambda S: (view(S.gq), view(S.gk))
    lines = {"copy": None}
    lines["ours"] = lambda S: (trm.apply_rotary_pos_emb_qk(view(S.q), view(S.k), P.rope, q_norm_weight=wq,
                                                           k_norm_weight=wk, **kw), ins(S), g_ours(S))
    lines["ours_table"] = lambda S: (trm.apply_rotary_pos_emb_qk(view(S.q), view(S.k), P.freqs, q_norm_weight=wq,
                                                                 k_norm_weight=wk, **kw), ins(S), g_ours(S))
    if P.qkv_ok:
        d = cfg["d"]
        split = [cfg["hq"] // cfg["hk"] * d, d, d]
        # Fused QKV takes no cu_seqlens: the packed row goes in with its positions.
        qkv_pos = dict(positions=P.pos[None]) if P.cu is not None else {}
        lines["ours_qkv"] = lambda S: (trm.apply_fused_qkv_rotary_pos_emb(
            S.qkv, P.rope, P.rope, split, tensor_format="bshd", q_norm_weight=wq,
            k_norm_weight=wk, norm_eps=EPS, norm_offset=cfg["offset"], **qkv_pos)[:2],
            (S.qkv, wq, wk), g_bshd(S))
    else:
        lines["ours_qkv"] = "n/a (fused QKV takes per-head norms only)"
    lines["eager_norm_ours_rope"] = lambda S: (
        (trm.apply_rotary_pos_emb(view(eager_norm(S.q, wq)), P.rope, **ours_fmt),
         trm.apply_rotary_pos_emb(view(eager_norm(S.k, wk)), P.rope, **ours_fmt)),
        ins(S), g_ours(S))
    lines["transformers_eager"] = lambda S: (hf_fn(S.q, S.k), ins(S), g_bhsd(S))
    if DRY:
        lines["torch_compile"] = "skipped (dry run)"
    else:
        compiled = torch.compile(hf_fn, dynamic=False)
        lines["torch_compile"] = lambda S: (compiled(S.q, S.k), ins(S), g_bhsd(S))
    if LIGER_NOTE:
        lines["liger"] = LIGER_NOTE
    else:
        try:
            lq, lk = (LigerRMSNorm(w.numel(), eps=EPS, offset=cfg["offset"],
                                   casting_mode=cfg["liger_cast"], in_place=False) for w in (wq, wk))
            lq.weight, lk.weight = wq, wk

            def liger(S):   # note: Liger's rope works in place on the norm's output and on dq/dk
                out = LigerRopeFunction.apply(by_shape(lq, S.q).transpose(1, 2),
                                              by_shape(lk, S.k).transpose(1, 2), P.cos, P.sin)
                return (out[0], out[1]), ins(S), g_bhsd(S)
            lines["liger"] = liger
        except Exception as e:
            lines["liger"] = f"liger skipped: {type(e).__name__}: {e}"
    if AXOLOTL_NOTE:
        lines["axolotl"] = AXOLOTL_NOTE
    elif cfg["over"] != "head":
        lines["axolotl"] = "n/a (axolotl's kernel norms each head)"
    else:
        unit = bool(cfg["offset"])      # Gemma's 1 + weight

        def axolotl(S):
            return ((axolotl_norm_rope(S.q, wq, P.cos, P.sin, EPS, unit_offset=unit),
                     axolotl_norm_rope(S.k, wk, P.cos, P.sin, EPS, unit_offset=unit)),
                    ins(S), g_bshd(S))
        lines["axolotl"] = axolotl
    return lines


def make_step(fn, mode):
    if fn is None:                                  # the unit: a device copy of q and of k
        def step(S):
            with torch.no_grad():
                S.qd.copy_(S.q)
                S.kd.copy_(S.k)
    elif mode == "fwd":
        def step(S):
            with torch.no_grad():
                fn(S)
    else:
        def step(S):
            outs, ins, grads = fn(S)
            torch.autograd.grad(outs, ins, grads)
    return step


def ref64(x, w, cfg, ang):
    """The same math in float64 (angles exact: position times inv_freq; cos and sin not rounded)."""
    x = x.double()
    xs = x if cfg["over"] == "head" else x.flatten(2)
    y = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + EPS) * (cfg["offset"] + w.double()))
    y = y.view(x.shape)
    cos, sin, h = ang.cos()[None, :, None], ang.sin()[None, :, None], x.shape[-1] // 2
    return y * cos + torch.cat((-y[..., h:], y[..., :h]), -1) * sin


def check(P):
    """ours vs transformers_eager (and both vs float64) on set 0: outputs and gradients."""
    S, cfg, res = P.sets[0], P.cfg, {}
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    try:
        lines = make_lines(P, "fwd_bwd")
        o_ours, in_ours, g = lines["ours"](S)
        as_bshd = lambda t: t.view(1, *t.shape) if t.dim() == 3 else t     # thd: one batch row
        o_ours, g = [as_bshd(o) for o in o_ours], [as_bshd(t) for t in g]
        o_hf, in_hf, g_hf = lines["transformers_eager"](S)
        o_hf = [t.transpose(1, 2) for t in o_hf]
        ang = P.exact_ang
        x64 = [t.detach().double().requires_grad_() for t in (S.q, S.k, P.wq, P.wk)]
        o_ref = [ref64(x64[0], x64[2], cfg, ang), ref64(x64[1], x64[3], cfg, ang)]
        n = sum(t.numel() for t in o_ref)
        mean_vs = lambda outs: sum((a.double() - r).abs().sum().item() for a, r in zip(outs, o_ref)) / n
        res["fwd_maxabs_ours_vs_hf"] = max((a.float() - b.float()).abs().max().item()
                                           for a, b in zip(o_ours, o_hf))
        res["fwd_meanabs_ours_vs_f64"] = mean_vs(o_ours)
        res["fwd_meanabs_hf_vs_f64"] = mean_vs(o_hf)
        gr_ours = torch.autograd.grad(o_ours, in_ours, g)
        gr_hf = torch.autograd.grad(o_hf, in_hf, [t.transpose(1, 2) for t in g_hf])
        gr_ref = torch.autograd.grad(o_ref, x64, [t.double() for t in g])
        for name, i in (("dq", 0), ("dwq", 2)):
            res[f"bwd_{name}_rel_ours_vs_hf"] = rel(gr_ours[i], gr_hf[i])
            res[f"bwd_{name}_rel_ours_vs_f64"] = rel(gr_ours[i], gr_ref[i])
            res[f"bwd_{name}_rel_hf_vs_f64"] = rel(gr_hf[i], gr_ref[i])
        if P.qkv_ok:
            with torch.no_grad():
                o_qkv = lines["ours_qkv"](S)[0]
            res["qkv_maxabs_vs_ours"] = max((a.float() - b.float()).abs().max().item()
                                            for a, b in zip(o_qkv, o_ours))
    except Exception as e:
        res["check_error"] = f"{type(e).__name__}: {e}"
        return res
    if callable(lines["axolotl"]):      # its backward autotunes here, outside graph capture
        try:
            o_ax, in_ax, g_ax = lines["axolotl"](S)
            res["fwd_meanabs_axolotl_vs_f64"] = mean_vs(o_ax)
            gr_ax = torch.autograd.grad(o_ax, in_ax, g_ax)
            res["bwd_dq_rel_axolotl_vs_f64"] = rel(gr_ax[0], gr_ref[0])
        except Exception as e:
            res["check_error_axolotl"] = f"{type(e).__name__}: {e}"
    return res


def bench_mode(P, mode):
    """Rows {line, us, graph, note} for one point and mode (copy first: the unit)."""
    lines, runners, rows, graphs = make_lines(P, mode), {}, [], []
    for name in LINES:
        fn = lines.get(name)
        if isinstance(fn, str):
            rows.append(dict(line=name, us=None, graph=False, note=fn))
            continue
        step = make_step(fn, mode)
        try:
            if DRY:     # one call, wall time only: checks that the line runs
                t0 = time.perf_counter()
                step(P.sets[0])
                rows.append(dict(line=name, us=(time.perf_counter() - t0) * 1e6, graph=False))
                continue
            t0 = time.perf_counter()
            try:
                g = graphed(lambda step=step: [step(S) for S in P.sets])
                graphs.append(g)
                runners[name] = (g, True, None)
            except Exception as e:
                torch.cuda.synchronize()
                for _ in range(2):
                    for S in P.sets:
                        step(S)
                note = f"capture failed ({type(e).__name__}: {str(e)[:120]}); eager timing"
                runners[name] = (EagerSteps([functools.partial(step, S) for S in P.sets]),
                                 False, note)
            print(f"  {P.cfg['model']} s={P.s} {mode} {name}: ready in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        except Exception as e:
            rows.append(dict(line=name, us=None, graph=False,
                             note=f"failed: {type(e).__name__}: {str(e)[:200]}"))
    if not DRY:
        timed = replay_ms({name: run for name, (run, _, _) in runners.items()}, len(P.sets),
                          replays=REPLAYS, rounds=ROUNDS)
        for name, (_, graph, note) in runners.items():
            rows.append(dict(line=name, us=timed[name][0] * 1e3, graph=graph, note=note))
    for g in graphs:
        g.reset()
    del graphs, runners, lines
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return sorted(rows, key=lambda r: LINES.index(r["line"]))


def table(P, mode, rows, corr, nsets):
    c = rows[0]
    out = [f"{P.cfg['model']}  tokens={P.s}  {mode}  (q {P.cfg['hq']}h + k {P.cfg['hk']}h, d={P.cfg['d']},"
           f" norm over {P.cfg['over']}, offset {P.cfg['offset']}; q+k {P.bytes_qk / 2**20:.1f} MiB,"
           f" {nsets} sets)"]
    if c["us"]:
        out.append(f"  copy unit: {c['us']:.1f} us, {2 * P.bytes_qk / c['us'] / 1e3:.0f} GB/s")
    for r in rows:
        if r["us"] is None:
            out.append(f"  {r['line']:<22} {'-':>8}            {r['note']}")
        else:
            out.append(f"  {r['line']:<22} {r['copies']:8.2f} copies {r['us']:10.1f} us"
                       f"  {'graph' if r['graph'] else 'eager'}" + (f"  {r['note']}" if r.get("note") else ""))
    keys = [k for k in corr if k.startswith("fwd") or k.startswith("qkv") or k.startswith("check_error")
            or (mode == "fwd_bwd" and k.startswith("bwd"))]
    out += [f"  check {k} = {corr[k]:.3g}" if isinstance(corr[k], float) else f"  check {k} = {corr[k]}"
            for k in keys]
    return "\n".join(out)


def _copies_tick(value, _position):
    """A y tick's label: values of leading digit 1, 2, 3 or 5 only, so that the labels of a
    log axis do not crowd."""
    if value <= 0:
        return ""
    lead = round(value / 10 ** math.floor(math.log10(value)), 6)
    return f"{value:g}" if lead in (1, 2, 3, 5) else ""


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as e:
        return f"no plot: {e}"
    models = list(dict.fromkeys(r["model"] for r in rows))
    modes = ["fwd", "fwd_bwd"]
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.8 * len(models)), squeeze=False)
    handles = {}
    for i, m in enumerate(models):
        for j, mode in enumerate(modes):
            ax, sub = axes[i][j], [r for r in rows if r["model"] == m and r["mode"] == mode]
            for line in LINES[1:]:
                pts = sorted((r["tokens"], r["copies"]) for r in sub
                             if r["line"] == line and r["copies"] is not None)
                if pts:
                    # Ours on top and wider: near the ideal line, the others would hide it.
                    ours = line == "ours"
                    handles[line], = ax.plot(*zip(*pts), marker="o", label=line,
                                             color=f"C{LINES.index(line)}",
                                             lw=2.2 if ours else 1.2, zorder=5 if ours else 3)
            handles["ideal (1.0 forward, 2.5 forward + backward)"] = ax.axhline(
                1.0 if mode == "fwd" else 2.5, ls="--", color="gray", zorder=2)
            toks = sorted({r["tokens"] for r in sub})
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(toks, [str(t) for t in toks])
            # Copies as plain numbers (1, 2, 3, 5, 10, ...), not powers of ten, on the log axis.
            for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                set_formatter(matplotlib.ticker.FuncFormatter(_copies_tick))
            ax.set(title=f"{m}  {mode}", xlabel="tokens", ylabel="time / copy of q+k")
    # One legend for every panel, above them: inside a panel it covered lines.
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=5, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.8 * len(models))))
    fig.savefig(path, dpi=110)
    return None


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cuda = torch.cuda.is_available() and not DRY
    if not args or not (DRY or cuda):
        sys.exit("usage: python rope_qknorm_bench.py OUT [--dry-run]  (a CUDA device unless --dry-run)")
    out_dir = args[0]
    os.makedirs(out_dir, exist_ok=True)
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    t_start = time.time()
    import transformers
    import triton
    log = [f"qknorm bench  device={torch.cuda.get_device_name() if cuda else 'cpu (dry run)'}  "
           f"torch {torch.__version__}  triton {triton.__version__}  transformers {transformers.__version__}",
           f"times per step for q and k together; 'copies' = time / time of q_dst.copy_(q); "
           f"k_dst.copy_(k). rounds={ROUNDS} replays={REPLAYS}; ideal fwd 1.0, fwd_bwd 2.5",
           "ours_qkv also writes v (0.2 copies for Qwen3 shapes)"]
    log += [note for note in (LIGER_NOTE, AXOLOTL_NOTE) if note]
    print("\n".join(log), flush=True)
    rows = []
    for cfg in MODELS:
        for s in cfg["tokens"]:
            if time.time() - t_start > BUDGET_S:
                msg = f"{cfg['model']} tokens={s}: skipped (past the {BUDGET_S} s budget)"
                log.append(msg)
                print(msg, flush=True)
                continue
            if not DRY:
                torch._dynamo.reset()
            P = build_point(cfg, s, dev)
            corr = check(P)
            for mode in ("fwd", "fwd_bwd"):
                mrows = bench_mode(P, mode)
                copy_us = mrows[0]["us"]
                for r in mrows:
                    r.update(model=cfg["model"], tokens=s, mode=mode, sets=len(P.sets),
                             copy_us=copy_us,
                             copies=r["us"] / copy_us if r["us"] is not None and copy_us else None)
                    if r["line"] == "copy" and copy_us:
                        r["gbps"] = 2 * P.bytes_qk / copy_us / 1e3
                    r.update(corr)
                rows += mrows
                block = table(P, mode, mrows, corr, len(P.sets))
                log.append(block)
                print(block, flush=True)
            del P
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    log.append(f"total {time.time() - t_start:.1f} s")
    print(log[-1], flush=True)
    order = ["model", "tokens", "mode", "line", "us", "copies", "graph"]
    rows = [{**{k: r.get(k) for k in order}, **{k: v for k, v in r.items() if k not in order}}
            for r in rows]
    with open(os.path.join(out_dir, "qknorm.json"), "w") as f:
        json.dump(rows, f, indent=1)
    note = plot(rows, os.path.join(out_dir, "qknorm.png"))
    if note:
        log.append(note)
        print(note)
    with open(os.path.join(out_dir, "qknorm.log"), "w") as f:
        f.write("\n\n".join(log) + "\n")


if __name__ == "__main__":
    main()
