"""The medians table of an ab_rounds.sh run: per models point, dtype, kernel and path, the first
tree's median fraction of copy speed, then each other tree's median, its difference from the
first's and its min-max over the rounds, and the first tree's min-max.

    python artifacts/batch_of_one/ab_medians.py OUT/ab.log
"""
import re
import statistics
import sys

ROUND = re.compile(r"== round \d+ (\S+)")
ROW = re.compile(r"\s+models (\S+) (\S+) (\S+)_kernel (triton|triton_positions): \S+ ms, "
                 r"([\d.]+) of copy")


def main(path):
    rows, trees, tree = {}, [], None
    for line in open(path):
        if m := ROUND.match(line):
            tree = m.group(1)
            if tree not in trees:
                trees.append(tree)
        elif m := ROW.match(line):
            point, dtype, mode, provider, fraction = m.groups()
            rows.setdefault((point, dtype, mode, provider), {}).setdefault(tree, []).append(
                float(fraction))
    base = trees[0]
    for (point, dtype, mode, provider), by_tree in rows.items():
        path_name = "table" if provider == "triton" else "pos"
        first = statistics.median(by_tree[base])
        line = f"{point:<22} {dtype:<4} {mode:<8} {path_name:<5} {base} {first:.3f}"
        for other in trees[1:]:
            values = by_tree.get(other)
            if not values:
                continue
            med = statistics.median(values)
            line += (f"  {other} {med:.3f} ({med - first:+.3f}) "
                     f"[{min(values):.3f}-{max(values):.3f}]")
        print(line + f"  base[{min(by_tree[base]):.3f}-{max(by_tree[base]):.3f}]")


if __name__ == "__main__":
    main(sys.argv[1])
