"""A/B of two source trees at packed thd points with TE's table whose tokens (all heads) hold
4 to 16 KiB, kernels alone (rope_bench's `models` timing), one tree per process:

    python artifacts/thd/thd_table_token_ab.py TREE OUT.json DTYPES     # e.g. bf16,fp16,fp32

TREE as in artifacts/batch_of_one/batch_of_one_ab.py. Besides three models points, the shape
of the `thd_empty_sequences` sweep without its empty sequences (16 sequences of 2048 tokens,
32 heads of d 128), where the H200's parameter sweeps of 2026-11-29 read the table path
0.015-0.035 slower in bf16 than before TE's table took plain tiles for wide tokens.
"""
import json
import os
import sys

tree = os.path.abspath(sys.argv[1])
sys.path.insert(0, tree)
import rope_bench as B  # noqa: E402
from rope_bench_report import MODEL_POINT_BY_NAME  # noqa: E402

assert os.path.dirname(B.__file__) == tree, B.__file__
POINTS = [MODEL_POINT_BY_NAME["thd-mixed-16K-h32"], MODEL_POINT_BY_NAME["thd-lognormal-32K-h16"],
          MODEL_POINT_BY_NAME["VLM-7B-q-thd-8x8K"],
          dict(name="thd-16x2048-h32", layout="thd", seqs=16, seq_len=2048, heads=32, d=128)]
results = []
B._run_models(sys.argv[3].split(","), ["forward_kernel", "backward_kernel"], results, {},
              points=POINTS, progress=f"[{os.path.basename(tree)}]")
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
