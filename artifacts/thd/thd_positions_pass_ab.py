"""A/B: thd calls without a norm (packed sequences, cu_seqlens), their tiles searching
cu_seqlens for their tokens' sequences (the rule's thd_positions_pass off) or reading the
positions a pre-pass worked out once per token (sequence_positions_kernel, as the backward of a
norm does; thd_positions_pass on), with the plain 4 KiB tiles or 8 KiB ones (the search's).
The models sweep's thd points without M-RoPE (rope_bench_report.MODEL_POINTS), bf16 and fp16,
forward and backward kernels, exact angles (`positions`) and TE's table (`table`); flash-attn's
Triton rotary and a Triton copy for reference. Each line is one CUDA graph of the call (pre-pass
included), lines interleaved round-robin over ROUNDS rounds of REPLAYS replays, median; in
fractions of an eager device copy of the same bytes (the models sweep's unit: its
do_bench median). Results are compared bit for bit with the search's.

    python artifacts/thd/thd_positions_pass_ab.py OUT     # on a GPU, from the repository root
"""
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton

import rope_bench as B
import triton_rotary_launch as L
from rope_bench_report import MODEL_POINTS

ROUNDS, REPLAYS = 7, 10
G = L.GPU_RULE
RULES = {"search": G._replace(thd_positions_pass=False),
         "pre_pass": G._replace(thd_positions_pass=True),
         "pre_pass_8k": G._replace(thd_positions_pass=True, tile_bytes=8192)}
POINTS = [p for p in MODEL_POINTS if p["layout"] == "thd" and "mrope" not in p]


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
        sys.exit("usage: python artifacts/thd/thd_positions_pass_ab.py OUT  (on a CUDA device)")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    log = [f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
           f"{triton.__version__}; kernels alone, fraction of an eager copy of the same bytes"]
    print(log[0], flush=True)
    for point in POINTS:
        for dtype_name in ("bf16", "fp16"):
            work = B._model_workload(point, B.BENCH_DTYPES[dtype_name])
            x, lines = work["x"], work["lines"]
            copy_ms = B._bench_ms(lambda: torch.empty_like(x).copy_(x))[0]
            graphs, results = {}, {}
            with torch.no_grad():
                for ref in ("flash_attn",):
                    if ref in lines:
                        graphs[(ref, "fwd", "-")] = B.graphed(lines[ref].forward)
                graphs[("triton_copy", "fwd", "-")] = B.graphed(B._triton_copy_line(x).forward)
                for provider, label in (("triton_positions", "positions"), ("triton", "table")):
                    for mode in ("fwd", "bwd"):
                        for rule_name, rule in RULES.items():
                            L._PLANS.clear()
                            with L.use_launch_rule(rule):
                                fn = lines[provider].forward if mode == "fwd" else lines[provider].backward
                                results[(label, mode, rule_name)] = fn()
                                graphs[(label, mode, rule_name)] = B.graphed(fn)
            for (label, mode, rule_name), out in results.items():
                if rule_name != "search":
                    same = torch.equal(out, results[(label, mode, "search")])
                    if not same:
                        log.append(f"  {point['name']} {dtype_name} {label} {mode} {rule_name}: "
                                   f"NOT bit-identical to search")
            ms = time_graphs(graphs)
            head = (f"{point['name']} {dtype_name}: {x.numel() * x.element_size() >> 20} MiB, "
                    f"copy {copy_ms * 1e3:.1f} us")
            log.append(head)
            print(head, flush=True)
            for key, t in sorted(ms.items()):
                line = f"  {' '.join(key):32s} {copy_ms / t:6.3f} of copy {t * 1e3:8.1f} us"
                log.append(line)
                print(line, flush=True)
            for graph in graphs.values():
                graph.reset()
            del work, x, lines, graphs, results
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "thd_positions_pass_ab.log"), "w") as f:
        f.write("\n".join(log) + "\n")


if __name__ == "__main__":
    main()
