#!/bin/sh
# Runs a GPU test executable (the arguments: it and its own arguments, or mpiexec running it) as one ctest.
# When it ran no test because every one skipped (no usable GPU), exits 77, which ctest reports as skipped,
# after a line with the count and the first skip's reason; otherwise exits with the executable's status.
export GTEST_COLOR=no  # under mpiexec gtest sees a terminal and would colour the lines matched below
output=$("$@" 2>&1)
status=$?
printf '%s\n' "$output"
if [ "$status" -eq 0 ] && printf '%s\n' "$output" | grep -q '^\[  PASSED  \] 0 tests'; then
  count=$(printf '%s\n' "$output" | sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below:$/\1/p' | head -n 1)
  if [ -z "$count" ]; then
    echo "no test ran: the filter matches none"
    exit 1
  fi
  reason=$(printf '%s\n' "$output" | grep -A 1 -m 1 ': Skipped$' | tail -n 1)
  echo "all $count tests skipped: ${reason:-no reason given}"
  exit 77
fi
exit "$status"
