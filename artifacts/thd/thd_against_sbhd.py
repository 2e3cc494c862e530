"""Packed thd of few heads against sbhd of the same bytes: whether the positions path's
shortfall at uniform short sequences (8 heads of d 128) is the thd search or the geometry of
the tensor (2 KiB tokens), which a batch-of-one sbhd tensor of the same tokens and heads shares
without a search. The timing (kernels alone, rope_bench's `models` timing) is
artifacts/batch_of_one/batch_of_one_ab.py's, run on the checkout:

    python artifacts/batch_of_one/batch_of_one_ab.py . OUT.json bf16,fp16 \
        thd-2048x64-h8,thd-4096x32-h8,sbhd-128K-h8,thd-mixed-16K-h32,sbhd-16K-h32

This script launches each of NCU_LINES (or the POINT:LINE arguments, e.g.
thd-2048x64-h8:flash_attn with flash-attn's rotary.py on the path) once, forward, bf16, for
ncu (on a GPU, from the repository root):

    ncu -k regex:rotary_kernel python artifacts/thd/thd_against_sbhd.py [POINT:LINE ...]
"""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "artifacts", "batch_of_one"))

import batch_of_one_ab  # noqa: E402
import torch  # noqa: E402

import rope_bench as B  # noqa: E402

NCU_LINES = [("thd-2048x64-h8", "triton_positions"), ("sbhd-128K-h8", "triton_positions"),
             ("thd-2048x64-h8", "triton"), ("sbhd-128K-h8", "triton")]

for name, line in [arg.split(":") for arg in sys.argv[1:]] or NCU_LINES:
    work = B._model_workload(batch_of_one_ab.point(name), torch.bfloat16)
    print(f"launch: {name} {line} forward", flush=True)
    work["lines"][line].forward()
    torch.cuda.synchronize()
