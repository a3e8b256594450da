#!/bin/sh
# libibverbs asks every loaded provider about each device no provider's
# table matched; softverbs' provider must decline another vendor's device.
# $1: the softverbs command. A device's sysfs tree with an unknown vendor's
# modalias stands in for the other device.
set -eu
softverbs=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SOFTVERBS_RUNTIME_DIR="$work/rt"
"$softverbs" up >/dev/null
drivers=$("$softverbs" env | sed -n "s/^export RDMAV_DRIVERS='\(.*\)'$/\1/p")
cp -r "$SOFTVERBS_RUNTIME_DIR/sysfs" "$work/sysfs"
"$softverbs" down >/dev/null
mkdir -p "$work/dev"
SYSFS_PATH="$work/sysfs" RDMAV_DRIVERS="$drivers" ibv_devices >"$work/own.out" 2>&1
grep -q softverbs0 "$work/own.out" || { cat "$work/own.out"; echo "FAIL: its own device is not listed"; exit 1; }
device="$work/sysfs/class/infiniband/softverbs0"
printf 'pci:v0000FFFFd0000FFFFsv0000FFFFsd0000FFFFbc02sc00i00\n' >"$device/device/modalias"
rm -f "$device/softverbs.conf"
SYSFS_PATH="$work/sysfs" RDMAV_DRIVERS="$drivers" ibv_devices >"$work/other.out" 2>&1
if grep -q softverbs0 "$work/other.out"; then cat "$work/other.out"; echo "FAIL: claimed another vendor's device"; exit 1; fi
echo "PASS: lists its own device, leaves another vendor's alone"
