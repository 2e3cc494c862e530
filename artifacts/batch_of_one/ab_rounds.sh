#!/usr/bin/env bash
# Rounds of batch_of_one_ab.py over source trees, alternating (A B C A B C ...), up to six rounds,
# stopping before a round whose process would pass BUDGET_S seconds (judged by that tree's last
# process). Run from the repository root on the GPU machine:
#
#   bash artifacts/batch_of_one/ab_rounds.sh OUT POINTS DTYPES BUDGET_S TREE...
#   python artifacts/batch_of_one/ab_medians.py OUT/ab.log        # the medians table
#
# OUT gets ab.log (every process's console output, with "== round R TREE" headers), one JSON of
# rows per tree and round, and gpu.txt.
set -u
OUT=$1; POINTS=$2; DTYPES=$3; BUDGET=$4; shift 4
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" >> "$OUT/gpu.txt"
start=$(date +%s)
declare -A took
for round in 1 2 3 4 5 6; do
  for tree in "$@"; do
    name=$(basename "$tree")
    if [ $(( $(date +%s) - start + ${took[$name]:-0} )) -gt "$BUDGET" ]; then
      echo "stop before round $round of $name at $(( $(date +%s) - start )) s" | tee -a "$OUT/ab.log"
      exit 0
    fi
    echo "== round $round $name $(date +%T)" | tee -a "$OUT/ab.log"
    t0=$(date +%s)
    python3 artifacts/batch_of_one/batch_of_one_ab.py "$tree" "$OUT/${name}_$round.json" "$DTYPES" "$POINTS" \
      >> "$OUT/ab.log" 2>&1 || echo "rc $? $name $round" | tee -a "$OUT/ab.log"
    took[$name]=$(( $(date +%s) - t0 ))
    echo "   took ${took[$name]} s" | tee -a "$OUT/ab.log"
  done
done
