#!/usr/bin/env bash
# flash-attention's own tests/test_flash_attn.py, unmodified, against solattn: a `flash_attn`
# stand-in package re-exports solattn's seven functions (flash-attn's bert_padding and rotary
# helpers beside it, taken as they are). Everything flash-attn's lives in the git-ignored
# .fa_tests/ folder (never committed):
#   .fa_tests/tests/test_flash_attn.py            flash-attention's file (FLASH_ATTN_COMMIT)
#   .fa_tests/flash_attn/{bert_padding,layers/rotary,ops/triton/rotary}.py   its helpers
#   .fa_tests/flash_attn/__init__.py, flash_attn_interface.py   the stand-in (solattn's functions)
#   .fa_tests/wheels/                             optional wheels (einops) to install first
# Runs a sample of the grid (every test function and parameter value; cases reading flash-attn's
# testing-only dropout matrix left out: tools/fa_sample_plugin.py) and prints pass/fail counts.
#
#   tools/flash_attn_tests.sh [N=600] [extra pytest args]     on a GPU machine
#   FA_SHARDS=12 tools/flash_attn_tests.sh 600               the same sample in 12 processes
#   FA_CPU=1 tools/flash_attn_tests.sh 8 -x                   dry run on the CPU (interpreter)
# Logs go to $OUT (or .fa_tests/) as flash_attn_tests.log and .xml.
set -uo pipefail
cd "$(dirname "$0")/.."
FA=.fa_tests
if [ ! -f "$FA/tests/test_flash_attn.py" ] || [ ! -f "$FA/flash_attn/__init__.py" ]; then
    echo "flash_attn_tests: $FA/ is missing (see this script's header)" >&2
    exit 2
fi
N=${1:-600}
shift || true
LOG_DIR=${OUT:-$FA}
if ! python3 -c "import einops" 2>/dev/null; then
    python3 -m pip install -q --no-index "$FA"/wheels/einops-*.whl || {
        echo "flash_attn_tests: einops missing and no wheel in $FA/wheels" >&2; exit 2; }
fi
EXTRA=()
if [ -n "${FA_CPU:-}" ]; then
    export TRITON_INTERPRET=1
    EXTRA+=(--fa-cpu)
fi
export PYTHONPATH="$PWD/$FA:$PWD/tools:$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() {  # run NAME [pytest args]: one pytest process, its log as NAME.log/.xml
    local name=$1; shift
    python3 -m pytest "$FA/tests/test_flash_attn.py" -p fa_sample_plugin -p no:cacheprovider \
        --rootdir "$FA" --fa-sample "$N" "${EXTRA[@]}" -q -rN --tb=line \
        --junitxml "$LOG_DIR/$name.xml" "$@" > "$LOG_DIR/$name.log" 2>&1
}
SHARDS=${FA_SHARDS:-1}  # processes sharing the sample (each collects the whole grid first)
for i in $(seq 0 $((SHARDS - 1))); do
    if [ "$SHARDS" = 1 ]; then run flash_attn_tests "$@" & else
        run "flash_attn_tests_$i" --fa-shard "$i/$SHARDS" "$@" & fi
done
rc=0
for job in $(jobs -p); do wait "$job" || rc=1; done
cat "$LOG_DIR"/flash_attn_tests*.log \
    | grep -E "^fa_sample|^  test_|passed|failed|^[^ ]*Error" | tail -60
exit "$rc"
