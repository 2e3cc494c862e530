"""A/B: q and k in one launch (set_rotary_qk_kernel) against two launches (set_rotary_kernel each),
kernels alone, CUDA graphs over sets larger than L2, in copies of q and k."""
import math, os, statistics, sys
from types import SimpleNamespace
sys.path.insert(0, os.getcwd())
import torch, triton
import triton_rotary_launch as L
from rope_bench import graphed
from rope_qknorm_bench import packed_cu_seqlens
from triton_rotary_main import RotaryPositionEmbedding
BF16, EPS, ROUNDS, REPLAYS = torch.bfloat16, 1e-6, 7, 10
OUT = sys.argv[1]; os.makedirs(OUT, exist_ok=True)
logf = open(os.path.join(OUT, "pair_nonorm.log"), "w")
def say(m):
    print(m, flush=True); logf.write(m + "\n"); logf.flush()

def time_graphs(graphs, nsets):
    times = {k: [] for k in graphs}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ROUNDS):
        for k, g in graphs.items():
            a.record()
            for _ in range(REPLAYS):
                g.replay()
            b.record(); b.synchronize()
            times[k].append(a.elapsed_time(b) * 1e3 / (REPLAYS * nsets))
    return {k: statistics.median(v) for k, v in times.items()}

def point(name, s, hq, hk, d=128, over="head", offset=0.0, fmt="bshd", cu=None, rules=None):
    nbytes = 2 * s * (hq + hk) * d
    n = max(4, math.ceil((300 << 20) / nbytes))
    shp = (s,) if fmt == "thd" else (1, s)
    sets = []
    for _ in range(n):
        S = SimpleNamespace(q=torch.randn(*shp, hq, d, device="cuda", dtype=BF16),
                            k=torch.randn(*shp, hk, d, device="cuda", dtype=BF16))
        S.gq, S.gk = torch.randn_like(S.q), torch.randn_like(S.k)
        S.dq, S.dk = torch.empty_like(S.q), torch.empty_like(S.k)
        sets.append(S)
    module = RotaryPositionEmbedding(d, rotary_base=1e6, device="cuda")
    table = module(s)
    wq = L.RMSNorm((1 - offset + 0.1 * torch.randn(d if over == "head" else hq * d, device="cuda")).to(BF16), EPS, offset, over)
    wk = L.RMSNorm((1 - offset + 0.1 * torch.randn(d if over == "head" else hk * d, device="cuda")).to(BF16), EPS, offset, over)
    kw = dict(tensor_format=fmt)
    if cu is not None:
        kw["cu_seqlens"] = cu
    lines = {"copy": lambda S: (S.dq.copy_(S.q), S.dk.copy_(S.k))}
    for sn, src in (("exact", module), ("table", table)):
        for bwd in (False, True):
            lines[f"{sn}_{'bwd' if bwd else 'fwd'}_sep"] = lambda S, src=src, bwd=bwd: (L.set_rotary_kernel(S.q, src, backward=bwd, **kw), L.set_rotary_kernel(S.k, src, backward=bwd, **kw))
            lines[f"{sn}_{'bwd' if bwd else 'fwd'}_pair"] = lambda S, src=src, bwd=bwd: L.set_rotary_qk_kernel(S.q, S.k, src, backward=bwd, **kw)
    graphs = {}
    for name_, fn in lines.items():
        if name_.endswith("_pair"):
            a = [o.float() for o in fn(sets[0])]
            b = [o.float() for o in lines[name_[:-5] + "_sep"](sets[0])]
            err = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))
            if err > 0:
                say(f"  !! {name} {name_} differs from two launches: rel {err:.2e}")
        graphs[name_] = graphed(lambda fn=fn: [fn(S) for S in sets])
    us = time_graphs(graphs, len(sets))
    c = us["copy"]
    say(f"\n{name}: q {hq} k {hk} heads d {d} s {s} {fmt} over {over}; copy {c:.1f} us")
    for k_ in lines:
        if k_.endswith("_sep"):
            p = k_[:-4] + "_pair"
            say(f"  {k_[:-4]:14s} sep {us[k_] / c:6.3f}  pair {us[p] / c:6.3f} copies  ({us[k_]:7.1f} -> {us[p]:7.1f} us)")
    for g in graphs.values():
        g.reset()
    del sets, graphs
    torch.cuda.empty_cache()

say(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
point("TP8 16K", 16384, 4, 1)
point("TP8 64K", 65536, 4, 1)
point("Qwen3-8B 8K", 8192, 32, 8)
point("Qwen3-8B 16K", 16384, 32, 8)
point("Qwen3-32B 16K", 16384, 64, 8)
point("Gemma-3 16K", 16384, 16, 8, d=256, offset=1.0)
point("OLMo-2 16K", 16384, 32, 32, over="token")
point("packed 16K", 16384, 32, 8, fmt="thd", cu=packed_cu_seqlens(16384, "cuda"))
