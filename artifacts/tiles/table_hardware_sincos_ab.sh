#!/usr/bin/env bash
# A/B of the hardware sin/cos that TE's table takes for 16-bit data (`_rotation_from_table`,
# HARDWARE_SINCOS) on a GPU: two trees of this checkout's top-level sources, the first with
# the polynomials for every dtype, the second as they are; first the accuracy of both
# (table_accuracy.py), then the kernels alone, timed alternately by ab_rounds.sh at the points
# where one or two heads per token leave sin/cos a large share of the work, and controls of
# many heads. From the repository root, on the GPU machine:
#
#   bash artifacts/tiles/table_hardware_sincos_ab.sh OUT [BUDGET_S] [DTYPES]
#
# OUT gets the trees, ab_rounds.sh's files, accuracy.txt and medians.txt.
# artifacts/tiles/table_hardware_sincos_ab_h200.log holds the run that set the rule.
set -eu
OUT=$1; BUDGET=${2:-370}; DTYPES=${3:-bf16,fp32}
POINTS=thd-2048x64-h1,thd-4096x32-h1,thd-lognormal-128K-h1,thd-MLA-k-2048x64,thd-2048x64-h2-d64
POINTS=$POINTS,8B-TP8-k-64K,MLA-k-rope-128K,h2-d64-64K,8B-TP1-q-8K,qkv-8B-TP1-8K
mkdir -p "$OUT/trees/polynomials" "$OUT/trees/rule"
cp ./*.py "$OUT/trees/polynomials/"
cp ./*.py "$OUT/trees/rule/"
sed -i 's/^    HARDWARE_SINCOS: tl.constexpr = data_dtype.primitive_bitwidth == 16$/    HARDWARE_SINCOS: tl.constexpr = False/' \
  "$OUT/trees/polynomials/triton_rotary_kernel.py"
grep -q '^    HARDWARE_SINCOS: tl.constexpr = False$' "$OUT/trees/polynomials/triton_rotary_kernel.py"
python3 artifacts/tiles/table_accuracy.py "$OUT/trees/polynomials" "$OUT/trees/rule" | tee "$OUT/accuracy.txt"
bash artifacts/batch_of_one/ab_rounds.sh "$OUT/ab" "$POINTS" "$DTYPES" "$BUDGET" \
  "$OUT/trees/polynomials" "$OUT/trees/rule"
python3 artifacts/batch_of_one/ab_medians.py "$OUT/ab/ab.log" | tee "$OUT/medians.txt"
