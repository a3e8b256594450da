"""bench/rsockets.py: rsockets over softverbs0 beside TCP loopback.

Rows for bench/run (rows(build, scale); `bench/run --only rsockets`): rdma-core's
rstream between two processes under `softverbs run` (rsockets over a
shared-memory softverbs0) and `rstream -T s` (the same program over kernel TCP
on lo) in the same run, back to back, RUNS times each:
- bandwidth: 1 MiB transfers (rstream's Gb/sec);
- latency: 64 B ping-pong (rstream's usec/xfer, half a round trip).
No goal: the issue sets none; the rows say which is faster.
"""
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

RUNS = 3
PORT = 7480


class Device:
    """softverbs0 (shm) in a runtime directory of its own, taken down at the end."""

    def __init__(self, build):
        self.cli = str(build / "bin/softverbs")
        self.runtime = tempfile.mkdtemp(prefix="softverbs-bench-rsockets-")
        self.env = dict(os.environ, SOFTVERBS_RUNTIME_DIR=self.runtime)
        subprocess.run([self.cli, "up"], env=self.env, check=True, capture_output=True, timeout=60)

    def close(self):
        subprocess.run([self.cli, "down"], env=self.env, capture_output=True, timeout=60)
        shutil.rmtree(self.runtime, ignore_errors=True)


def rstream(device, args, over_rdma):
    """One rstream server/client pair; the client's result line as
    (Gb/sec, usec/xfer)."""
    global PORT
    PORT += 1
    common = ["rstream", "-p", str(PORT), *args] + ([] if over_rdma else ["-T", "s"])
    prefix = [device.cli, "run", "--"]
    server = subprocess.Popen(prefix + common, env=device.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    time.sleep(0.5)
    client = None
    for _ in range(20):
        client = subprocess.run(prefix + common + ["-s", "127.0.0.1"], env=device.env, capture_output=True, text=True,
                                timeout=300)
        if client.returncode == 0 or "refused" not in client.stdout + client.stderr:
            break
        time.sleep(0.2)
    server.communicate(timeout=300)
    if client.returncode != 0:
        raise RuntimeError(f"rstream {' '.join(common)}: {client.stdout}{client.stderr}")
    # name bytes xfers iters total time Gb/sec usec/xfer
    for line in client.stdout.splitlines():
        fields = line.split()
        if len(fields) == 8 and re.fullmatch(r"[\d.]+", fields[6]):
            return float(fields[6]), float(fields[7])
    raise RuntimeError(f"no rstream result line in {client.stdout}")


def rows(build, scale):
    device = Device(build)
    count = max(100, int(20000 * scale))
    bw_count = max(20, int(2000 * scale))
    cases = {
        "bandwidth": (["-S", "1048576", "-C", str(bw_count), "-I", "1"], 0),
        "latency": (["-S", "64", "-C", str(count), "-I", "1"], 1),
    }
    figures = {(case, rdma): [] for case in cases for rdma in (True, False)}
    try:
        for _ in range(RUNS):
            for case, (args, column) in cases.items():
                for rdma in (True, False):
                    figures[(case, rdma)].append(rstream(device, args, rdma)[column])
    finally:
        device.close()
    median = {key: statistics.median(values) for key, values in figures.items()}
    bw_rdma, bw_tcp = median[("bandwidth", True)], median[("bandwidth", False)]
    lat_rdma, lat_tcp = median[("latency", True)], median[("latency", False)]

    def runs(key, unit):
        return ", ".join(f"{v:.2f}" for v in figures[key]) + f" {unit}"

    table = [
        f"| rsockets rstream 1 MiB bandwidth (softverbs0 shm) | {bw_rdma:.2f} Gb/s (median of "
        f"{runs(('bandwidth', True), 'Gb/s')}) | rstream -T s over TCP loopback {bw_tcp:.2f} Gb/s | "
        f"{bw_rdma / bw_tcp:.2f}x ({'rsockets' if bw_rdma > bw_tcp else 'TCP'} faster) | - | - |",
        f"| rsockets rstream 64 B latency, usec/xfer (softverbs0 shm) | {lat_rdma:.2f} us (median of "
        f"{runs(('latency', True), 'us')}) | rstream -T s over TCP loopback {lat_tcp:.2f} us | "
        f"{lat_rdma / lat_tcp:.2f}x ({'rsockets' if lat_rdma < lat_tcp else 'TCP'} faster) | - | - |",
    ]
    baselines = [
        f"- rstream -T s (kernel TCP over lo), same sizes, run back to back with the rsockets runs: "
        f"1 MiB {runs(('bandwidth', False), 'Gb/s')}; 64 B {runs(('latency', False), 'us/xfer')}"
    ]
    return table, [], baselines
