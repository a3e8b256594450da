#!/usr/bin/python3
"""Checks the ICRC of every RoCEv2 packet in a pcap with scapy's own
implementation (scapy.contrib.roce), independent of softverbs' code.

usage: check_icrc.py CAPTURE.pcap
The capture holds IP packets (softverbs capture) or Ethernet frames (a
kernel capture on a netdev, whose IP headers carry the identifications the
kernel gave). Prints "checked N packets, M bad, K IPv6 skipped, J nonzero
identifications" and exits 1 if any ICRC differs or the capture holds no
RoCEv2 packet. scapy computes the ICRC for IPv4 only; IPv6 packets are
counted as skipped."""
import sys

from scapy.all import IP, IPv6, UDP, raw, rdpcap
from scapy.contrib.roce import BTH


def main(path):
    checked = bad = skipped = identified = 0
    for number, frame in enumerate(rdpcap(path), start=1):
        if IPv6 in frame:
            skipped += 1
            continue
        data = raw(frame[IP]) if IP in frame else raw(frame)
        if data[0] >> 4 != 4:
            skipped += 1
            continue
        packet = IP(data)
        if UDP not in packet or packet[UDP].dport != 4791 or BTH not in packet:
            continue
        carried = data[-4:]
        fresh = IP(data)
        fresh[BTH].icrc = None  # scapy recomputes it when the packet is built
        computed = raw(fresh)[-4:]
        checked += 1
        identified += packet.id != 0
        if computed != carried:
            bad += 1
            print(f"packet {number}: ICRC {carried.hex()} but scapy computes {computed.hex()}")
    print(f"checked {checked} packets, {bad} bad, {skipped} IPv6 skipped, {identified} nonzero identifications")
    return 0 if checked > 0 and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
