#!/usr/bin/env bash
# The GPU session script: install, run the GPU test suite, benchmark; results under $OUT.
# Usage on the device machine: bash scripts/gpu_check.sh [tests|bench|sweep|all] [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/solattn-out}
mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "WARNING: Running pip" | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee -a "$OUT/env.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest tests -q -p no:cacheprovider -rfE "$@" 2>&1 | tee "$OUT/tests.txt" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [[ $what == sweep ]]; then
  python3 scripts/sweep_portable.py 2>&1 | tee "$OUT/sweep.txt"
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m solattn.cli bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" | tail -30
fi
exit $rc
