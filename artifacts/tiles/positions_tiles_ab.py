"""The positions path (angles made in the kernel, no norm) under other tiles and warps, at the
models points where it falls short of 0.97 of copy speed on the H100 or the H200, with a few
points it meets for control: forward and backward kernels alone, bf16, in fractions of an
eager device copy of the same bytes, the peers (flash-attn's and Liger's rotary) beside it.

    python artifacts/tiles/positions_tiles_ab.py OUT [POINT ...]   # on a GPU, from the repo root
    python artifacts/tiles/positions_tiles_ab.py --rule OUT [POINT ...]

With --rule, the launch rule against itself with one of its thd search choices undone
(SEARCH_TILE_BYTES and SEARCH_GUESS say why each is made): tokens of
SEARCH_WIDE_TOKEN bytes or more in search tiles of SEARCH_TILE_BYTES (`no_wide`),
search tiles without the guessed window (`no_guess`), and both (`before`), at the thd points
that search cu_seqlens, for both paths (TE's table and angles from positions), in bf16 and
fp32; writes OUT/positions_rule_ab.log and .json.
"""
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import torch
from flush_copies import flush_copies

import rope_bench as B
import triton_rotary_launch as L
from rope_bench_report import MODEL_POINT_BY_NAME, ScriptLog, device_header, flat_outputs

ROUNDS = 3
# Short of 0.97 on one GPU or both in the runs of 2026-11-27, then three controls.
POINTS = ["hf-view-q-8K", "thd-2048x64-h8", "thd-mixed-16K-h32", "thd-lognormal-32K-h16",
          "thd-4096x32-h8", "VLM-7B-k-thd-8x8K", "h2-d64-64K", "MLA-k-rope-128K",
          "partial-quarter-h32-8K", "interleaved-half-h32-8K", "d80-h32-16K", "8B-TP8-k-64K",
          "8B-TP1-k-8K", "qkv-8B-TP1-8K", "8B-TP1-q-8K", "70B-TP1-q-8K", "8B-TP8-q-64K"]
# (tile bytes, warps); None: the rule as it is.
VARIANTS = {"rule": None, "2K_2w": (2048, 2), "4K_2w": (4096, 2), "8K_2w": (8192, 2),
            "8K_8w": (8192, 8), "16K_8w": (16384, 8)}
G = L.GPU_RULE
RULE_VARIANTS = {"rule": G, "no_wide": G._replace(search_wide_token=0),
                 "no_guess": G._replace(search_guess=False),
                 "before": G._replace(search_wide_token=0, search_guess=False)}
RULE_POINTS = ["thd-2048x64-h8", "thd-4096x32-h8", "thd-mixed-16K-h32", "thd-lognormal-32K-h16",
               "VLM-7B-k-thd-8x8K", "VLM-7B-q-thd-8x8K"]
RULE_DTYPES = ("bf16", "fp32")
PEER_LINES = ("flash_attn", "liger")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = {"forward_kernel": "forward", "backward_kernel": "backward"}


@contextlib.contextmanager
def variant(tiles):
    """Plans made inside take `tiles` = (bytes, warps) for every tile, or the LaunchRule
    `tiles` (None: the rule's)."""
    L._PLANS.clear()
    if tiles is None or isinstance(tiles, L.LaunchRule):
        with L.use_launch_rule(tiles or G):
            yield
        L._PLANS.clear()
        return
    size, warps = tiles
    rule = G._replace(tile_bytes=size, search_tile_bytes=size, qkv_tile_bytes=size,
                      num_warps=warps, search_warps=warps)
    config = L.launch_config

    def launch_config(*args, **kwargs):
        grid, meta = config(*args, **kwargs)
        return grid, dict(meta, num_warps=warps)

    L.launch_config = launch_config
    try:
        with L.use_launch_rule(rule):
            yield
    finally:
        L.launch_config = config
        L._PLANS.clear()


def run_point(name, say, rows, variants=VARIANTS, paths=("triton_positions",), dtype="bf16"):
    work = B._model_workload(MODEL_POINT_BY_NAME[name], DTYPES[dtype])
    x = work["x"]
    copy, tcopy = flush_copies(x)
    graphs, mismatch = {}, []
    for mode, fn_name in MODES.items():
        for path in paths:
            fn = getattr(work["lines"][path], fn_name)
            first = None
            for v, tiles in variants.items():
                with variant(tiles), torch.no_grad():
                    out = flat_outputs(fn())
                    graphs[(mode, f"{path}:{v}" if len(paths) > 1 else v)] = B.graphed(fn)
                if first is None:
                    first = out
                elif not torch.equal(out, first):
                    mismatch.append((mode, path, v))
        for peer in PEER_LINES:
            if peer in work["lines"]:
                with torch.no_grad():
                    graphs[(mode, peer)] = B.graphed(getattr(work["lines"][peer], fn_name))
    for key in mismatch:
        say(f"  {name} {key}: output differs from the rule's")
    times = {k: [] for k in graphs}
    copy_times, tcopy_times = [], []
    for _ in range(ROUNDS):
        copy_times.append(B._bench_ms(copy)[0])
        tcopy_times.append(B._bench_ms(tcopy)[0])
        for key, graph in graphs.items():
            times[key].append(B._bench_ms(graph.replay)[0])
    copy_ms = statistics.median(copy_times)
    tcopy_frac = copy_ms / statistics.median(tcopy_times)
    device = torch.cuda.get_device_name()
    say(f"\n{name}: {tuple(x.shape)} {dtype}, copy {copy_ms * 1e3:.1f} us, Triton copy "
        f"{tcopy_frac:.3f}")
    for mode in MODES:
        fr = {v: copy_ms / statistics.median(t) for (m, v), t in times.items() if m == mode}
        ours = {v: f for v, f in fr.items() if v not in PEER_LINES}
        best = max(ours, key=ours.get)
        say(f"  {MODES[mode]:8s} " + "  ".join(f"{v}={f:.3f}" for v, f in fr.items())
            + f"   best {best}")
        for v, f in fr.items():
            rows.append(dict(device=device, point=name, dtype=dtype, mode=mode, variant=v,
                             fraction=f, copy_ms=copy_ms, triton_copy=tcopy_frac))
    for graph in graphs.values():
        graph.reset()


def main():
    args = sys.argv[1:]
    rule_ab = args[:1] == ["--rule"]
    args = args[1:] if rule_ab else args
    if not args or not torch.cuda.is_available():
        sys.exit("usage: python artifacts/tiles/positions_tiles_ab.py [--rule] OUT [POINT ...]  "
                 "(CUDA device)")
    out_dir, points = args[0], args[1:] or (RULE_POINTS if rule_ab else POINTS)
    name = "positions_rule_ab" if rule_ab else "positions_tiles_ab"
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    out = ScriptLog()
    say, rows = out.say, out.rows
    say(f"{device_header()}; kernels alone, fraction of an eager copy's speed; median of "
        f"{ROUNDS} rounds of do_bench; " + (
            "the rule against its thd search choices undone; triton = TE's table, triton_positions = "
            "angles from positions" if rule_ab else "positions path, bf16; variants: tile bytes_warps"))
    start = time.time()
    todo = ([(p, dt) for dt in RULE_DTYPES for p in points] if rule_ab
            else [(p, "bf16") for p in points])
    for point, dtype in todo:
        if rule_ab:
            run_point(point, say, rows, RULE_VARIANTS, ("triton_positions", "triton"), dtype)
        else:
            run_point(point, say, rows)
        say(f"  ({time.time() - start:.0f} s)")
        torch.cuda.empty_cache()
        out.write(out_dir, name)


if __name__ == "__main__":
    main()
