"""How the models sweep's timing method reads a point, against CUDA-graph replay over rotating
input sets larger than L2 (on a CUDA device).

The models sweep (rope_bench._run_models) times each provider's kernels alone as one call
captured in a CUDA graph and replayed by triton.testing.do_bench, which clears L2 before each
replay, against an eager copy timed the same way. This script times the same lines, at the
points named on the command line (all models points without any), both ways:

- `flush`: the sweep's own numbers (rope_bench._copy_ms, rope_bench._model_line_ms);
- `rotating`: as many independent input sets as move at least ROTATING_BYTES, each provider's
  calls on every set captured in one CUDA graph, replayed REPLAYS times between two events,
  ROUNDS rounds interleaved over the providers, the median per call; against the fastest of
  three copies of the same sets into preallocated outputs: eager `copy_` calls, the same
  captured in a graph (memcpy nodes) and the plain Triton copy kernel in a graph.

    python artifacts/bench_method/rotating_sets_probe.py OUT [POINT ...]

It ran with rope_bench.py of commit 79eed59, whose `_copy_ms` and `_model_line_ms` were the
sweep's method then; the sweep has timed over rotating sets since, and they are gone from
rope_bench.py (run it from a checkout of 79eed59).
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
import torch

import rope_bench as B
from rope_bench_report import MODEL_POINTS, ScriptLog, device_header

ROTATING_BYTES = 512 * 2 ** 20    # moved per replay of a graph: about 8x the H200's L2
MAX_SETS = 32
REPLAYS = 5
ROUNDS = 9
MODES = ("forward_kernel", "backward_kernel")
DTYPES = {"bf16": torch.bfloat16}


def event_ms(fn, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def rotating_copies(xs):
    """Three copies of every set's x into preallocated outputs: {name: (ms per copy fn)}."""
    outs = [torch.empty(x.numel(), dtype=x.dtype, device=x.device) for x in xs]
    flats = [x.reshape(-1) for x in xs]    # a view where x is contiguous, else a copy made once

    def eager():
        for o, x in zip(outs, flats):
            o.copy_(x)

    def triton_copy():
        for dst, flat in zip(outs, flats):
            B._triton_copy_kernel[(B.triton.cdiv(flat.numel(), B.TRITON_COPY_BLOCK),)](
                dst, flat, flat.numel(), BLOCK=B.TRITON_COPY_BLOCK, num_warps=B.TRITON_COPY_WARPS)
    eager()
    graph_memcpy, graph_triton = B.graphed(eager), B.graphed(triton_copy)
    n = len(xs)
    return {"copy eager": lambda: event_ms(lambda: [eager() for _ in range(REPLAYS)], REPLAYS * n),
            "copy graph": lambda: event_ms(lambda: [graph_memcpy.replay() for _ in range(REPLAYS)],
                                           REPLAYS * n),
            "triton_copy graph": lambda: event_ms(
                lambda: [graph_triton.replay() for _ in range(REPLAYS)], REPLAYS * n)}


def main():
    out_dir, names = sys.argv[1], set(sys.argv[2:])
    os.makedirs(out_dir, exist_ok=True)
    log = ScriptLog()
    say = log.say
    say(f"{device_header()}; rotating sets moving >= {ROTATING_BYTES >> 20} MiB per replay, "
        f"{REPLAYS} replays x {ROUNDS} rounds; fraction of copy speed (copy ms / ms)")
    for point in MODEL_POINTS:
        if names and point["name"] not in names:
            continue
        for dtype_name, dtype in DTYPES.items():
            torch.manual_seed(0)
            works = [B._model_workload(point, dtype)]
            per_set = 2 * works[0]["x"].nbytes
            while len(works) < MAX_SETS and per_set * len(works) < ROTATING_BYTES:
                works.append(B._model_workload(point, dtype))
            xs = [w["x"] for w in works]
            providers = [p for p in works[0]["lines"]]
            # The sweep's method, on the first set.
            copies, flush = {}, {}
            for p in ["triton_copy"] + providers:
                line = (B._triton_copy_line(xs[0]) if p == "triton_copy"
                        else works[0]["lines"][p])
                state = {}
                for mode in MODES:
                    ref = B._copy_ms(copies, xs[0], line.moved, mode)[0]
                    flush[(p, mode)] = ref / B._model_line_ms(line, mode, state)[0]
            # Rotating sets: one graph per provider and mode.
            timers = rotating_copies(xs)
            moved = {}
            with torch.no_grad():
                for p in providers:
                    lines = [w["lines"][p] for w in works]
                    moved[p] = lines[0].moved
                    for mode in MODES:
                        calls = [ln.forward if mode == "forward_kernel" else ln.backward
                                 for ln in lines]
                        g = B.graphed(lambda calls=calls: [c() for c in calls])
                        timers[(p, mode)] = (lambda g=g, n=len(xs): event_ms(
                            lambda: [g.replay() for _ in range(REPLAYS)], REPLAYS * n))
            times = {k: [] for k in timers}
            for _ in range(ROUNDS):
                for k, fn in timers.items():
                    times[k].append(fn())
            med = {k: statistics.median(v) for k, v in times.items()}
            copy = min(med["copy eager"], med["copy graph"], med["triton_copy graph"])
            say(f"{point['name']} {dtype_name}: {len(xs)} sets of {per_set / 2 ** 20:.1f} MiB moved; "
                f"copy per set eager {med['copy eager'] * 1e3:.2f} us, graph (memcpy) "
                f"{med['copy graph'] * 1e3:.2f}, triton copy graph {med['triton_copy graph'] * 1e3:.2f}; "
                f"flush method's eager copy {copies[per_set][1][1][0] * 1e3:.2f} us")
            for mode in MODES:
                cells = [f"triton_copy flush {flush[('triton_copy', mode)]:.3f} "
                         f"rotating {copy / med['triton_copy graph']:.3f}"]
                for p in providers:
                    # A peer that moves other bytes (Liger: q and k) against the copy scaled
                    # to its bytes.
                    rot = copy * moved[p] / per_set / med[(p, mode)]
                    cells.append(f"{p} flush {flush[(p, mode)]:.3f} rotating {rot:.3f}")
                    log.rows.append(dict(point=point["name"], dtype=dtype_name, mode=mode,
                                         provider=p, flush=flush[(p, mode)], rotating=rot))
                say(f"  {mode}: " + "; ".join(cells))
            del works, xs, timers, times
            torch.cuda.empty_cache()
    log.write(out_dir, "rotating_sets_probe")


if __name__ == "__main__":
    main()
