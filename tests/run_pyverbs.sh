#!/usr/bin/env bash
# Runs rdma-core's own pyverbs test suite (Debian: python3-pyverbs ships it,
# gzipped, under /usr/share/doc/rdma-core/tests) against softverbs0.
# usage: run_pyverbs.sh SOFTVERBS_CLI WORK_DIR [MODULE...]  (no module: all)
# With PYVERBS_GID_OF_IPV4=a.b.c.d the tests name the RoCE v2 GID of that
# address (--gid), as a device on the UDP transport needs. With
# PYVERBS_MIN_PASSED=N, fewer than N passing tests is a failure too: a
# feature that starts to skip is a regression the suite itself would not report.
# With PYVERBS_HUGE_PAGES=N, a machine with fewer than N free 2 MiB huge pages
# skips the run (exit 77): the suite would skip those tests itself, silently.
set -euo pipefail
cli=$1
work=$2
shift 2
if [ -n "${PYVERBS_GID_OF_IPV4:-}" ]; then
  mapped=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${PYVERBS_GID_OF_IPV4//./ })
  gid=$("$cli" status | sed -n "s/.*GID\[\([0-9]*\)\] $mapped  RoCE v2.*/\1/p" | head -n 1)
  if [ -z "$gid" ]; then
    echo "run_pyverbs: softverbs status lists no RoCE v2 GID of $PYVERBS_GID_OF_IPV4" >&2
    exit 1
  fi
  set -- --gid "$gid" "$@"
fi
if [ -n "${PYVERBS_HUGE_PAGES:-}" ]; then
  free=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
  if [ "${free:-0}" -lt "$PYVERBS_HUGE_PAGES" ]; then
    echo "run_pyverbs: ${free:-0} free 2 MiB huge pages, fewer than the $PYVERBS_HUGE_PAGES these tests need" \
      "(as root: echo 128 > /proc/sys/vm/nr_hugepages); skipped" >&2
    exit 77
  fi
fi
source=/usr/share/doc/rdma-core/tests
if [ ! -f "$source/run_tests.py" ]; then
  echo "run_pyverbs: $source is missing (install python3-pyverbs)" >&2
  exit 1
fi
rm -rf "$work"
mkdir -p "$work"
cp -r "$source" "$work/tests"
gunzip -f "$work"/tests/*.gz
cd "$work/tests"
# Debian's interpreter: pyverbs is installed for it, not for others on PATH.
status=0
"$cli" run -- /usr/bin/python3 run_tests.py --dev softverbs0 -v "$@" 2>&1 | tee "$work/output.txt" || status=$?
# unittest's summary: "Ran N tests in ..." then "OK (skipped=K)" or
# "FAILED (failures=F, errors=E, skipped=K)".
count() {
  local value
  value=$(sed -n "s/.*[(, ]$1=\([0-9]*\).*/\1/p" "$work/output.txt" | tail -n 1)
  echo "${value:-0}"
}
ran=$(sed -n 's/^Ran \([0-9]*\) tests\{0,1\} in .*/\1/p' "$work/output.txt" | tail -n 1)
passed=$((${ran:-0} - $(count skipped) - $(count failures) - $(count errors) - $(count 'expected failures')))
echo "run_pyverbs: $passed passed"
if [ "$status" -eq 0 ] && [ -n "${PYVERBS_MIN_PASSED:-}" ] && [ "$passed" -lt "$PYVERBS_MIN_PASSED" ]; then
  echo "run_pyverbs: $passed tests passed, fewer than the $PYVERBS_MIN_PASSED expected" >&2
  status=1
fi
exit "$status"
