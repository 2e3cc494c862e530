"""The plans (kernel, Variant, grid, warps, compile options) of every thd launch of the `models`
points and of the `thd_empty_sequences` sweep, made by the launcher of the sources in TREE under
the GPU's launch rule on one H200's SM count, without a GPU (launches recorded, not run):

    python artifacts/thd/thd_plans_compare.py TREE OUT.json

Two trees' files compared key by key tell which benchmark rows a launch-rule change touches
(used for `rope_bench_report.restamp`'s `leave`).
"""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
tree = os.path.abspath(sys.argv[1])
sys.path.insert(0, tree)
import torch  # noqa: E402

import rope_bench as B  # noqa: E402
import triton_rotary_launch as L  # noqa: E402
from rope_bench_report import MODEL_POINTS  # noqa: E402

assert os.path.dirname(L.__file__) == tree, L.__file__
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
recorded = []


def record(launch, *args):
    recorded.append([launch.kernel.fn.__name__, [None if c is None else list(c) for c in launch.constexprs],
                     list(launch.grid), launch.num_warps, sorted(launch.options.items())])


def plans(call):
    recorded.clear()
    L._PLANS.clear()
    call()
    return list(recorded)


L._Launch.__call__ = record
L._sm_count = lambda device: 132
out = {}
with L.use_launch_rule(L.GPU_RULE):
    for point in (p for p in MODEL_POINTS if p["layout"] == "thd"):
        for name, dtype in DTYPES.items():
            lines = B._model_workload(point, dtype)["lines"]
            for provider in ("triton", "triton_positions"):
                for mode in ("forward", "backward"):
                    out[f"models {point['name']} {name} {provider} {mode}"] = plans(
                        getattr(lines[provider], mode))
    for empty in (0, 16, 48, 112):
        for name in ("bf16", "fp32"):
            x, fns = B._workload("thd_empty_sequences", {**B.BENCH_DEFAULTS, "thd_empty_sequences": empty},
                                 DTYPES[name])
            out[f"thd_empty_sequences {empty} {name} triton forward"] = plans(lambda: fns["triton"](x))
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
print(f"{len(out)} calls planned")
