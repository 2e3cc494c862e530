#!/usr/bin/env bash
# A/B of SEARCH_ONE_SEQUENCE (triton_rotary_launch.py) on a GPU: two trees of this checkout's
# top-level sources, the first with the constant turned off, the second as they are, timed
# alternately by ab_rounds.sh (kernels alone, rope_bench's models timing) at packed points of
# narrow tokens (uniform and lognormal lengths), a wide-token point and an sbhd control, then
# the medians table. From the repository root, on the GPU machine:
#
#   bash artifacts/thd/one_sequence_ab.sh OUT [BUDGET_S] [DTYPES]
#
# OUT gets the trees, ab_rounds.sh's files and medians.txt (tar OUT before it comes back: more
# than 8 files). artifacts/thd/one_sequence_ab_h200.log holds the runs that set the rule;
# artifacts/thd/one_sequence_sass.txt the SASS these tiles run with and without it.
set -eu
POINTS=thd-MLA-k-2048x64,thd-lognormal-128K-MLA-k,thd-2048x64-h2-d64,thd-lognormal-64K-h2-d64
POINTS=$POINTS,thd-2048x64-h1,thd-lognormal-128K-h1,thd-2048x64-h8,8B-TP8-k-64K
bash artifacts/batch_of_one/ab_off_against_rule.sh "$1" "${2:-360}" "${3:-bf16,fp32}" \
  "$POINTS" triton_rotary_launch.py "SEARCH_ONE_SEQUENCE = True" "SEARCH_ONE_SEQUENCE = False"
