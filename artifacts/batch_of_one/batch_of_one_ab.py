"""A/B of two source trees at models points, kernels alone (rope_bench's `models` timing: rotating
input sets, graphed, against the faster graphed copy), one tree per process:

    python artifacts/batch_of_one/batch_of_one_ab.py TREE OUT.json DTYPES [POINTS]
    # DTYPES e.g. bf16,fp16,fp32; POINTS: comma-separated models points or EXTRA_POINTS
    # (default NAMES)

TREE is a folder holding the repository's top-level sources (`git show REV:FILE` of each), or
the checkout itself. Run it alternately for the two trees (A B A B) on one machine and compare
the rows. Used for BATCH_OF_ONE / ANGLE_SCALE (`Variant`): the sbhd points of batch 1 whose
tiles they change, the fused QKV, Hugging Face's view (bshd of batch 1) and a thd point as a
control (its code unchanged); for the thd tile rules; and for where one-head tiles of TE's
table check that both pair members share their angles (artifacts/tiles/). Without the peers
on the path, only our two paths and the copies.
"""
import json
import os
import sys

NAMES = ["MLA-k-rope-128K", "h2-d64-64K", "8B-TP8-k-64K", "8B-TP1-k-8K", "d64-h32-16K",
         "MLA-q-rope-4K", "8B-TP1-q-8K", "d80-h32-16K", "hf-view-q-8K", "qkv-8B-TP1-8K",
         "thd-2048x64-h8"]
# Shapes beside the models points: the thd_empty_sequences sweep's without its empty sequences,
# and two packed points' tokens as one sbhd sequence (batch 1: no search of cu_seqlens).
EXTRA_POINTS = {p["name"]: p for p in [
    dict(name="thd-16x2048-h32", layout="thd", seqs=16, seq_len=2048, heads=32, d=128),
    dict(name="sbhd-128K-h8", layout="sbhd", tokens=131072, heads=8, d=128),     # thd-2048x64-h8
    dict(name="sbhd-16K-h32", layout="sbhd", tokens=16384, heads=32, d=128),     # thd-mixed-16K-h32
    # Packed tokens narrower than a search tile, beside thd-2048x64-h8, thd-4096x32-h8 and
    # thd-2048x64-h1: lengths that the search's guess misses, and fewer or smaller heads.
    dict(name="thd-lognormal-32K-h8", layout="thd", tokens=32768, min_len=8, max_len=4096,
         lognormal=(5.5, 1.0), seed=0, heads=8, d=128),
    dict(name="thd-mixed-64K-h4", layout="thd", tokens=65536, min_len=16, max_len=1024, seed=0,
         heads=4, d=128),
    dict(name="thd-4096x32-h2-d64", layout="thd", seqs=4096, seq_len=32, heads=2, d=64),
    # One head per token (a TP 8 key, packed): sequence lengths and head dims beside the models
    # point thd-2048x64-h1, and two heads at its sequence length.
    dict(name="thd-4096x32-h1", layout="thd", seqs=4096, seq_len=32, heads=1, d=128),
    dict(name="thd-lognormal-128K-h1", layout="thd", tokens=131072, min_len=8, max_len=4096,
         lognormal=(5.5, 1.0), seed=0, heads=1, d=128),
    dict(name="thd-MLA-k-2048x64", layout="thd", seqs=2048, seq_len=64, heads=1, d=64,
         interleaved=True),
    dict(name="thd-2048x64-h2-d64", layout="thd", seqs=2048, seq_len=64, heads=2, d=64),
    # The same tokens at lognormal lengths, whose tiles the guess of one length misses.
    dict(name="thd-lognormal-128K-MLA-k", layout="thd", tokens=131072, min_len=8, max_len=4096,
         lognormal=(5.5, 1.0), seed=0, heads=1, d=64, interleaved=True),
    dict(name="thd-lognormal-64K-h2-d64", layout="thd", tokens=65536, min_len=8, max_len=4096,
         lognormal=(5.5, 1.0), seed=0, heads=2, d=64),
]}


def point(name):
    """One of EXTRA_POINTS or a models point, by name: from the tree's rope_bench_report, or,
    for a point added to `models` after the tree's commit, from this checkout's."""
    from rope_bench_report import MODEL_POINT_BY_NAME
    if name in EXTRA_POINTS or name in MODEL_POINT_BY_NAME:
        return EXTRA_POINTS.get(name) or MODEL_POINT_BY_NAME[name]
    import importlib.util
    checkout = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                            "rope_bench_report.py")
    spec = importlib.util.spec_from_file_location("checkout_rope_bench_report", checkout)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report.MODEL_POINT_BY_NAME[name]


def main():
    tree = os.path.abspath(sys.argv[1])
    sys.path.insert(0, tree)
    import rope_bench as B
    assert os.path.dirname(B.__file__) == tree, B.__file__
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else NAMES
    results = []
    B._run_models(sys.argv[3].split(","), ["forward_kernel", "backward_kernel"], results, {},
                  points=[point(n) for n in names], progress=f"[{os.path.basename(tree)}]")
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
