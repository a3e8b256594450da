#!/usr/bin/python3
"""Prints RoCEv2 packets built by scapy (scapy.contrib.roce), an
implementation independent of softverbs', one per line as hex of the whole
IPv4 packet, with the IPv4 identification set as rxe and RoCE NICs set it
(nonzero, changing from packet to packet; Don't Fragment set, as rxe sets
it) and the ICRC scapy computes over it. Then the same packets with one payload byte changed, marked "bad".

usage: scapy_roce_packets.py COUNT"""
import random
import sys

from scapy.all import IP, UDP, Raw, raw
from scapy.contrib.roce import BTH

# Opcodes (RC): SEND ONLY, SEND MIDDLE.
OPCODES = [0x04, 0x01]


def packet(random_source, identification):
    payload_length = random_source.choice([0, 4, 60, 256, 1024])
    payload = bytes(random_source.randrange(256) for _ in range(payload_length))
    # As rxe sends them: Don't Fragment set, an identification that changes.
    built = (IP(src="10.0.0.1", dst="10.0.0.2", id=identification, flags="DF", ttl=64) /
             UDP(sport=0xc000 | random_source.randrange(0x4000), dport=4791, chksum=0) /
             BTH(opcode=random_source.choice(OPCODES), dqpn=random_source.randrange(1 << 24),
                 psn=random_source.randrange(1 << 24)) /
             Raw(payload))
    return raw(built)


def main(count):
    random_source = random.Random(4791)
    packets = [packet(random_source, random_source.randrange(1, 1 << 16)) for _ in range(count)]
    for data in packets:
        print("good", data.hex())
    for data in packets:
        if len(data) <= 28 + 12 + 4:
            continue
        changed = bytearray(data)
        changed[28 + 12] ^= 0x20  # the first byte after the BTH
        print("bad", bytes(changed).hex())
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
