#!/usr/bin/env bash
# Runs a command (an mpiexec job, a dplab command, a small shell script) and checks its exit
# status, its duration and its output, which ctest alone cannot combine. Prints the job's
# output, then what did not hold.
#
#   check_job.sh --exit zero|nonzero --max-seconds N [--expect ERE]... -- COMMAND...
set -u

expected_exit=""
max_seconds=""
patterns=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --exit) expected_exit=$2; shift 2 ;;
    --max-seconds) max_seconds=$2; shift 2 ;;
    --expect) patterns+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "check_job.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
if [[ -z $expected_exit || -z $max_seconds || $# -eq 0 ]]; then
  echo "usage: check_job.sh --exit zero|nonzero --max-seconds N [--expect ERE]... -- COMMAND..." >&2
  exit 2
fi

start=$(date +%s%N)
# The outer limit only keeps a runaway job from hanging ctest; the check is below.
output=$(timeout --kill-after=5 $((max_seconds + 30)) "$@" 2>&1)
status=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
printf '%s\n' "$output"
echo "--- check_job.sh: exit status $status after ${elapsed_ms} ms"

failures=0
if [[ $expected_exit == zero && $status -ne 0 ]]; then
  echo "FAIL: expected exit status 0, got $status"; failures=$((failures + 1))
fi
if [[ $expected_exit == nonzero && $status -eq 0 ]]; then
  echo "FAIL: expected a non-zero exit status, got 0"; failures=$((failures + 1))
fi
if ((elapsed_ms > max_seconds * 1000)); then
  echo "FAIL: expected the job to end within $max_seconds s, it took ${elapsed_ms} ms"
  failures=$((failures + 1))
fi
for pattern in "${patterns[@]}"; do
  if ! grep -Eq -- "$pattern" <<<"$output"; then
    echo "FAIL: no line of the output matches: $pattern"; failures=$((failures + 1))
  fi
done
((failures == 0)) && echo "PASS" || exit 1
