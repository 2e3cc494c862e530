#!/usr/bin/env bash
# A/B of SEARCH_WINDOW_FIRST (triton_rotary_launch.py) on a GPU: two trees of this checkout's
# top-level sources, the first with the constant turned off (16-bit one-head tiles that read
# the guessed window then take the checked guess with TE's table and no shortcut with angles
# from positions), the second as they are, timed alternately by ab_rounds.sh (kernels alone,
# rope_bench's models timing) at packed points of one head per token, uniform and lognormal
# lengths, then the medians table. From the repository root, on the GPU machine:
#
#   bash artifacts/thd/window_first_ab.sh OUT [BUDGET_S] [DTYPES]
#
# artifacts/thd/window_first_ab_h200.log holds the runs that set the rule.
set -eu
OUT=$1; BUDGET=${2:-360}; DTYPES=${3:-bf16,fp16,fp32}
POINTS=thd-2048x64-h1,thd-4096x32-h1,thd-lognormal-128K-h1,thd-MLA-k-2048x64
POINTS=$POINTS,thd-lognormal-128K-MLA-k
mkdir -p "$OUT/trees/off" "$OUT/trees/rule"
cp ./*.py "$OUT/trees/off/"
cp ./*.py "$OUT/trees/rule/"
sed -i 's/^SEARCH_WINDOW_FIRST = True$/SEARCH_WINDOW_FIRST = False/' \
  "$OUT/trees/off/triton_rotary_launch.py"
grep -q '^SEARCH_WINDOW_FIRST = False$' "$OUT/trees/off/triton_rotary_launch.py"
bash artifacts/batch_of_one/ab_rounds.sh "$OUT/ab" "$POINTS" "$DTYPES" "$BUDGET" \
  "$OUT/trees/off" "$OUT/trees/rule"
python3 artifacts/batch_of_one/ab_medians.py "$OUT/ab/ab.log" | tee "$OUT/medians.txt"
