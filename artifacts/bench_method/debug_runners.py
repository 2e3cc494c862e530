"""Which replays of the models sweep's runners (rope_bench._provider_runner) fault, by the order
they are built and replayed in: how the fault that keeps the autograd steps apart was narrowed
down (docs/benchmarks.md, "How timing works"). One variant per process (a fault ends the CUDA
context); run with CUDA_LAUNCH_BLOCKING=1.

    python artifacts/bench_method/debug_runners.py VARIANT PROVIDER[,PROVIDER...] [POINT]

VARIANT: graphs (the graphed steps of the providers, replayed interleaved), eager_after (a
provider's graphed step, its eager step, the graph again), eager_other (another provider's
eager step in between), same_step (the eager steps the graph captured, as the old order had
it), allmodes (every mode of each provider built and replayed, then every one again). SETS in
the environment: how many input sets (default 4).

On an H200 (2026-11-28, 8B-TP1-k-8K, four sets unless named): graphs, eager_after,
eager_other and same_step replayed; allmodes replayed with triton, triton_positions or
flash_attn alone at 8B-TP1-q-8K, and faulted (an illegal address) at triton's graphed step in
the second round with triton and liger; keeping each graph's captured outputs did not help.
With one input set (SETS=1) the same replayed; under compute-sanitizer's memcheck the capture
of our autograd step itself failed (cudaErrorStreamCaptureImplicit in the backward: "operation
would make the legacy stream depend on a capturing blocking stream"), so it named no kernel.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
import torch

import rope_bench as B
from rope_bench_report import MODEL_MODES, MODEL_POINT_BY_NAME

EAGER, GRAPHED = "forward+backward", "forward+backward (CUDA graph)"


def main():
    variant, providers = sys.argv[1], sys.argv[2].split(",")
    point = MODEL_POINT_BY_NAME[sys.argv[3] if len(sys.argv) > 3 else "8B-TP1-k-8K"]
    works = B._rotating_workloads(point, torch.bfloat16)[:int(os.environ.get("SETS", 4))]

    def build(provider, mode):
        return B._provider_runner([w["lines"][provider] for w in works], mode)

    def replay(name, runner):
        runner.replay()
        torch.cuda.synchronize()
        print("ok", variant, name, flush=True)

    if variant == "graphs":
        runners = {p: build(p, GRAPHED) for p in providers}
        for _ in range(2):
            for p, runner in runners.items():
                replay(p, runner)
    elif variant in ("eager_after", "eager_other"):
        graph = build(providers[0], GRAPHED)
        replay("graph", graph)
        replay("eager", build(providers[0] if variant == "eager_after" else providers[1], EAGER))
        replay("graph again", graph)
    elif variant == "same_step":
        steps = [w["lines"][providers[0]].make_step() for w in works]
        eager, graph = B.EagerSteps(steps), B.graphed(B._over_sets(steps))
        for name, runner in (("eager", eager), ("graph", graph), ("eager again", eager),
                             ("graph again", graph)):
            replay(name, runner)
    elif variant == "allmodes":
        runners = {}
        for p in providers:
            for mode in MODEL_MODES:
                runners[(p, mode)] = build(p, mode)
                replay((p, mode), runners[(p, mode)])
        for key, runner in runners.items():
            replay(("again",) + key, runner)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
