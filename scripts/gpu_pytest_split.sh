#!/bin/bash
# Run a pytest file on the GPU in N parallel processes (compile-bound: Triton's JIT runs on the
# CPU), its collected tests dealt round robin. usage: gpu_pytest_split.sh FILE N [pytest args]
# (FILE may be a directory: the whole suite). SPLIT_TIMEOUT_S caps each process (SIGINT: pytest
# still reports what passed and failed before the cap, and the groups it cut are marked).
# SPLIT_PART=p/P runs part p of P of the collected ids (dealt round robin): the whole suite in P
# device calls.
file=$1; n=$2; shift 2
python -m pytest "$file" --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep "::" > /tmp/ids.txt
if [ -n "$SPLIT_PART" ]; then  # "p/P": only part p (1..P) of the ids, dealt round robin
    part=${SPLIT_PART%/*}; parts=${SPLIT_PART#*/}
    if ! [[ "$part" =~ ^[0-9]+$ && "$parts" =~ ^[0-9]+$ ]] || [ "$part" -lt 1 ] || [ "$part" -gt "$parts" ]; then
        echo "SPLIT_PART: expected p/P with 1 <= p <= P, got '$SPLIT_PART'"; exit 2
    fi
    awk -v P="$parts" -v p="$part" 'NR % P == p % P' /tmp/ids.txt > /tmp/ids_part.txt
    mv /tmp/ids_part.txt /tmp/ids.txt
    echo "part $SPLIT_PART of the collected ids"
fi
if [ ! -s /tmp/ids.txt ]; then  # (pytest given no ids would run the whole suite in each group)
    echo "no tests collected from '$file' (one file or directory)"; exit 1
fi
if [ "$(wc -l < /tmp/ids.txt)" -lt "$n" ]; then  # nor may a group be left without ids
    n=$(wc -l < /tmp/ids.txt)
fi
echo "collected $(wc -l < /tmp/ids.txt) tests in $n groups"
for i in $(seq 0 $((n - 1))); do
    awk -v n="$n" -v i="$i" 'NR % n == i' /tmp/ids.txt > /tmp/ids_$i.txt
    mapfile -t ids < /tmp/ids_$i.txt  # one argument per test id (ids may contain spaces)
    timeout -s INT "${SPLIT_TIMEOUT_S:-0}" python -m pytest -q -p no:cacheprovider -rfE \
        "${ids[@]}" > /tmp/pytest_$i.log 2>&1 &
done
wait
# Per group: pytest's summary line, marked when the cap cut the group short (pytest prints
# "KeyboardInterrupt" and the summary of what ran) or when the group printed no summary at all
# (then its ids are not accounted for: run them again); then the totals.
total=0; cut=0
for i in $(seq 0 $((n - 1))); do
    ids_i=$(wc -l < /tmp/ids_$i.txt)
    summary=$(grep -E "^[0-9]+ (passed|failed|skipped|error)|^no tests ran" /tmp/pytest_$i.log | tail -n 1)
    ran=$(echo "$summary" | grep -oE "[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed)" \
          | awk '{s += $1} END {print s + 0}')
    total=$((total + ran))
    if [ -z "$summary" ]; then
        echo "[$i] NO SUMMARY ($ids_i ids not accounted for: cut at the cap, or crashed; last line: $(tail -c 200 /tmp/pytest_$i.log | tail -n 1))"
        cut=$((cut + 1))
    elif grep -q "KeyboardInterrupt" /tmp/pytest_$i.log; then
        echo "[$i] $summary -- CUT AT THE CAP: $ran of $ids_i ids ran"
        cut=$((cut + 1))
    else
        echo "[$i] $summary"
    fi
    grep -E "^(FAILED|ERROR)" /tmp/pytest_$i.log
done
echo "ran $total of $(wc -l < /tmp/ids.txt) ids; $cut of $n groups cut short or without a summary"
