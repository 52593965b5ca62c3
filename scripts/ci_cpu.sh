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
# sm_90 and sm_80 (a representative subset for the other seed GPUs) with each stack's Triton; its
# results are cached per kernel by the kernel's sources under $SOLATTN_CI_CACHE/aot
# (solattn/aot_cache.py), so a run compiles only the kernels whose code changed.
#
# Two lanes use the two cores (after `setup`, which both need):
#   lane 1: suite (the pinned stack's pytest, the longest stage: one core all the way)
#   lane 2: latest venv, latest suite, aot, latest aot (the AOT stages with one compile
#           process per core: they share the cores with lane 1, and take both once it is done)
# Each stage's output goes to its own log, printed whole at the end; a lane stops at its first
# failing stage, the other lane runs on. The table (start, wall and CPU time per stage, pytest's
# closing line) is printed either way, and the exit status is the first failing stage's.
set -euo pipefail
cd "$(dirname "$0")/.."
export SOLATTN_CI_CACHE=${SOLATTN_CI_CACHE:-$HOME/.cache/solattn-ci}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the venvs hold no solattn: run this clone
work=$(mktemp -d)
PYTEST_ARGS=(-q -p no:cacheprovider)
# The newest stack: whole, the files whose code leans on the torch / Triton / transformers API
# (the transformers backend, torch.compile and the custom ops, SDPA masks, the launchers, the
# Gluon compat layer's CPU checks, AOT, the warmup's stand-in driver and kernel list, backend
# selection, validation), and one test per
# kernel family (forward, backward strategies, decode and splits, paged, flex codegen, dropout)
# in its CPU selection. The Hopper AOT test is left to the `latest aot` stage, which compiles
# every kernel under the newest Triton.
LATEST_TESTS=(
  tests/test_transformers.py tests/test_compile.py tests/test_sdpa_mask.py tests/test_launch.py
  tests/test_hopper.py tests/test_hopper_backward.py tests/test_aot.py tests/test_backends.py
  tests/test_validation.py tests/test_warmup.py
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

mmss() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# One record per finished stage in $work/records: start, wall, cpu, rc, name, result (tabs).
table() {
  local total_cpu=0 start secs cpu rc name note
  touch "$work/records"
  while IFS=$'\t' read -r start secs cpu rc name note; do  # the logs, in the stages' order
    echo
    echo "=============== $name: $note ==============="
    cat "$work/${name// /_}.log"
  done < <(sort -n "$work/records")
  echo
  printf '%-14s %6s %8s %8s  %s\n' stage start wall cpu result
  while IFS=$'\t' read -r start secs cpu rc name note; do
    printf '%-14s %6s %8s %8s  %s\n' "$name" "$(mmss "$start")" "$(mmss "$secs")" \
      "$(mmss "$cpu")" "$note"
    total_cpu=$((total_cpu + cpu))
  done < <(sort -n "$work/records")
  printf '%-14s %6s %8s %8s\n' total "" "$(mmss $SECONDS)" "$(mmss $total_cpu)"
  echo "(start: minutes into the run; two lanes run at once, so the total's wall is the run's"
  echo " and its cpu the stages' sum; cpu: user + sys seconds of the stage's processes, so a"
  echo " dedicated 2-core machine needs about the larger of the longest lane's cpu and half the"
  echo " total cpu)"
  echo "cache: $(du -sh "$SOLATTN_CI_CACHE" 2>/dev/null | cut -f1) in $SOLATTN_CI_CACHE"
  rm -rf "$work"
}
trap table EXIT

# CPU=user + sys seconds of this shell's finished children (bash's `times`, second line; it must
# run in the shell that ran the stage, not in a $(...) subshell, whose children's times start at
# 0). Each lane is its own subshell, so each counts its own stages.
child_cpu() {
  local out=$work/times.$BASHPID  # this lane's own file ($BASHPID differs inside $(...))
  times > "$out"
  CPU=$(tail -n 1 "$out" | awk '{ for (i = 1; i <= 2; i++) {
    split($i, t, /[ms]/); s += t[1] * 60 + t[2] } printf "%d\n", s }')
}

# stage NAME CMD...: run CMD with its output in $work/<NAME>.log (STAGE_LOG), record its start,
# wall and CPU time and pytest's closing line (or ok / exit status); return its exit status.
stage() {
  local name=$1 start=$SECONDS cpu0 rc=0 summary note
  shift
  STAGE_LOG=$work/${name// /_}.log
  child_cpu
  cpu0=$CPU
  echo "== $(mmss $SECONDS) $name: $*" >&2
  echo "\$ $*" > "$STAGE_LOG"
  "$@" >> "$STAGE_LOG" 2>&1 || rc=$?
  child_cpu
  summary=$(grep -E '^=* ?[0-9]+ [a-z]+.* in [0-9.]+s|no tests ran' "$STAGE_LOG" | tail -n 1 |
    tr -d '=' | sed 's/^ *//; s/ *$//') || true
  if [ "$rc" = 0 ]; then
    note=${summary:-ok}
  else
    note="FAILED (exit $rc)${summary:+: $summary}"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$start" $((SECONDS - start)) $((CPU - cpu0)) "$rc" \
    "$name" "$note" >> "$work/records"
  echo "== $(mmss $SECONDS) $name: $note ($(mmss $((SECONDS - start))))" >&2
  return "$rc"
}

# ci_env.sh prints the venv's python last
latest_venv() {
  stage "latest venv" bash scripts/ci_env.sh constraints-latest.txt || return
  LATEST_PY=$(tail -n 1 "$STAGE_LOG")
}
latest_suite() {
  stage "latest suite" env TRITON_INTERPRET=1 "$LATEST_PY" -m pytest "${LATEST_TESTS[@]}" \
    "${PYTEST_ARGS[@]}" --basetemp="$work/tmp-latest"
}
# One compile process per core (solattn aot's default); only kernels whose sources changed
# compile (the cache).
aot() {  # aot NAME PYTHON
  stage "$1" "$2" -m solattn.cli aot --arch "$AOT_ARCHS"
}

if [ "${1:-all}" != latest ]; then
  stage setup bash scripts/ci_env.sh constraints.txt
  PINNED_PY=$(tail -n 1 "$STAGE_LOG")
  # test_aot_compiles_for_sm90 runs `solattn aot --only fwd_hopper`, which the aot stage runs
  # (with every other kernel).
  ( stage suite env TRITON_INTERPRET=1 "$PINNED_PY" -m pytest tests "${PYTEST_ARGS[@]}" \
      --basetemp="$work/tmp-pinned" --deselect tests/test_hopper.py::test_aot_compiles_for_sm90
  ) &
  lane1=$!
  ( latest_venv && latest_suite && aot aot "$PINNED_PY" && aot "latest aot" "$LATEST_PY" ) &
  lane2=$!
else
  latest_venv
  ( latest_suite ) &
  lane1=$!
  ( aot "latest aot" "$LATEST_PY" ) &
  lane2=$!
fi
rc1=0 rc2=0
wait "$lane1" || rc1=$?
wait "$lane2" || rc2=$?
# the first failing stage's status (by start time)
first=$(sort -n "$work/records" | awk -F'\t' '$4 != 0 { print $4; exit }')
[ -z "$first" ] && [ "$rc1$rc2" != 00 ] && first=1
exit "${first:-0}"
