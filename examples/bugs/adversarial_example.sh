#!/bin/sh
# adversarial_example.sh SOFTVERBS PROGRAM: PROGRAM passes on a plain run and
# fails under --adversarial with fixed seeds, each seed failing again when
# replayed.
softverbs=$1 program=$2
"$softverbs" up >/dev/null || exit 1
"$softverbs" run -- "$program" || { echo "FAIL: $program failed without --adversarial"; exit 1; }
for seed in 1 2; do
  for replay in first again; do
    out=$("$softverbs" run --adversarial=$seed -- "$program" 2>&1)
    status=$?
    echo "$out"
    if [ $status -ne 1 ] || ! echo "$out" | grep -q "^BUG:"; then
      echo "FAIL: $program exited $status under --adversarial=$seed ($replay run), not with its bug"
      exit 1
    fi
    echo "$out" | grep -q "^softverbs adversarial: seed $seed\$" || { echo "FAIL: the seed was not printed"; exit 1; }
  done
done
echo "PASS: $program passes plainly and fails under --adversarial=1 and =2, twice each"
