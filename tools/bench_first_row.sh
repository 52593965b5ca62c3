#!/usr/bin/env bash
# Issue 40's check: `make bench`'s first timed rows, run cold (idle GPU clocks, empty Triton
# cache), against a warm repeat of the same command right after; prints both numbers per
# (row, peer) and whether the first row is within 3% of the warm repeat.
#
#   bash tools/bench_first_row.sh            (on a GPU machine, from the checkout's root)
#
# IDLE_S (default 30): seconds of idle GPU before the cold run, so the clocks drop as they do
# before a real first `make bench`. BENCH_ARGS (default: the anchors' forward table, 3 shapes)
# are passed to both runs. Logs and JSON under $OUT (default /tmp/solattn-first-row).
set -uo pipefail
OUT=${OUT:-/tmp/solattn-first-row}
mkdir -p "$OUT"
args=${BENCH_ARGS:---quick --sections fwd}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
TRITON_CACHE_DIR=$(mktemp -d)
export TRITON_CACHE_DIR
echo "idle for ${IDLE_S:-30} s (clocks drop), empty Triton cache $TRITON_CACHE_DIR"
sleep "${IDLE_S:-30}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
for run in cold warm; do
  start=$SECONDS
  # shellcheck disable=SC2086
  python3 -m solattn.cli bench $args --json "$OUT/$run.json" > "$OUT/$run.txt" 2>&1
  echo "$run run: exit $?, $((SECONDS - start)) s; $(grep -E '^(SM clock|warm-up)' "$OUT/$run.txt" | tr '\n' ' ')"
done
python3 - "$OUT/cold.json" "$OUT/warm.json" <<'PY'
import json
import sys

cold, warm = (json.load(open(p)) for p in sys.argv[1:3])
key = lambda r: (r["section"], r["name"], r["shape"])  # noqa: E731
warm_by = {key(r): r for r in warm["results"] if r.get("value")}
rows = [r for r in cold["results"] if r.get("value") and key(r) in warm_by]
if not rows:
    sys.exit("no row was timed in both runs: see cold.txt / warm.txt")
first_shape = rows[0]["shape"]
print(f"{'row':<40} {'peer':<18} {'cold':>8} {'warm':>8} {'cold/warm':>9}  spread cold/warm")
worst = 0.0
for r in rows:
    w = warm_by[key(r)]
    ratio = r["value"] / w["value"]
    first = r["shape"] == first_shape
    if first:
        worst = max(worst, abs(1 - ratio))
    sc, sw = (f"{100 * x['spread']:.1f}%" if x.get("spread") is not None else "-" for x in (r, w))
    print(f"{r['shape'] + (' (first)' if first else ''):<40} {r['name']:<18} {r['value']:8.1f} "
          f"{w['value']:8.1f} {ratio:9.3f}  {sc}/{sw}")
print(f"first row ({first_shape}): worst |cold/warm - 1| = {100 * worst:.1f}% -> "
      + ("PASS (within 3%)" if worst <= 0.03 else "FAIL (more than 3%)"))
PY
