"""Event-driven latency rows for bench/run: perftest with -e (the application
sleeps in ibv_get_cq_event between messages) over softverbs, against a
ping-pong where each side blocks in the kernel until the other's message
wakes it (bench/blocking_pingpong), measured just before and just after each
run.

Goals: over shared memory within 1.5x of a blocking pipe ping-pong between
two processes, over UDP within 2x of a blocking UDP loopback ping-pong.
perftest's ib_write_lat refuses -e ("Events feature not available on WRITE
verb": its side that waits spins on its buffer, as an HCA's WRITE raises no
completion at the target); ib_read_lat -e and ib_atomic_lat -e are the
other latency tools that sleep on events (one side waits; the full round
trip, against the baseline's).
"""
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

GOAL_RUNS = 3
# Where the two baselines around a run differ by more than this, the run is
# made again (up to BRACKET_ATTEMPTS in all): the host moved the vCPUs.
BRACKET_AGREEMENT = 1.5
BRACKET_ATTEMPTS = 3
GOALS = {"shm": 1.5, "udp": 2.0}
BASELINE_PART = {"shm": "pipe", "udp": "udp"}
BASELINE_TEXT = {"shm": "blocking pipe ping-pong", "udp": "blocking UDP ping-pong"}


def _run(command, env=None, timeout=300):
    result = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def blocking(build, part, iterations):
    """bench/blocking_pingpong's one-way median for `part` (udp, pipe, eventfd), in us."""
    text = _run([str(build / "bench/blocking_pingpong"), str(iterations), part])
    return float(re.search(rf"blocking_{part}_one_way_us median=([\d.]+)", text).group(1))


def perftest_events(build, runtime, tool, iterations, port, extra):
    """One perftest run with -e between two processes; its t_typical in us."""
    cli = str(build / "bin/softverbs")
    env = dict(os.environ, SOFTVERBS_RUNTIME_DIR=runtime)
    common = [tool, "-d", "softverbs0", "-n", str(iterations), "-p", str(port), "-e", *extra]
    if tool != "ib_atomic_lat":
        common += ["-s", "2"]
    server = subprocess.Popen([cli, "run", "--", *common], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    client = None
    for _ in range(50):
        client = subprocess.run([cli, "run", "--", *common, "127.0.0.1"], env=env, timeout=300,
                                capture_output=True, text=True)
        if client.returncode == 0 or "Couldn't connect" not in client.stdout + client.stderr:
            break
        time.sleep(0.1)
    server.communicate(timeout=300)
    if client.returncode != 0:
        raise RuntimeError(f"{tool} -e: {client.stdout}{client.stderr}")
    lines = client.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            return float(lines[i + 1].split()[4])
    raise RuntimeError(f"{tool} -e: no result line in {client.stdout}")


def write_lat_refuses_events(build, runtime):
    """perftest's own answer to ib_write_lat -e (it exits before connecting)."""
    env = dict(os.environ, SOFTVERBS_RUNTIME_DIR=runtime)
    result = subprocess.run([str(build / "bin/softverbs"), "run", "--", "ib_write_lat", "-d", "softverbs0", "-e"],
                            env=env, timeout=60, capture_output=True, text=True)
    text = (result.stdout + result.stderr).strip()
    refusal = next((line.strip() for line in text.splitlines() if "not available" in line), None)
    return refusal if result.returncode != 0 and refusal else None


def measure(build, runtime, transport, tool, iterations, port, extra, base_iterations):
    """A run bracketed by two baselines; (figure, before, after, attempts)."""
    part = BASELINE_PART[transport]
    for attempt in range(1, BRACKET_ATTEMPTS + 1):
        before = blocking(build, part, base_iterations)
        figure = perftest_events(build, runtime, tool, iterations, port + attempt * 7, extra)
        after = blocking(build, part, base_iterations)
        if max(before, after) <= BRACKET_AGREEMENT * min(before, after):
            break
    return figure, before, after, attempt


def rows(build: Path, scale: float):
    cli = str(build / "bin/softverbs")
    iterations = max(1000, int(10000 * scale))
    base_iterations = max(2000, int(10000 * scale))
    table, goals, baselines = [], [], []
    port = 24000
    seen = {"pipe": [], "udp": [], "eventfd": []}
    for transport in ("shm", "udp"):
        runtime = tempfile.mkdtemp(prefix=f"softverbs-bench-events-{transport}-")
        env = dict(os.environ, SOFTVERBS_RUNTIME_DIR=runtime)
        _run([cli, "up", "--transport", transport], env=env)
        extra = []
        if transport == "udp":
            status = _run([cli, "status"], env=env)
            gid = re.search(r"GID\[(\d+)\] 0000:0000:0000:0000:0000:ffff:7f00:0001  RoCE v2", status).group(1)
            extra = ["-x", gid]
        for tool in ("ib_send_lat", "ib_read_lat", "ib_atomic_lat"):
            print(f"{transport} {tool} -e ...", flush=True)
            goal_row = tool == "ib_send_lat"
            runs = []
            for _ in range(GOAL_RUNS if goal_row else 1):
                port += 30
                figure, before, after, attempts = measure(build, runtime, transport, tool, iterations, port, extra,
                                                          base_iterations)
                seen[BASELINE_PART[transport]] += [before, after]
                # ib_read_lat and ib_atomic_lat report the round trip.
                trip = 1 if tool == "ib_send_lat" else 2
                runs.append((figure, trip * (before + after) / 2, before, after, attempts))
            runs.sort(key=lambda r: r[0] / r[1])
            figure, base, _, _, _ = runs[len(runs) // 2]
            ratio = figure / base
            runs_text = ", ".join(f"{r[0]:.2f} us / {r[2]:.2f}..{r[3]:.2f} us"
                                  + (f" attempt {r[4]}" if r[4] > 1 else "") for r in runs)
            detail = f" (median ratio of {len(runs)} runs: {runs_text})" if len(runs) > 1 else \
                f" (around it {runs_text})"
            size = "" if tool == "ib_atomic_lat" else " 2 B"
            trips = "" if tool == "ib_send_lat" else " round trip"
            goal, met = "-", "-"
            if goal_row:
                goal = f"<= {GOALS[transport]:g}x"
                met = "yes" if ratio <= GOALS[transport] else "no"
                goals.append(met == "yes")
            table.append(f"| {transport} {tool}{size} with events (-e), t_typical | {figure:.2f} us{detail} "
                         f"| {BASELINE_TEXT[transport]}{trips} around it {base:.2f} us | {ratio:.2f}x | {goal} | {met} |")
        refusal = write_lat_refuses_events(build, runtime)
        table.append(f"| {transport} ib_write_lat with events | not measurable: perftest refuses -e for WRITE "
                     f"latency ({refusal or 'see bench/events.py'}); its waiting side spins on its buffer | - | - "
                     f"| - | - |")
        subprocess.run([cli, "down"], env=env, capture_output=True)
    seen["eventfd"].append(blocking(build, "eventfd", base_iterations))
    baselines.append("- blocking ping-pong between two processes over a pair of pipes, each side blocked in read "
                     "until the other's byte wakes it (one-way, median), measured just before and just after each "
                     "shm -e run: " + ", ".join(f"{v:.2f}" for v in seen["pipe"]) + " us; over eventfds "
                     f"{seen['eventfd'][0]:.2f} us")
    baselines.append("- blocking UDP loopback ping-pong, each side blocked in recv (one-way, median), measured just "
                     "before and just after each udp -e run: " + ", ".join(f"{v:.2f}" for v in seen["udp"]) + " us")
    return table, goals, baselines
