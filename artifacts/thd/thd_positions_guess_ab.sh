#!/bin/bash
# Make the two variant trees of thd_positions_guess_ab.py from this checkout and run base, V1,
# V2 in turn, ROUNDS times (default 2), one process each; print the AB lines.
set -e
ROUNDS=${ROUNDS:-2}
here=$PWD
for v in v1 v2; do rm -rf /tmp/ab_$v && mkdir -p /tmp/ab_$v && cp *.py /tmp/ab_$v/; done
python3 - <<'PY'
import re
for v in ("v1", "v2"):
    p = f"/tmp/ab_{v}/triton_rotary_launch.py"
    s = open(p).read()
    if v == "v1":
        old = "and (wide_positions or not source.from_positions)),"
        new = "and (wide_positions or not source.from_positions or shape.batch > 32)),"
    else:
        old = "wide_positions = lone_search and source.from_positions and ("
        new = "wide_positions = lone_search and source.from_positions and (shape.batch > 32 or "
    assert s.count(old) == 1, (v, old)
    open(p, "w").write(s.replace(old, new))
PY
for r in $(seq $ROUNDS); do
  for t in "$here base" "/tmp/ab_v1 v1" "/tmp/ab_v2 v2"; do
    set -- $t
    python3 artifacts/thd/thd_positions_guess_ab.py $1 $2 2>&1 | grep "^AB " | sed "s/^AB /round $r /"
  done
done
