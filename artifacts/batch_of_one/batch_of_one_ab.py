"""A/B of two source trees at models points, kernels alone (rope_bench's `models` timing: rotating
input sets, graphed, against the faster graphed copy), one tree per process:

    python artifacts/batch_of_one/batch_of_one_ab.py TREE OUT.json DTYPES [POINTS]
    # DTYPES e.g. bf16,fp16,fp32; POINTS: comma-separated models points (default NAMES)

TREE is a folder holding the repository's top-level sources (`git show REV:FILE` of each), or
the checkout itself. Run it alternately for the two trees (A B A B) on one machine and compare
the rows. Used for BATCH_OF_ONE / ANGLE_SCALE (`Variant`): the sbhd points of batch 1 whose
tiles they change, the fused QKV, Hugging Face's view (bshd of batch 1) and a thd point as a
control (its code unchanged). Without the peers on the path, only our two paths and the copies.
"""
import json
import os
import sys

tree = os.path.abspath(sys.argv[1])
sys.path.insert(0, tree)
import rope_bench as B  # noqa: E402
from rope_bench_report import MODEL_POINT_BY_NAME  # noqa: E402

assert os.path.dirname(B.__file__) == tree, B.__file__
NAMES = ["MLA-k-rope-128K", "h2-d64-64K", "8B-TP8-k-64K", "8B-TP1-k-8K", "d64-h32-16K",
         "MLA-q-rope-4K", "8B-TP1-q-8K", "d80-h32-16K", "hf-view-q-8K", "qkv-8B-TP1-8K",
         "thd-2048x64-h8"]
names = sys.argv[4].split(",") if len(sys.argv) > 4 else NAMES
results = []
B._run_models(sys.argv[3].split(","), ["forward_kernel", "backward_kernel"], results, {},
              points=[MODEL_POINT_BY_NAME[n] for n in names], progress=f"[{os.path.basename(tree)}]")
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
