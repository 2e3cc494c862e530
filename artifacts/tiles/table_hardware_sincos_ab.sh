#!/usr/bin/env bash
# A/B of the hardware sin/cos that TE's table takes for 16-bit data (`_rotation_from_table`,
# HARDWARE_SINCOS) on a GPU: off (the polynomials for every dtype) against the rule, kernels
# alone at the points where one or two heads per token leave sin/cos a large share of the
# work and controls of many heads (artifacts/batch_of_one/ab_off_against_rule.sh), then the
# accuracy of both trees (table_accuracy.py). From the repository root, on the GPU machine:
#
#   bash artifacts/tiles/table_hardware_sincos_ab.sh OUT [BUDGET_S] [DTYPES]
#
# OUT gets the trees, ab_rounds.sh's files, medians.txt and accuracy.txt.
# artifacts/tiles/table_hardware_sincos_ab_h200.log holds the run that set the rule (its
# accuracy was taken before the timing).
set -eu
OUT=$1
POINTS=thd-2048x64-h1,thd-4096x32-h1,thd-lognormal-128K-h1,thd-MLA-k-2048x64,thd-2048x64-h2-d64
POINTS=$POINTS,8B-TP8-k-64K,MLA-k-rope-128K,h2-d64-64K,8B-TP1-q-8K,qkv-8B-TP1-8K
bash artifacts/batch_of_one/ab_off_against_rule.sh "$OUT" "${2:-370}" "${3:-bf16,fp32}" \
  "$POINTS" triton_rotary_kernel.py \
  "    HARDWARE_SINCOS: tl.constexpr = data_dtype.primitive_bitwidth == 16" \
  "    HARDWARE_SINCOS: tl.constexpr = False"
python3 artifacts/tiles/table_accuracy.py "$OUT/trees/off" "$OUT/trees/rule" | tee "$OUT/accuracy.txt"
