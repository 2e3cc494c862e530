#!/usr/bin/env bash
# A/B of SEARCH_ONE_SEQUENCE (triton_rotary_launch.py, off in the rule) on a GPU: two trees of
# this checkout's top-level sources, the second with the constant turned on, timed alternately
# by ab_rounds.sh (kernels alone, rope_bench's models timing) at the packed points and an sbhd
# control, then the medians table. From the repository root, on the GPU machine:
#
#   bash artifacts/thd/one_sequence_ab.sh OUT [BUDGET_S] [DTYPES]
#
# OUT gets the trees, ab_rounds.sh's files and medians.txt. artifacts/thd/one_sequence_sass.txt
# gives the SASS these tiles run with and without it.
set -eu
OUT=$1; BUDGET=${2:-360}; DTYPES=${3:-bf16,fp32}
POINTS=thd-2048x64-h1,thd-4096x32-h1,thd-lognormal-128K-h1,thd-MLA-k-2048x64,thd-2048x64-h2-d64
POINTS=$POINTS,thd-2048x64-h8,thd-4096x32-h8,thd-mixed-16K-h32,thd-lognormal-32K-h16
POINTS=$POINTS,VLM-7B-k-thd-8x8K,VLM-7B-q-thd-8x8K,8B-TP8-k-64K
mkdir -p "$OUT/trees/rule" "$OUT/trees/one_sequence"
cp ./*.py "$OUT/trees/rule/"
cp ./*.py "$OUT/trees/one_sequence/"
sed -i 's/^SEARCH_ONE_SEQUENCE = False$/SEARCH_ONE_SEQUENCE = True/' \
  "$OUT/trees/one_sequence/triton_rotary_launch.py"
grep -q '^SEARCH_ONE_SEQUENCE = True$' "$OUT/trees/one_sequence/triton_rotary_launch.py"
bash artifacts/batch_of_one/ab_rounds.sh "$OUT/ab" "$POINTS" "$DTYPES" "$BUDGET" \
  "$OUT/trees/rule" "$OUT/trees/one_sequence"
python3 artifacts/batch_of_one/ab_medians.py "$OUT/ab/ab.log" | tee "$OUT/medians.txt"
