#!/usr/bin/env bash
# Runs rdma-core's own pyverbs test suite (Debian: python3-pyverbs ships it,
# gzipped, under /usr/share/doc/rdma-core/tests) against softverbs0.
# usage: run_pyverbs.sh SOFTVERBS_CLI WORK_DIR MODULE...
set -euo pipefail
cli=$1
work=$2
shift 2
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
exec "$cli" run -- /usr/bin/python3 run_tests.py --dev softverbs0 -v "$@"
