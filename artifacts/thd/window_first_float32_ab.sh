#!/usr/bin/env bash
# A/B of SEARCH_WINDOW_FIRST_FLOAT32_TOKEN (triton_rotary_launch.py) on a GPU, float32, angles
# from positions: off (one-head tiles that read the guessed window take no shortcut) and
# noguess (one-head tokens of more than 256 bytes go without the guessed window, so that they
# take the checked guess's shortcut) against the rule (tokens of at most 256 bytes find the
# first token's sequence in the window), at MLA's key (256 bytes) and one head of d 128 (512
# bytes), uniform and lognormal lengths (artifacts/batch_of_one/ab_off_against_rule.sh). From
# the repository root, on the GPU machine:
#
#   bash artifacts/thd/window_first_float32_ab.sh OUT [BUDGET_S]
#
# artifacts/thd/window_first_float32_ab_h200.log holds the run that set the rule.
set -eu
POINTS=thd-MLA-k-2048x64,thd-lognormal-128K-MLA-k,thd-2048x64-h1,thd-4096x32-h1
POINTS=$POINTS,thd-lognormal-128K-h1
GUESS="        or (shape.nheads == 1 and 0 < rule.search_guess_one_head_token <= token_bytes))"
NO_WIDE_FLOAT32_GUESS="        or (shape.nheads == 1 and 0 < rule.search_guess_one_head_token <= token_bytes and (t.element_size() != 4 or token_bytes <= 256)))"
bash artifacts/batch_of_one/ab_off_against_rule.sh "$1" "${2:-420}" fp32 "$POINTS" \
  triton_rotary_launch.py "SEARCH_WINDOW_FIRST_FLOAT32_TOKEN = 256" \
  "SEARCH_WINDOW_FIRST_FLOAT32_TOKEN = 0" noguess "$GUESS" "$NO_WIDE_FLOAT32_GUESS"
