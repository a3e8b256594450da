#!/bin/sh
# check_example.sh SOFTVERBS PROGRAM CHECK WR_ID SOURCE: the test of one
# examples/bugs program (see CMakeLists.txt). WR_ID may be empty.
cli=$1 program=$2 check=$3 wr_id=$4 source=$5
fail() {
  echo "FAIL: $*"
  exit 1
}
"$cli" up >/dev/null || fail "softverbs up"
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT

"$cli" run -- "$program" >"$work/plain.out" 2>"$work/plain.err" || fail "the plain run failed: $(cat "$work/plain.err")"
! grep -q "softverbs check" "$work/plain.err" || fail "reported without --check"

"$cli" run --check=error --check-report "$work/report.json" -- "$program" >"$work/check.out" 2>"$work/check.err"
status=$?
cat "$work/check.err"
[ "$status" -ne 0 ] || fail "--check=error exited 0"
line=$(grep "softverbs check: $check:" "$work/check.err") || fail "no $check report"
[ -z "$wr_id" ] || echo "$line" | grep -q "WR id $wr_id[,)]" || fail "the report does not name WR id $wr_id"
grep -q "$source:[0-9]" "$work/check.err" || fail "the report does not name $source:LINE"
grep -q "\"check\":\"$check\"" "$work/report.json" || fail "no JSON line for $check"
[ -z "$wr_id" ] || grep "\"check\":\"$check\"" "$work/report.json" | grep -q "\"wr_id\":$wr_id[,}]" ||
  fail "the JSON line does not name WR id $wr_id"
echo "PASS"
