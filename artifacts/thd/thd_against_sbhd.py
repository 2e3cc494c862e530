"""Packed thd of few heads against sbhd of the same bytes, kernels alone (rope_bench's `models`
timing: rotating input sets, graphed, against the faster graphed copy): whether the positions
path's shortfall at uniform short sequences (8 heads of d 128) is the thd search or the
geometry of the tensor (2 KiB tokens), which a batch-of-one sbhd tensor of the same tokens
and heads shares without a search.

    python artifacts/thd/thd_against_sbhd.py OUT.json DTYPES     # on a GPU, from the repo root
    python artifacts/thd/thd_against_sbhd.py --ncu               # one launch per line, for ncu

With --ncu it launches each of NCU_LINES once, forward, bf16 (run it under
`ncu -k regex:rotary_kernel`).
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())

import rope_bench as B  # noqa: E402
from rope_bench_report import MODEL_POINT_BY_NAME  # noqa: E402

SBHD = {
    "sbhd-128K-h8": dict(name="sbhd-128K-h8", layout="sbhd", tokens=131072, heads=8, d=128),
    "sbhd-16K-h32": dict(name="sbhd-16K-h32", layout="sbhd", tokens=16384, heads=32, d=128),
}
POINTS = ["thd-2048x64-h8", "thd-4096x32-h8", "sbhd-128K-h8", "thd-mixed-16K-h32", "sbhd-16K-h32"]
NCU_LINES = [("thd-2048x64-h8", "triton_positions"), ("sbhd-128K-h8", "triton_positions"),
             ("thd-2048x64-h8", "triton"), ("sbhd-128K-h8", "triton")]


def point(name):
    return SBHD.get(name) or MODEL_POINT_BY_NAME[name]


if sys.argv[1] == "--ncu":
    import torch
    for name, line in NCU_LINES:
        work = B._model_workload(point(name), torch.bfloat16)
        print(f"launch: {name} {line} forward", flush=True)
        work["lines"][line].forward()
        torch.cuda.synchronize()
else:
    results = []
    B._run_models(sys.argv[2].split(","), ["forward_kernel", "backward_kernel"], results, {},
                  points=[point(n) for n in POINTS], progress="[thd_against_sbhd]")
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
