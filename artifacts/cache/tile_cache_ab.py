"""A/B: how a tile's own data (read once, written once) meets the caches (the launch rule's
tile_load_cache, tile_load_evict, tile_store_cache): Triton's defaults against loads past L1
(.cg) or evicted from it first, and streaming stores (.cs), so that L1 and L2 keep what programs
share (TE's table rows, the norms' weights). Models points (rope_bench_report.MODEL_POINTS) where
the table path or the positions path is short of its bound, and one that is not; bf16, forward
and backward kernels of both paths. Each line is one CUDA graph of the call, lines interleaved
round-robin over ROUNDS rounds of REPLAYS replays, median; in fractions of an eager device copy
of the same bytes (the models sweep's unit). Results are compared bit for bit with the rule's.

    python artifacts/cache/tile_cache_ab.py OUT     # on a GPU, from the repository root
"""
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton

import rope_bench as B
import triton_rotary_launch as L
from rope_bench_report import MODEL_POINT_BY_NAME

ROUNDS, REPLAYS = 7, 10
G = L.GPU_RULE
RULES = {"rule": G,
         "load_cg": G._replace(tile_load_cache=".cg"),
         "load_evict_first": G._replace(tile_load_evict="evict_first"),
         "store_cs": G._replace(tile_store_cache=".cs"),
         "load_cg_store_cs": G._replace(tile_load_cache=".cg", tile_store_cache=".cs")}
POINTS = ["8B-TP1-q-8K", "70B-TP1-q-8K", "h40-q-8K", "d80-h32-16K", "hf-view-q-8K",
          "VLM-7B-q-8K", "VLM-7B-q-thd-8x8K", "thd-lognormal-32K-h16", "MLA-q-rope-4K",
          "8B-TP8-q-64K"]


def time_graphs(graphs):
    """Median ms per replay of each graph, interleaved round-robin."""
    times = {k: [] for k in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ROUNDS):
        for k, graph in graphs.items():
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / REPLAYS)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage: python artifacts/cache/tile_cache_ab.py OUT  (on a CUDA device)")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    log = [f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
           f"{triton.__version__}; kernels alone, bf16, fraction of an eager copy of the same bytes"]
    print(log[0], flush=True)
    summary = {}
    for name in POINTS:
        work = B._model_workload(MODEL_POINT_BY_NAME[name], torch.bfloat16)
        x, lines = work["x"], work["lines"]
        copy_ms = B._bench_ms(lambda: torch.empty_like(x).copy_(x))[0]
        graphs, results = {}, {}
        with torch.no_grad():
            for provider, label in (("triton", "table"), ("triton_positions", "positions")):
                for mode in ("fwd", "bwd"):
                    for rule_name, rule in RULES.items():
                        L._PLANS.clear()
                        with L.use_launch_rule(rule):
                            fn = lines[provider].forward if mode == "fwd" else lines[provider].backward
                            results[(label, mode, rule_name)] = fn()
                            graphs[(label, mode, rule_name)] = B.graphed(fn)
        for (label, mode, rule_name), out in results.items():
            if rule_name != "rule" and not torch.equal(out, results[(label, mode, "rule")]):
                log.append(f"  {name} {label} {mode} {rule_name}: NOT bit-identical to the rule's")
        ms = time_graphs(graphs)
        head = f"{name}: {x.numel() * x.element_size() >> 20} MiB, copy {copy_ms * 1e3:.1f} us"
        log.append(head)
        print(head, flush=True)
        for key, t in sorted(ms.items()):
            base = ms[(key[0], key[1], "rule")]
            summary.setdefault(key[2], []).append(base / t)
            line = (f"  {' '.join(key):32s} {copy_ms / t:6.3f} of copy {t * 1e3:8.1f} us  "
                    f"speed / rule's {base / t:6.3f}")
            log.append(line)
            print(line, flush=True)
        for graph in graphs.values():
            graph.reset()
        del work, x, lines, graphs, results
        torch.cuda.empty_cache()
    log.append("speed against the rule's, over every point and line: " + ", ".join(
        f"{k} median {statistics.median(v):.3f} (min {min(v):.3f}, max {max(v):.3f})"
        for k, v in summary.items()))
    print(log[-1], flush=True)
    with open(os.path.join(out_dir, "tile_cache_ab.log"), "w") as f:
        f.write("\n".join(log) + "\n")


if __name__ == "__main__":
    main()
