"""bench/scale.py: softverbs with many QPs, many processes and across a link.

Rows for bench/run (rows(build, scale)), each against a baseline measured in
the same run:
- ib_write_bw 64 KiB with 1, 4, 16 and 64 QPs (perftest -q), aggregate, on
  shm and on udp; goal: 64 QPs at least 90% of 1 QP;
- 1, 2 and 4 pairs of ib_write_bw processes at once, their sum;
- a SEND ping-pong with 10,000 idle connected RC QPs in the process
  (bench/idle_qps) against the same with none; goal: within 10%;
- N x N: 8 processes, each with an RC QP to every other, all sending at once
  (tests/all_to_all), byte-exact on both transports;
- two network namespaces over a veth pair (MTU 1500): ib_write_bw 64 KiB
  against raw UDP over the same veth (bench/udp_pingpong); goal: 50%.
SOFTVERBS_BENCH_SCALE_ROWS=qp,idle,nxn,veth chooses which (all by default).
"""
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = 3
QP_COUNTS = (1, 4, 16, 64)
PAIR_COUNTS = (1, 2, 4)
IDLE_QPS = 10000
BYTES_PER_RUN = 2.6e9  # as bench/run's bandwidth goals
VETH_MTU = 1500


def _bench_run():
    loader = importlib.machinery.SourceFileLoader("bench_run", str(ROOT / "bench/run"))
    spec = importlib.util.spec_from_loader("bench_run", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


B = _bench_run()


class Device:
    """A softverbs device of its own runtime directory (on lo, or on `netdev`
    inside network namespace `netns`), taken down at the end."""

    def __init__(self, build, transport, netns=None, netdev=None):
        self.cli = str(build / "bin/softverbs")
        self.runtime = tempfile.mkdtemp(prefix=f"softverbs-bench-scale-{transport}-")
        self.env = dict(os.environ, SOFTVERBS_RUNTIME_DIR=self.runtime)
        self.prefix = ["ip", "netns", "exec", netns] if netns else []
        up = [self.cli, "up", "--transport", transport] + (["--netdev", netdev] if netdev else [])
        B.run(self.prefix + up, env=self.env)
        self.gid = None
        if transport == "udp":
            status = B.run(self.prefix + [self.cli, "status"], env=self.env).stdout
            self.gid = re.search(r"GID\[(\d+)\] 0000:0000:0000:0000:0000:ffff:[0-9a-f:]+  RoCE v2", status).group(1)

    def command(self, program):
        return self.prefix + [self.cli, "run", "--", *program]

    def gid_args(self):
        return ["-x", self.gid] if self.gid else []

    def close(self):
        B.run(self.prefix + [self.cli, "down"], env=self.env, check=False)
        shutil.rmtree(self.runtime, ignore_errors=True)


def _result_line(text):
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            return [float(f) for f in lines[i + 1].split()]
    raise RuntimeError(f"no perftest result line in {text}")


def write_bw(server_device, client_device, size, iterations, port, extra=(), server_address="127.0.0.1"):
    """ib_write_bw between a server and a client process; MB/s (BW average)."""
    common = ["ib_write_bw", "-d", "softverbs0", "-s", str(size), "-n", str(iterations), "-p", str(port), *extra]
    server = subprocess.Popen(server_device.command(common + server_device.gid_args()), env=server_device.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    client = None
    for _ in range(50):
        client = B.run(client_device.command(common + client_device.gid_args() + [server_address]),
                       env=client_device.env, timeout=300, check=False)
        if client.returncode == 0 or "Couldn't connect" not in client.stdout + client.stderr:
            break
        time.sleep(0.1)
    server.communicate(timeout=300)
    if client.returncode != 0:
        raise RuntimeError(f"ib_write_bw {' '.join(extra)}: {client.stdout}{client.stderr}")
    return _result_line(client.stdout)[3]


def concurrent_pairs(device, pairs, size, iterations, port):
    """`pairs` ib_write_bw pairs at once; the sum of their MB/s."""
    servers, clients = [], []
    for p in range(pairs):
        command = ["ib_write_bw", "-d", "softverbs0", "-s", str(size), "-n", str(iterations), "-p", str(port + p),
                   *device.gid_args()]
        servers.append(subprocess.Popen(device.command(command), env=device.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    time.sleep(0.3 + 0.1 * pairs)
    for p in range(pairs):
        command = ["ib_write_bw", "-d", "softverbs0", "-s", str(size), "-n", str(iterations), "-p", str(port + p),
                   *device.gid_args(), "127.0.0.1"]
        clients.append(subprocess.Popen(device.command(command), env=device.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    total = 0.0
    for client in clients:
        out, err = client.communicate(timeout=300)
        if client.returncode != 0:
            raise RuntimeError(f"ib_write_bw pair: {out}{err}")
        total += _result_line(out)[3]
    for server in servers:
        server.communicate(timeout=300)
    return total


def gbps(mbps):
    return mbps * 1.048576 / 1000


def qp_rows(build, scale, port):
    """ib_write_bw -q 1/4/16/64 and 1/2/4 process pairs on each transport;
    the shm rows also against memcpy over the same working set."""
    rows, goals = [], []
    size = 65536
    # memcpy of 64 KiB blocks cycling over as many blocks as -q has QPs
    # (the working set of ib_write_bw -q N): {N: GB/s}.
    working_set = B.baseline_bench(build, "MemcpyAcrossBlocks")
    for transport in ("shm", "udp"):
        device = Device(build, transport)
        try:
            # Each run of a count moves the same bytes; RUNS rounds of all
            # counts back to back, the goal's ratio the median of its rounds.
            figures = {q: [] for q in QP_COUNTS}
            failures = []
            for _ in range(RUNS):
                for q in QP_COUNTS:
                    print(f"{transport} ib_write_bw -q {q} ...", flush=True)
                    port += 1
                    iterations = max(200, int(BYTES_PER_RUN * scale / size / q))
                    try:
                        figures[q].append(gbps(write_bw(device, device, size, iterations, port, ["-q", str(q)])))
                    except RuntimeError as failure:
                        # A failed run counts as 0 (the goal not met) and says why.
                        figures[q].append(0.0)
                        failures.append(f"-q {q}: " + " ".join(str(failure).split("\n")[-3:]).strip())
            ratios = sorted((figures[QP_COUNTS[-1]][r] / max(figures[1][r], 1e-9), r) for r in range(RUNS))
            median = ratios[len(ratios) // 2][1]
            for q in QP_COUNTS:
                runs = ", ".join(f"{f:.2f}" for f in figures[q])
                ratio = figures[q][median] / max(figures[1][median], 1e-9)
                goal, met = "-", "-"
                if q == QP_COUNTS[-1]:
                    goal, met = ">= 90% of 1 QP", "yes" if ratio >= 0.9 else "no"
                    goals.append(ratio >= 0.9)
                failed = f"; failed: {'; '.join(failures)}" if failures and q == QP_COUNTS[-1] else ""
                rows.append(f"| {transport} ib_write_bw 64 KiB, {q} QPs (-q {q}), aggregate | {figures[q][median]:.2f} GB/s "
                            f"(runs: {runs} GB/s{failed.replace('|', '/')}) | 1 QP in the same round "
                            f"{figures[1][median]:.2f} GB/s | {ratio * 100:.0f}% | {goal} | {met} |")
            if transport == "shm":
                # A WRITE's data is copied once, so memcpy over the QPs' buffers
                # (4 MiB each way at -q 64, against 64 KiB at -q 1) bounds it.
                for q in QP_COUNTS:
                    copy = working_set.get(q)
                    if copy:
                        rows.append(f"| shm ib_write_bw 64 KiB, {q} QPs (-q {q}), against memcpy of its working set | "
                                    f"{figures[q][median]:.2f} GB/s | memcpy of 64 KiB blocks cycling over {q} "
                                    f"source and {q} destination blocks {copy:.2f} GB/s | "
                                    f"{figures[q][median] / copy * 100:.0f}% | - | - |")
            pair_figures = {}
            for pairs in PAIR_COUNTS:
                print(f"{transport} {pairs} ib_write_bw pairs at once ...", flush=True)
                port += 10
                iterations = max(200, int(BYTES_PER_RUN * scale / size / pairs))
                try:
                    pair_figures[pairs] = gbps(concurrent_pairs(device, pairs, size, iterations, port))
                except RuntimeError:
                    pair_figures[pairs] = 0.0
            for pairs in PAIR_COUNTS:
                rows.append(f"| {transport} ib_write_bw 64 KiB, {pairs} process pairs at once, sum | "
                            f"{pair_figures[pairs]:.2f} GB/s | 1 pair {pair_figures[1]:.2f} GB/s | "
                            f"{pair_figures[pairs] / max(pair_figures[1], 1e-9) * 100:.0f}% | - | - |")
        finally:
            device.close()
    return rows, goals, port


def idle_probe(build, device, idle, iterations, variant=()):
    out = B.run(device.command([str(build / "bench/idle_qps"), str(idle), str(iterations), *variant]), env=device.env,
                timeout=300).stdout
    return B.value(r"idle_qps_one_way_us median=([\d.]+)", out), B.value(r"setup_s=([\d.]+)", out)


def idle_rows(build, scale):
    """The ping-pong with IDLE_QPS idle QPs in the process, bracketed by
    the same with none; goal: within 10% of their mean."""
    rows, goals = [], []
    iterations = max(2000, int(20000 * scale))
    for transport, variant in (("shm", ()), ("shm", ("rnr",)), ("udp", ()), ("udp", ("rnr",))):
        device = Device(build, transport)
        try:
            runs = []
            for _ in range(RUNS):
                print(f"{transport} ping-pong with {IDLE_QPS} idle QPs {' '.join(variant)} ...", flush=True)
                before, _ = idle_probe(build, device, 0, iterations)
                loaded, setup = idle_probe(build, device, IDLE_QPS, iterations, variant)
                after, _ = idle_probe(build, device, 0, iterations)
                runs.append((loaded, (before + after) / 2, setup, before, after))
            runs.sort(key=lambda r: r[0] / r[1])
            loaded, alone, setup, _, _ = runs[len(runs) // 2]
            ratio = loaded / alone
            met = ratio <= 1.1
            goals.append(met)
            text = ", ".join(f"{r[0]:.2f} us / {r[3]:.2f}..{r[4]:.2f} us" for r in runs)
            waiting = ", one of them with a SEND waiting out RNRs" if variant else ""
            rows.append(f"| {transport} SEND ping-pong 8 B with {IDLE_QPS} idle connected RC QPs in the process{waiting} "
                        f"(bench/idle_qps {' '.join(variant)}; created and connected in {setup:.1f} s) | {loaded:.2f} us (runs: {text}) | "
                        f"the same with none, around it {alone:.2f} us | {ratio:.2f}x | <= 1.1x | "
                        f"{'yes' if met else 'no'} |")
        finally:
            device.close()
    return rows, goals


def all_to_all_rows(build, processes=8):
    rows, goals = [], []
    for transport in ("shm", "udp"):
        print(f"{transport} all_to_all {processes} processes ...", flush=True)
        device = Device(build, transport)
        try:
            result = B.run(device.command([str(build / "tests/all_to_all"), str(processes)]), env=device.env,
                           timeout=300, check=False)
        finally:
            device.close()
        ok = result.returncode == 0
        goals.append(ok)
        summary = (result.stdout.strip() or result.stderr.strip()).splitlines()
        what = summary[-1] if summary else f"exit {result.returncode}"
        rows.append(f"| {transport} N x N: {processes} processes, an RC QP to every other, all sending at once "
                    f"(tests/all_to_all) | {what.replace('|', '/')} | - | - | completes byte-exact | "
                    f"{'yes' if ok else 'no'} |")
    return rows, goals


class VethPair:
    """Two network namespaces joined by a veth pair of MTU VETH_MTU."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"svscale-a{tag}", f"svscale-b{tag}"]
        self.interfaces = [f"svsa{tag}", f"svsb{tag}"]
        self.addresses = ["10.77.0.1", "10.77.0.2"]
        a, b = self.namespaces
        va, vb = self.interfaces
        for command in (["ip", "netns", "add", a], ["ip", "netns", "add", b],
                        ["ip", "link", "add", va, "mtu", str(VETH_MTU), "type", "veth", "peer", "name", vb,
                         "mtu", str(VETH_MTU)],
                        ["ip", "link", "set", va, "netns", a], ["ip", "link", "set", vb, "netns", b]):
            B.run(command)
        for ns, interface, address in zip(self.namespaces, self.interfaces, self.addresses):
            B.run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", interface])
            B.run(["ip", "-n", ns, "link", "set", interface, "up"])
            B.run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def close(self):
        for ns in self.namespaces:
            B.run(["ip", "netns", "del", ns], check=False)


def veth_rows(build, scale, port):
    """ib_write_bw 64 KiB between two namespaces over a veth pair against
    raw UDP over the same veth, 64 KB datagrams and datagrams of the MTU."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return ["| veth (MTU 1500) ib_write_bw 64 KiB | not measured: needs root and ip(8) | - | - | - | - |"], [], []
    veth = VethPair()
    devices = []
    try:
        for ns, interface in zip(veth.namespaces, veth.interfaces):
            devices.append(Device(build, "udp", netns=ns, netdev=interface))
        a, b = veth.namespaces
        address_a, address_b = veth.addresses
        between = f"{address_b}@{b},{address_a}@{a}"  # the sender in b, the receiver in a, as ib_write_bw's client
        size = 65536
        runs = []
        for _ in range(RUNS):
            print("veth raw UDP throughput and ib_write_bw 64 KiB ...", flush=True)
            raw = B.run([str(build / "bench/udp_pingpong"), "1", "throughput,mtu_throughput", between]).stdout
            datagrams = B.value(r"udp_throughput_GBps value=([\d.]+)", raw)
            mtu = B.value(r"udp_throughput_mtu_GBps value=([\d.]+)", raw)
            port += 1
            iterations = max(200, int(BYTES_PER_RUN / 4 * scale / size))
            figure = gbps(write_bw(devices[0], devices[1], size, iterations, port, server_address=address_a))
            runs.append((figure, max(datagrams, mtu), datagrams, mtu))
        runs.sort(key=lambda r: r[0] / r[1])
        figure, best, datagrams, mtu = runs[len(runs) // 2]
        ratio = figure / best
        met = ratio >= 0.5
        text = ", ".join(f"{r[0]:.2f} GB/s / {r[1]:.2f} GB/s" for r in runs)
        rows = [f"| veth (MTU 1500, path MTU 1024) ib_write_bw 64 KiB between two network namespaces | {figure:.3f} GB/s "
                f"(median ratio of {len(runs)} runs: {text}) | raw UDP over the same veth just before, the better of "
                f"64 KB datagrams {datagrams:.2f} GB/s and GSO sends of 1472 B datagrams {mtu:.2f} GB/s | "
                f"{ratio * 100:.0f}% | >= 50% of raw UDP | {'yes' if met else 'no'} |"]
        baselines = [f"- raw UDP throughput between two network namespaces over a veth pair of MTU {VETH_MTU} "
                     f"(bench/udp_pingpong, sender and receiver in different namespaces): 64 KB datagrams (IP "
                     f"fragments) " + ", ".join(f"{r[2]:.2f}" for r in runs) + " GB/s; UDP GSO sends of 1472 B "
                     f"datagrams received with UDP_GRO " + ", ".join(f"{r[3]:.2f}" for r in runs) + " GB/s"]
        return rows, [met], baselines
    finally:
        for device in devices:
            device.close()
        veth.close()


def rows(build: Path, scale: float):
    """The scale rows: (table rows, one bool per goal row, baseline lines).
    SOFTVERBS_BENCH_SCALE_ROWS (a comma-separated subset of qp, idle, nxn,
    veth) runs only those, e.g. with `bench/run --only scale`."""
    chosen = set(filter(None, os.environ.get("SOFTVERBS_BENCH_SCALE_ROWS", "qp,idle,nxn,veth").split(",")))
    table, goals, baselines = [], [], []
    port = 23000
    if "qp" in chosen:
        qp_table, qp_goals, port = qp_rows(build, scale, port)
        table += qp_table
        goals += qp_goals
    if "idle" in chosen:
        idle_table, idle_goals = idle_rows(build, scale)
        table += idle_table
        goals += idle_goals
    if "nxn" in chosen:
        nxn_table, nxn_goals = all_to_all_rows(build)
        table += nxn_table
        goals += nxn_goals
    if "veth" in chosen:
        veth_table, veth_goals, veth_baselines = veth_rows(build, scale, port + 100)
        table += veth_table
        goals += veth_goals
        baselines += veth_baselines
    return table, goals, baselines
