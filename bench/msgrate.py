"""Small-message rate over the UDP transport (issue 42): udp ib_write_bw and
ib_send_bw at 2, 8 and 64 B in Mmsg/s, against raw UDP's rate for datagrams
of the same size on the wire, measured in the same run by bench/udp_rate
(the best of sendmmsg/recvmmsg and UDP GSO/GRO batches).

Goals: 8 B WRITEs at least 2 Mmsg/s and at least half the raw datagram rate,
in every run. The 8 B WRITE is measured GOAL_RUNS times, each run right
after a raw measurement of its own; the row gives the median and the range,
and a goal is met only if every run meets it.

Also informational rows for 8 B with every request signaled (-Q 1), as most
applications post: perftest's default signals one request in 100.

Used by bench/run (rows()); `bench/run --only msgrate` runs these rows alone.
"""
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

GOAL_RUNS = 5
OTHER_RUNS = 3
GOAL_MMSG = 2.0
GOAL_SHARE = 0.5
SIZES = [2, 8, 64]
ROCE_WRITE_HEADERS = 12 + 16 + 4  # BTH + RETH + ICRC


def _run(command, env=None, timeout=120):
    result = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def raw_rate(build, size, seconds):
    """bench/udp_rate for datagrams of a `size` B WRITE: (best Mpps, way, every way's figure)."""
    text = _run([str(build / "bench/udp_rate"), str(size), f"{seconds:.2f}"])
    ways = {m.group(1): float(m.group(2)) for m in re.finditer(r"udp_rate_(\w+?)_Mpps value=([\d.]+)", text)}
    best = re.search(r"udp_rate_best_Mpps value=([\d.]+) way=(\w+)", text)
    ways.pop("best", None)
    return float(best.group(1)), best.group(2), ways


def message_rate(build, runtime, tool, size, iterations, port, gid, extra=()):
    """perftest `tool` (with `extra` options) over the UDP device: its MsgRate (Mmsg/s)."""
    cli = str(build / "bin/softverbs")
    env = dict(os.environ, SOFTVERBS_RUNTIME_DIR=runtime)
    common = [tool, "-d", "softverbs0", "-s", str(size), "-n", str(iterations), "-p", str(port), "-x", gid, *extra]
    server = subprocess.Popen([cli, "run", "--", *common], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    time.sleep(0.3)
    client = None
    for _ in range(50):
        client = subprocess.run([cli, "run", "--", *common, "127.0.0.1"], env=env, timeout=300, capture_output=True,
                                text=True)
        if client.returncode == 0 or "Couldn't connect" not in client.stdout + client.stderr:
            break
        time.sleep(0.1)
    server.communicate(timeout=300)
    if client.returncode != 0:
        raise RuntimeError(f"{tool} -s {size}: {client.stdout}{client.stderr}")
    lines = client.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            return float(lines[i + 1].split()[4])
    raise RuntimeError(f"{tool}: no result line in {client.stdout}")


def rows(build: Path, scale: float):
    """(table rows, one bool per goal, baseline lines) for bench/run."""
    cli = str(build / "bin/softverbs")
    runtime = tempfile.mkdtemp(prefix="softverbs-bench-msgrate-")
    env = dict(os.environ, SOFTVERBS_RUNTIME_DIR=runtime)
    _run([cli, "up", "--transport", "udp"], env=env)
    status = _run([cli, "status"], env=env)
    gid = re.search(r"GID\[(\d+)\] 0000:0000:0000:0000:0000:ffff:7f00:0001  RoCE v2", status).group(1)
    iterations = max(20000, int(400000 * scale))
    seconds = max(0.3, 0.5 * scale)
    port = 23000
    table, goals, baseline_runs = [], [], {}
    try:
        cases = [(tool, size, ()) for tool in ["ib_write_bw", "ib_send_bw"] for size in SIZES]
        cases += [(tool, 8, ("-Q", "1")) for tool in ["ib_write_bw", "ib_send_bw"]]
        for tool, size, extra in cases:
            goal = tool == "ib_write_bw" and size == 8 and not extra
            runs = []
            for _ in range(GOAL_RUNS if goal else OTHER_RUNS):
                print(f"udp {tool} -s {size} {' '.join(extra)} message rate ...", flush=True)
                raw, way, ways = raw_rate(build, size, seconds)
                baseline_runs.setdefault(size, []).append((raw, way, ways))
                port += 1
                rate = message_rate(build, runtime, tool, size, iterations // (2 if extra else 1), port, gid, extra)
                runs.append((rate, raw))
            rates = sorted(r for r, _ in runs)
            shares = sorted(r / b for r, b in runs)
            median_rate, median_share = rates[len(rates) // 2], shares[len(shares) // 2]
            median_raw = sorted(b for _, b in runs)[len(runs) // 2]
            each = ", ".join(f"{r:.3f}/{b:.3f}" for r, b in runs)
            figure = (f"{median_rate:.3f} Mmsg/s (median of {len(runs)} runs, {rates[0]:.3f}-{rates[-1]:.3f}; "
                      f"each run / its raw rate just before: {each})")
            datagram = ROCE_WRITE_HEADERS + (size + 3) // 4 * 4
            baseline = f"raw UDP {datagram} B datagrams just before each run, median {median_raw:.3f} Mpps"
            share = f"{median_share * 100:.0f}% ({shares[0] * 100:.0f}-{shares[-1] * 100:.0f}%)"
            if goal:
                met = rates[0] >= GOAL_MMSG and shares[0] >= GOAL_SHARE
                goals.append(met)
                table.append(f"| udp {tool} {size} B message rate | {figure} | {baseline} | {share} | "
                             f">= {GOAL_MMSG:g} Mmsg/s and >= {GOAL_SHARE * 100:.0f}% of raw UDP, every run | "
                             f"{'yes' if met else 'no'} |")
            else:
                what = f"{size} B message rate" + (", every request signaled (-Q 1)" if extra else "")
                table.append(f"| udp {tool} {what} | {figure} | {baseline} | {share} | - | - |")
    finally:
        subprocess.run([cli, "down"], env=env, capture_output=True)
    baselines = []
    for size, measured in sorted(baseline_runs.items()):
        datagram = ROCE_WRITE_HEADERS + (size + 3) // 4 * 4
        best = ", ".join(f"{raw:.3f} ({way})" for raw, way, _ in measured)
        ways = sorted({name for _, _, w in measured for name in w})
        per_way = "; ".join(f"{name} " + "/".join(f"{w[name]:.2f}" for _, _, w in measured) for name in ways)
        baselines.append(
            f"- raw UDP loopback message rate, {datagram} B datagrams (a {size} B RDMA WRITE ONLY packet: BTH + RETH + "
            f"payload + ICRC), two processes, datagrams received per second from the first send to the last read (the "
            f"receiver busy-polls; what the kernel drops does not count), the best of five ways of batching, measured just before each udp message-rate "
            f"run at this size (the SEND rows too, whose packets are 12 B shorter, no RETH): {best} Mpps (per way, "
            f"Mpps: {per_way}; sendmmsg: 64 datagrams per sendmmsg, read with recvmmsg; gso: 64 in one UDP GSO send, "
            f"read with UDP_GRO; gso128: 128 to a GSO send, where the kernel allows it; gso_split: 64 to a GSO send "
            f"read with recvmmsg; send: a send() each)")
    return table, goals, baselines
