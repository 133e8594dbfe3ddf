#!/usr/bin/env bash
# The README's test command (python -m pytest) N times (default 5), each beside two CPU-bound
# processes, so a verdict that depends on how busy the machine is shows up. The burners are stopped
# by their PIDs. Usage: .ci/busy_suite.sh [N]   (PY=path/to/python to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
runs=${1:-5}
failed=0
for i in $(seq 1 "$runs"); do
  "$PY" -c 'while True: pass' & b1=$!
  "$PY" -c 'while True: pass' & b2=$!
  start=$(date +%s)
  log=$(mktemp)
  "$PY" -m pytest -q -p no:cacheprovider >"$log" 2>&1; rc=$?
  kill "$b1" "$b2"; wait "$b1" "$b2" 2>/dev/null
  echo "run $i: exit $rc in $(( $(date +%s) - start )) s: $(tail -1 "$log")"
  if [ "$rc" -ne 0 ]; then failed=$((failed + 1)); grep -E "^(FAILED|ERROR)" "$log"; fi
  rm -f "$log"
done
echo "$((runs - failed)) of $runs runs passed beside two CPU burners"
[ "$failed" -eq 0 ]
