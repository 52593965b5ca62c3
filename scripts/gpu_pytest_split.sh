#!/bin/bash
# Run a pytest file on the GPU in N parallel processes (compile-bound: Triton's JIT runs on the
# CPU), its collected tests dealt round robin. usage: gpu_pytest_split.sh FILE N [pytest args]
# (FILE may be a directory: the whole suite). SPLIT_TIMEOUT_S caps each process (SIGINT: pytest
# still reports what passed and failed before the cap).
file=$1; n=$2; shift 2
python -m pytest "$file" --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep "::" > /tmp/ids.txt
echo "collected $(wc -l < /tmp/ids.txt) tests in $n groups"
if [ ! -s /tmp/ids.txt ]; then  # (pytest given no ids would run the whole suite in each group)
    echo "no tests collected from '$file' (one file or directory)"; exit 1
fi
for i in $(seq 0 $((n - 1))); do
    awk -v n="$n" -v i="$i" 'NR % n == i' /tmp/ids.txt > /tmp/ids_$i.txt
    mapfile -t ids < /tmp/ids_$i.txt  # one argument per test id (ids may contain spaces)
    timeout -s INT "${SPLIT_TIMEOUT_S:-0}" python -m pytest -q -p no:cacheprovider -rfE \
        "${ids[@]}" > /tmp/pytest_$i.log 2>&1 &
done
wait
for i in $(seq 0 $((n - 1))); do tail -n 1 /tmp/pytest_$i.log; grep -E "^(FAILED|ERROR)" /tmp/pytest_$i.log; done
