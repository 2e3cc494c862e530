"""A/B of source trees on four of the QK-norm bench's points, our two lines only (angles from
positions, `ours`, and TE's table, `ours_table`), one tree per process:

    python artifacts/qknorm/batch_of_one_norm_backward_ab.py TREE OUT

TREE is a folder holding the repository's top-level sources (`git show REV:FILE` of each), or
the checkout itself; OUT gets the bench's qknorm.json, .log and .png. Run it alternately for the
trees (A B A B) on one machine and compare the lines. Used for whether the norm backward's tiles
of a batch of one should find their sequence without a division (`Variant.BATCH_OF_ONE`).
"""
import os
import sys

tree, out = (os.path.abspath(a) for a in sys.argv[1:3])
os.chdir(tree)                      # the bench imports the sources of its working directory
sys.argv = [sys.argv[0], out, *sys.argv[3:]]     # --dry-run passes through
sys.path.insert(0, tree)
import rope_qknorm_bench as Q  # noqa: E402

assert os.path.dirname(Q.__file__) == tree, Q.__file__
POINTS = {"Qwen3-8B": (8192,), "Qwen3-8B-TP8": (16384,), "Gemma-3-12B": (16384,),
          "OLMo-2-7B": (16384,)}
Q.MODELS = [dict(m, tokens=POINTS[m["model"]]) for m in Q.MODELS if m["model"] in POINTS]
Q.LINES = ["copy", "ours", "ours_table"]
Q.main()
