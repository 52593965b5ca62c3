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
# The newest stack: whole, the files whose code leans on the torch / Triton / transformers API
# (the transformers backend, torch.compile and the custom ops, SDPA masks, the launchers, the
# Gluon compat layer's CPU checks, AOT and backend selection, validation), and one test per
# kernel family (forward, backward strategies, decode and splits, paged, flex codegen, dropout)
# in its CPU selection. The Hopper AOT test is left to the `latest aot` stage, which compiles
# every kernel under the newest Triton.
LATEST_TESTS=(
  tests/test_transformers.py tests/test_compile.py tests/test_sdpa_mask.py tests/test_launch.py
  tests/test_hopper.py tests/test_hopper_backward.py tests/test_aot.py tests/test_backends.py
  tests/test_validation.py
  tests/test_forward.py::test_features tests/test_forward.py::test_float32_output
  tests/test_backward.py::test_grad_every_kernel_strategy tests/test_backward.py::test_grad_lse
  tests/test_kvcache.py::test_everything_together tests/test_kvcache.py::test_split_counts_agree
  tests/test_paged_varlen.py::test_paged_forward
  tests/test_flex.py::test_catalogue tests/test_flex.py::test_dq_kernel
  tests/test_dropout.py::test_grads_match_oracle_with_the_kernel_mask
  --deselect tests/test_hopper.py::test_aot_compiles_for_sm90
)

# Every kernel for sm_90 and sm_80; a representative subset for the seeds' other GPUs (RTX 3090
# sm_86, RTX 4090 sm_89, B200 sm_100, RTX 5090 sm_120): `solattn aot --help`.
AOT_ARCHS=90,80,86,89,100,120

names=() secs=() cpus=() notes=()
mmss() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
table() {
  local i total=0 total_cpu=0
  echo
  printf '%-14s %8s %8s  %s\n' stage wall cpu result
  for i in "${!names[@]}"; do
    printf '%-14s %8s %8s  %s\n' "${names[i]}" "$(mmss "${secs[i]}")" "$(mmss "${cpus[i]}")" \
      "${notes[i]}"
    total=$((total + secs[i]))
    total_cpu=$((total_cpu + cpus[i]))
  done
  printf '%-14s %8s %8s\n' total "$(mmss $total)" "$(mmss $total_cpu)"
  echo "(cpu: user + sys seconds of the stage's processes; wall above it means the cores were shared)"
  echo "cache: $(du -sh "$SOLATTN_CI_CACHE" 2>/dev/null | cut -f1) in $SOLATTN_CI_CACHE"
  rm -f "$log" "$log.t"
}
log=$(mktemp)
trap table EXIT

# CPU=user + sys seconds of this shell's finished children (bash's `times`, second line; it must
# run in this shell, not in a $(...) subshell, whose children's times start at 0).
child_cpu() {
  times > "$log.t"
  CPU=$(tail -n 1 "$log.t" | awk '{ for (i = 1; i <= 2; i++) { split($i, t, /[ms]/);
    s += t[1] * 60 + t[2] } printf "%d\n", s }')
}

# stage NAME CMD...: run CMD (its output tee'd to $log), record its wall and CPU time and
# pytest's closing line (or ok / exit status); stop at the first failure.
stage() {
  local name=$1 start=$SECONDS cpu0 rc=0
  shift
  child_cpu
  cpu0=$CPU
  echo "== $name: $*" >&2
  "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  names+=("$name")
  secs+=($((SECONDS - start)))
  child_cpu
  cpus+=($((CPU - cpu0)))
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
  # test_aot_compiles_for_sm90 runs `solattn aot --only fwd_hopper`, which the aot stage runs
  # (with every other kernel) right after.
  stage suite env TRITON_INTERPRET=1 "$PINNED_PY" -m pytest tests "${PYTEST_ARGS[@]}" \
    --deselect tests/test_hopper.py::test_aot_compiles_for_sm90
  stage aot "$PINNED_PY" -m solattn.cli aot --arch "$AOT_ARCHS"
fi
stage "latest venv" bash scripts/ci_env.sh constraints-latest.txt
LATEST_PY=$(tail -n 1 "$log")
stage "latest suite" env TRITON_INTERPRET=1 "$LATEST_PY" -m pytest "${LATEST_TESTS[@]}" \
  "${PYTEST_ARGS[@]}"
stage "latest aot" "$LATEST_PY" -m solattn.cli aot --arch "$AOT_ARCHS"
