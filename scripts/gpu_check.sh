#!/usr/bin/env bash
# The GPU session script: install, run the GPU test suite, benchmark; logs under $OUT.
#   bash scripts/gpu_check.sh [tests|bench|suite|race|ladder|benchsweep|readme|all]
# ladder: `solattn bench --ladder` (seeds' ladder table; $OUT/ladder.{txt,json}).
# suite: `solattn bench --suite ${SUITES:-features} ${BENCH_ARGS}` ($OUT/suite.{txt,json});
#   `solattn bench --list` names the suites.
# benchsweep: `solattn bench --sweep ${SWEEP_ARGS}` into a scratch dir, tarred to $OUT/sweep.tgz.
# readme: ladder, then a --quick sweep into $OUT/sweep (8 files in $OUT in all), the sweep capped
#   so that the whole script ends within README_BUDGET_S seconds (default 540: one 10-min call).
# Test files run as parallel pytest processes on the one GPU: the suite's wall time is Triton's
# JIT compilation (CPU-bound, one process per file group uses the machine's cores).
# TESTS_TIMEOUT_S caps each group (SIGINT: pytest still prints what passed and failed); the
# device returns at most 8 files, so tar $OUT when running several modes in one call.
set -uo pipefail
OUT=${OUT:-/tmp/solattn-out}
mkdir -p "$OUT"
what=${1:-all}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "WARNING: Running pip" | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a "$OUT/env.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  groups=("tests/test_forward.py tests/test_sinks.py" "tests/test_backward.py" \
          "tests/test_kvcache.py tests/test_combine.py tests/test_compile.py tests/test_paged_varlen.py" \
          "tests/test_hopper.py tests/test_validation.py tests/test_reference.py tests/test_masking.py tests/test_backends.py" \
          "tests/test_bench.py tests/test_ladder.py tests/test_dropout.py" \
          "tests/test_flex.py::test_hopper_flex_forward tests/test_flex.py::test_matches_torch_flex_attention" \
          "tests/test_flex.py --deselect tests/test_flex.py::test_hopper_flex_forward \
           --deselect tests/test_flex.py::test_matches_torch_flex_attention" \
          "tests/test_warmup.py tests/test_aot.py" \
          "tests/test_transformers.py" \
          "tests/test_hopper_backward.py tests/test_ring_attention.py tests/test_launch.py" \
          "tests/test_fp8.py")
  pids=()
  for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    timeout -s INT "${TESTS_TIMEOUT_S:-0}" python3 -m pytest ${groups[$i]} -q \
      -p no:cacheprovider -rfE > "$OUT/tests_$i.txt" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "== ${groups[$i]}: $(tail -1 "$OUT/tests_$i.txt")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests_$i.txt" | head -20
  done
fi
if [[ $what == suite ]]; then
  # shellcheck disable=SC2086
  python3 -m solattn.cli bench --suite "${SUITES:-features}" --json "$OUT/suite.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/suite.txt" | grep -v "^  verify" | tail -60
fi
if [[ $what == race ]]; then
  # racecheck control (a warp-specialized kernel with no shared memory of its own), then the
  # forward on a small shape; full reports under $OUT
  san=/usr/local/cuda/bin/compute-sanitizer
  for flag in "" --barrier; do
    timeout 120 $san --tool racecheck --racecheck-report all python3 tools/ws_race_probe.py \
      $flag > "$OUT/race_ws_probe$flag.txt" 2>&1
    echo "ws probe $flag: $(grep -E 'RACECHECK SUMMARY|correct' "$OUT/race_ws_probe$flag.txt" | tr '\n' ' ')"
  done
  OUT=$OUT timeout 300 bash tools/hopper_race.sh
fi
if [[ $what == ladder || $what == readme ]]; then
  python3 -m solattn.cli bench --ladder --out "$OUT" > "$OUT/ladder.txt" 2>&1 || rc=1
  grep -vE "^(\[|  verify)" "$OUT/ladder.txt" | tail -60
fi
if [[ $what == readme ]]; then
  left=$(( ${README_BUDGET_S:-540} - SECONDS - 60 ))
  minutes=$(python3 -c "print(max(1.0, $left / 60))")
  python3 -m solattn.cli bench --sweep --quick --out "$OUT/sweep" --max-minutes "$minutes" \
    > "$OUT/sweep.txt" 2>&1 || rc=1
  grep -vE "^(\[|  verify)" "$OUT/sweep.txt" | tail -60
fi
if [[ $what == benchsweep ]]; then
  dir=$(mktemp -d)/sweep
  # shellcheck disable=SC2086
  python3 -m solattn.cli bench --sweep ${SWEEP_ARGS:-} --out "$dir" > "$dir.txt" 2>&1 || rc=1
  cp "$dir.txt" "$OUT/sweep.txt"
  tar czf "$OUT/sweep.tgz" -C "$(dirname "$dir")" sweep sweep.txt
  grep -vE "^(\[|  verify)" "$OUT/sweep.txt" | tail -60
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m solattn.cli bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" | grep -v "^  verify" | tail -45
fi
exit $rc
