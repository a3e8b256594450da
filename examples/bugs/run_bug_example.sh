#!/bin/sh
# Runs one example of examples/bugs twice through `softverbs run`: plainly
# (it must exit 0 with no report), then in check mode (it must be reported
# with CHECK_ID at least COUNT times, and name what the example printed on
# "expect: REGEX" lines). With EXPECT_CALL_SITES=1, each FUNCTION given
# after the count must appear in the reports (the symbolised call site).
# Usage: run_bug_example.sh SOFTVERBS PROGRAM CHECK_ID COUNT [FUNCTION...]
set -u
softverbs=$1 program=$2 check_id=$3 count=$4
shift 4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  echo "--- plain stderr"; cat "$work/plain.err"
  echo "--- check stdout"; cat "$work/check.out" 2>/dev/null
  echo "--- check stderr"; cat "$work/check.err" 2>/dev/null
  exit 1
}

env -u SOFTVERBS_CHECK "$softverbs" run -- "$program" >"$work/plain.out" 2>"$work/plain.err"
status=$?
[ "$status" -eq 0 ] || fail "without check mode the example exits $status, not 0"
grep -q "$check_id" "$work/plain.err" && fail "without check mode the example is reported"

"$softverbs" run --check -- "$program" >"$work/check.out" 2>"$work/check.err"
reports=$(grep -c "$check_id" "$work/check.err")
[ "$reports" -ge "$count" ] || fail "check mode reported $check_id $reports times, not at least $count"
grep '^expect: ' "$work/check.out" | sed 's/^expect: //' >"$work/expected"
while IFS= read -r pattern; do
  grep -Eq -- "$pattern" "$work/check.err" || fail "no report names /$pattern/"
done <"$work/expected"
if [ "${EXPECT_CALL_SITES:-0}" = 1 ]; then
  for function in "$@"; do
    grep -q -- "$function" "$work/check.err" || fail "no report names the call site $function"
  done
fi
echo "reported $reports times as $check_id"
