#!/bin/bash
# Condense compute-sanitizer racecheck reports ($@) into: summary line, hazard count per
# (kind, address, access), and the first full hazard block of each file.
for f in "$@"; do
  echo "=== $f"
  grep "RACECHECK SUMMARY" "$f"
  grep -oE "(Error|Warning): Race reported between .*|(Read|Write) access at .* in .*|Current Value .*|at 0x[0-9a-f]+ in [^ ]+" "$f" \
    | sed -E 's/\[[0-9]+ threads?\]//' | sort | uniq -c | sort -rn | head -20
  awk '/Race reported/{n++} n==1' "$f" | head -40
done
