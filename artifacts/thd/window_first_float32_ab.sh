#!/usr/bin/env bash
# A/B of SEARCH_WINDOW_FIRST_FLOAT32_TOKEN (triton_rotary_launch.py) on a GPU: off (float32
# one-head tiles with angles from positions that read the guessed window take no shortcut)
# against the rule (tokens of at most 256 bytes find the first token's sequence in the
# window), float32, at MLA's key (256 bytes) and one head of d 128 (512 bytes, which the rule
# leaves as it was), uniform and lognormal lengths (artifacts/batch_of_one/ab_off_against_rule.sh).
# From the repository root, on the GPU machine:
#
#   bash artifacts/thd/window_first_float32_ab.sh OUT [BUDGET_S]
#
# artifacts/thd/window_first_float32_ab_h200.log holds the run that set the rule.
set -eu
POINTS=thd-MLA-k-2048x64,thd-lognormal-128K-MLA-k,thd-2048x64-h1
bash artifacts/batch_of_one/ab_off_against_rule.sh "$1" "${2:-240}" fp32 "$POINTS" \
  triton_rotary_launch.py "SEARCH_WINDOW_FIRST_FLOAT32_TOKEN = 256" \
  "SEARCH_WINDOW_FIRST_FLOAT32_TOKEN = 0"
