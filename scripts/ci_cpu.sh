#!/usr/bin/env bash
# CI on a machine without a CUDA GPU (`make test` there; `.ci/run`): the interpreter suite and
# the AOT check on two stacks, each in a venv that scripts/ci_env.sh caches under
# $SOLATTN_CI_CACHE, then a table of the stages' times.
#
#   scripts/ci_cpu.sh          every stage
#   scripts/ci_cpu.sh latest   the newest stack's stages only (`make test-latest`)
#
# The pinned stack (constraints.txt: torch 2.11 + triton 3.6, the GPU machine's) runs the CPU
# selection of the suite: every test, with the parametrized cases that run the same kernel code
# as a kept one deselected (the `gpu_grid` marker, tests/conftest.py). The newest stack
# (constraints-latest.txt) runs LATEST_TESTS below. `solattn aot` compiles every kernel for
# sm_90 and sm_80 with each stack's Triton (its results are cached by content under
# $SOLATTN_CI_CACHE/aot). The first failing stage ends the run with its exit status; the table
# is printed either way.
set -euo pipefail
cd "$(dirname "$0")/.."
export SOLATTN_CI_CACHE=${SOLATTN_CI_CACHE:-$HOME/.cache/solattn-ci}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the venvs hold no solattn: run this clone
PYTEST_ARGS=(-q -p no:cacheprovider)
# The newest stack: the files whose code depends on the Triton/torch/transformers version (the
# kernels' builders and launchers, the Gluon compat layer, the integrations) in their CPU
# selection, plus one backward grid test that covers every backward kernel strategy. The Hopper
# AOT test is left to the `latest aot` stage, which compiles every kernel under the newest Triton.
LATEST_TESTS=(
  tests/test_forward.py tests/test_kvcache.py tests/test_paged_varlen.py tests/test_flex.py
  tests/test_transformers.py tests/test_compile.py tests/test_launch.py tests/test_hopper.py
  tests/test_hopper_backward.py tests/test_validation.py tests/test_flash_attn_api.py
  tests/test_sdpa_mask.py tests/test_warmup.py tests/test_aot.py tests/test_backends.py
  tests/test_backward.py::test_grad_every_kernel_strategy
  --deselect tests/test_hopper.py::test_aot_compiles_for_sm90
)

names=() secs=() notes=()
table() {
  local i total=0
  echo
  printf '%-14s %8s  %s\n' stage time result
  for i in "${!names[@]}"; do
    printf '%-14s %5dm%02ds  %s\n' "${names[i]}" $((secs[i] / 60)) $((secs[i] % 60)) "${notes[i]}"
    total=$((total + secs[i]))
  done
  printf '%-14s %5dm%02ds\n' total $((total / 60)) $((total % 60))
  echo "cache: $(du -sh "$SOLATTN_CI_CACHE" 2>/dev/null | cut -f1) in $SOLATTN_CI_CACHE"
  rm -f "$log"
}
log=$(mktemp)
trap table EXIT

# stage NAME CMD...: run CMD (its output tee'd to $log), record its time and pytest's closing
# line (or ok / exit status); stop at the first failure.
stage() {
  local name=$1 start=$SECONDS rc=0
  shift
  echo "== $name: $*" >&2
  "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  names+=("$name")
  secs+=($((SECONDS - start)))
  local summary
  summary=$(grep -E '^=* ?[0-9]+ [a-z]+.* in [0-9.]+s|no tests ran' "$log" | tail -n 1 |
    tr -d '=' | sed 's/^ *//; s/ *$//') || true
  if [ "$rc" = 0 ]; then
    notes+=("${summary:-ok}")
  else
    notes+=("FAILED (exit $rc)${summary:+: $summary}")
    exit "$rc"
  fi
}

# ci_env.sh prints the venv's python last
if [ "${1:-all}" != latest ]; then
  stage setup bash scripts/ci_env.sh constraints.txt
  PINNED_PY=$(tail -n 1 "$log")
  stage suite env TRITON_INTERPRET=1 "$PINNED_PY" -m pytest tests "${PYTEST_ARGS[@]}"
  stage aot "$PINNED_PY" -m solattn.cli aot --arch 90 --arch 80
fi
stage "latest venv" bash scripts/ci_env.sh constraints-latest.txt
LATEST_PY=$(tail -n 1 "$log")
stage "latest suite" env TRITON_INTERPRET=1 "$LATEST_PY" -m pytest "${LATEST_TESTS[@]}" \
  "${PYTEST_ARGS[@]}"
stage "latest aot" "$LATEST_PY" -m solattn.cli aot --arch 90 --arch 80
