#!/usr/bin/env python3
"""QEMU's RDMA live migration (migrate rdma:HOST:PORT) between two QEMUs run
with `softverbs run`, unmodified: a running guest of 128 MiB (its firmware
finds nothing to boot), 16 MiB of it random bytes put there by QEMU's loader
device, moves to a destination waiting with -incoming rdma:..., which stays
paused (-S); both guests' memory is then dumped (pmemsave) and compared byte
by byte.

Usage: qemu_rdma_migration.py SOFTVERBS_CLI WORK_DIR PORT [pin-all]
With pin-all, both QEMUs register the whole guest memory up front (the
rdma-pin-all capability) rather than chunk by chunk as pages are sent.
Prints "migrated N bytes of guest memory byte-exact" and exits 0, or says
what failed and exits 1.
"""
import json
import os
import socket
import subprocess
import sys
import time

GUEST_BYTES = 128 << 20
PATTERN_AT = 16 << 20
PATTERN_BYTES = 16 << 20


class Qmp:
    """A QMP connection: commands and their answers, events skipped."""

    def __init__(self, path, deadline):
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.reader = self.sock.makefile("r")
        json.loads(self.reader.readline())  # the greeting
        self.execute("qmp_capabilities")

    def execute(self, command, **arguments):
        message = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        self.sock.sendall((json.dumps(message) + "\n").encode())
        while True:
            answer = json.loads(self.reader.readline())
            if "event" in answer:
                continue
            if "error" in answer:
                raise RuntimeError(f"{command}: {answer['error']}")
            return answer["return"]


def qemu(cli, work, name, extra):
    command = [cli, "run", "--", "qemu-system-x86_64", "-nodefaults", "-display", "none", "-machine",
               "pc,accel=tcg", "-m", str(GUEST_BYTES >> 20), "-S", "-qmp",
               f"unix:{work}/{name}.qmp,server=on,wait=off", *extra]
    log = open(f"{work}/{name}.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def main():
    cli, work, port = sys.argv[1], sys.argv[2], sys.argv[3]
    pin_all = sys.argv[4:] == ["pin-all"]
    pattern = os.urandom(PATTERN_BYTES)
    with open(f"{work}/pattern.bin", "wb") as f:
        f.write(pattern)
    uri = f"rdma:127.0.0.1:{port}"
    destination = qemu(cli, work, "destination", ["-incoming", uri])
    source = qemu(cli, work, "source", ["-device", f"loader,file={work}/pattern.bin,addr={PATTERN_AT:#x}"])
    try:
        deadline = time.monotonic() + 30
        dst = Qmp(f"{work}/destination.qmp", deadline)
        src = Qmp(f"{work}/source.qmp", deadline)
        if pin_all:
            for qmp in (src, dst):
                qmp.execute("migrate-set-capabilities", capabilities=[{"capability": "rdma-pin-all", "state": True}])
        src.execute("cont")
        time.sleep(0.5)  # the firmware runs and writes memory while it is sent
        src.execute("migrate", uri=uri)
        status = None
        while time.monotonic() < deadline:
            status = src.execute("query-migrate")
            if status.get("status") in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.05)
        if status.get("status") != "completed":
            print(f"migration did not complete: {status}")
            return 1
        while dst.execute("query-status")["status"] == "inmigrate" and time.monotonic() < deadline:
            time.sleep(0.05)
        for qmp, name in ((src, "source"), (dst, "destination")):
            qmp.execute("pmemsave", val=0, size=GUEST_BYTES, filename=f"{work}/{name}.mem")
        with open(f"{work}/source.mem", "rb") as f:
            before = f.read()
        with open(f"{work}/destination.mem", "rb") as f:
            after = f.read()
        if before[PATTERN_AT:PATTERN_AT + PATTERN_BYTES] != pattern:
            print("the source guest does not hold the loader's bytes")
            return 1
        if after != before:
            first = next(i for i in range(min(len(before), len(after))) if before[i] != after[i])
            print(f"the guests' memory differs (sizes {len(before)}, {len(after)}; first at {first:#x})")
            return 1
        ram = status.get("ram", {})
        print(f"migrated {len(after)} bytes of guest memory byte-exact "
              f"({ram.get('normal', 0)} pages sent, {ram.get('duplicate', 0)} duplicate)")
        for qmp in (src, dst):
            qmp.execute("quit")
        return 0
    finally:
        for process in (source, destination):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


if __name__ == "__main__":
    sys.exit(main())
