#!/usr/bin/env bash
# A/B of one launch-rule or kernel choice on a GPU: two trees of this checkout's top-level
# sources, "off" with one line of FILE replaced (FROM by TO, each a whole line) and "rule" as
# they are, timed alternately by ab_rounds.sh (kernels alone, rope_bench's models timing) at
# POINTS in DTYPES within BUDGET_S seconds, then the medians table. From the repository root:
#
#   bash artifacts/batch_of_one/ab_off_against_rule.sh OUT BUDGET_S DTYPES POINTS FILE FROM TO \
#     [NAME FROM TO]...
#
# Each further NAME FROM TO adds a tree NAME, with FROM replaced by TO in FILE, to the rounds.
# OUT gets the trees, ab_rounds.sh's files under OUT/ab and medians.txt. The scripts beside
# the A/B logs (artifacts/thd/, artifacts/tiles/) call it with their choice's line.
set -eu
OUT=$1; BUDGET=$2; DTYPES=$3; POINTS=$4; FILE=$5
shift 5
mkdir -p "$OUT/trees/rule"
cp ./*.py "$OUT/trees/rule/"
trees=("$OUT/trees/off")
name=off
while [ $# -ge 2 ]; do
  tree=$OUT/trees/$name
  mkdir -p "$tree"
  cp ./*.py "$tree/"
  python3 - "$tree/$FILE" "$1" "$2" <<'PY'
import sys
path, old, new = sys.argv[1:]
lines = open(path).read().split("\n")
assert lines.count(old) == 1, f"{path}: {lines.count(old)} lines are {old!r}"
open(path, "w").write("\n".join(new if line == old else line for line in lines))
PY
  shift 2
  if [ $# -ge 1 ]; then name=$1; trees+=("$OUT/trees/$name"); shift; fi
done
bash artifacts/batch_of_one/ab_rounds.sh "$OUT/ab" "$POINTS" "$DTYPES" "$BUDGET" \
  "${trees[@]}" "$OUT/trees/rule"
python3 artifacts/batch_of_one/ab_medians.py "$OUT/ab/ab.log" | tee "$OUT/medians.txt"
