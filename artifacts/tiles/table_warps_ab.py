"""TE's table path (no norm) under variants of the launch rule's warps for its tiles
(TABLE_WARPS), at the models points where the H200 falls short, with the positions path
beside it: forward and backward kernels alone, bf16 (fp16 and fp32 at four points), in
fractions of an eager device copy of the same bytes.

    python artifacts/tiles/table_warps_ab.py OUT              # on a GPU, from the repository root
    python artifacts/tiles/table_warps_ab.py --ncu POINT      # one table and one positions
                                                              # forward, for Nsight Compute

Each line is replayed from a CUDA graph captured under its variant (plans made afresh),
timed as the models sweep times it (triton.testing.do_bench, L2 flushed between runs); the
variants of a point are timed round-robin over ROUNDS rounds and the median kept, so that a
drift of the GPU's clocks falls on all of them. Before timing, each variant's output is
compared with the rule's (the same bits: a tile's shape does not change the arithmetic).
Writes OUT/table_warps_ab.log and OUT/table_warps_ab.json.
"""
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())

import torch
from flush_copies import flush_copies

import rope_bench as B
import triton_rotary_launch as L
from rope_bench_report import MODEL_POINT_BY_NAME, ScriptLog, device_header, flat_outputs, table_bound

ROUNDS = 3
POINTS = ["8B-TP1-q-8K", "8B-TP1-k-8K", "70B-TP1-q-8K", "h40-q-8K", "d80-h32-16K",
          "VLM-7B-q-8K", "VLM-7B-q-thd-8x8K", "thd-lognormal-32K-h16", "thd-2048x64-h8",
          "hf-view-q-8K", "qkv-8B-TP1-8K", "MLA-k-rope-128K", "8B-TP8-q-64K", "h2-d64-64K"]
# Other dtypes at a few of them.
MORE_DTYPES = {"fp16": ["8B-TP1-q-8K", "h40-q-8K", "VLM-7B-q-thd-8x8K", "8B-TP8-q-64K"],
               "fp32": ["8B-TP1-q-8K", "h40-q-8K", "VLM-7B-q-thd-8x8K", "8B-TP8-q-64K"]}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
G = L.GPU_RULE
# The table path's variants (the positions path is timed under the rule alone: these leave
# its plans as they are).
VARIANTS = {
    "rule": G,
    "4_warps": G._replace(table_warps=G.num_warps),
}
PATHS = {"triton": ("table", VARIANTS), "triton_positions": ("positions", {"rule": G})}
MODES = {"forward_kernel": "forward", "backward_kernel": "backward"}


def ms(fn):
    """Median ms of `fn`, timed as the models sweep times it (`rope_bench._bench_ms`)."""
    return B._bench_ms(fn)[0]


def run_point(name, dtype_name, say, rows):
    point = MODEL_POINT_BY_NAME[name]
    work = B._model_workload(point, DTYPES[dtype_name])
    x = work["x"]
    copy, tcopy = flush_copies(x)
    graphs, mismatch = {}, []
    for provider, (path, variants) in PATHS.items():
        line = work["lines"][provider]
        for mode, fn_name in MODES.items():
            fn = getattr(line, fn_name)
            first = None
            for variant, rule in variants.items():
                L._PLANS.clear()
                with L.use_launch_rule(rule), torch.no_grad():
                    out = flat_outputs(fn())
                    graphs[(path, mode, variant)] = B.graphed(fn)
                if first is None:
                    first = out
                elif not torch.equal(out, first):
                    mismatch.append((path, mode, variant))
    for key in mismatch:
        say(f"  {name} {key}: output differs from the rule's")
    times = {k: [] for k in graphs}
    copy_times, tcopy_times = [], []
    for _ in range(ROUNDS):
        copy_times.append(ms(copy))
        tcopy_times.append(ms(tcopy))
        for key, graph in graphs.items():
            times[key].append(ms(graph.replay))
    copy_ms = statistics.median(copy_times)
    tcopy_frac = copy_ms / statistics.median(tcopy_times)
    bound = table_bound(dict(sweep="models", x=name, mode="forward_kernel", bytes=2 * x.nbytes))
    device = torch.cuda.get_device_name() if x.is_cuda else str(x.device)
    say(f"\n{name}: {tuple(x.shape)} {dtype_name}, copy {copy_ms * 1e3:.1f} us, Triton copy "
        f"{tcopy_frac:.3f}, table bound {bound:.3f}")
    for path, variants in PATHS.values():
        for mode in MODES:
            fr = {v: copy_ms / statistics.median(times[(path, mode, v)]) for v in variants}
            best = max(fr, key=fr.get)
            say(f"  {path:9s} {MODES[mode]:8s} " + "  ".join(f"{v}={f:.3f}" for v, f in fr.items())
                + f"   best {best}")
            for v, f in fr.items():
                rows.append(dict(device=device, point=name, dtype=dtype_name, path=path,
                                 mode=mode, variant=v, fraction=f, copy_ms=copy_ms,
                                 table_bound=bound, triton_copy=tcopy_frac))
    for graph in graphs.values():
        graph.reset()


def ncu(name):
    """One table and one positions forward at `name` (bf16), each launched once."""
    work = B._model_workload(MODEL_POINT_BY_NAME[name], torch.bfloat16)
    for provider in PATHS:
        work["lines"][provider].forward()
    torch.cuda.synchronize()


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--ncu":
        return ncu(sys.argv[2])
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        sys.exit("usage: python artifacts/tiles/table_warps_ab.py OUT [POINT ...]  (CUDA device)")
    out_dir, points = sys.argv[1], sys.argv[2:] or POINTS
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    out = ScriptLog()
    say, rows = out.say, out.rows
    say(f"{device_header()}; kernels alone, bf16, fraction of an eager copy's speed "
        f"(table bound: copy + table bytes); median of {ROUNDS} rounds of do_bench")
    for v, rule in VARIANTS.items():
        say(f"  {v}: tiles of TE's table with >= {rule.table_warps_min_heads} heads in "
            f"{rule.table_warps} warps")
    todo = [(name, "bf16") for name in points]
    todo += [(name, dt) for dt, names in MORE_DTYPES.items() for name in names
             if name in points]
    for name, dtype_name in todo:
        run_point(name, dtype_name, say, rows)
        torch.cuda.empty_cache()
        out.write(out_dir, "table_warps_ab")


if __name__ == "__main__":
    main()
