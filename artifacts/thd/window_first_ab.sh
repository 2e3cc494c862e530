#!/usr/bin/env bash
# A/B of SEARCH_WINDOW_FIRST (triton_rotary_launch.py) on a GPU: off (16-bit one-head tiles
# that read the guessed window then take the checked guess with TE's table and no shortcut
# with angles from positions) against the rule, at packed points of one head per token,
# uniform and lognormal lengths (artifacts/batch_of_one/ab_off_against_rule.sh). From the
# repository root, on the GPU machine:
#
#   bash artifacts/thd/window_first_ab.sh OUT [BUDGET_S] [DTYPES]
#
# artifacts/thd/window_first_ab_h200.log holds the runs that set the rule.
set -eu
POINTS=thd-2048x64-h1,thd-4096x32-h1,thd-lognormal-128K-h1,thd-MLA-k-2048x64
POINTS=$POINTS,thd-lognormal-128K-MLA-k
bash artifacts/batch_of_one/ab_off_against_rule.sh "$1" "${2:-360}" "${3:-bf16,fp16,fp32}" \
  "$POINTS" triton_rotary_launch.py "SEARCH_WINDOW_FIRST = True" "SEARCH_WINDOW_FIRST = False"
