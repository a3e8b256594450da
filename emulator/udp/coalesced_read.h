// The packets of one read from a socket connected to one RoCEv2 flow, found
// without the kernel's help. With UDP_GRO a read may hand over several
// datagrams of the flow at once, all of one size but the last; the kernel
// says that size in a control message, but asking for it makes the read a
// recvmsg, which costs ~0.13 us more than a recv that finds data and as
// much again per read that finds nothing (copying the msghdr and its iovec
// in). A polling application makes such reads all the time, and on the
// latency path that is ~0.2 us of each one-way trip. So the polling path
// reads with recv and finds the size here, from the packets themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "wire/roce_packet.h"

namespace softverbs::wire {

// What every packet of a connected flow has in common: the QP it is for
// (RC or UC, one peer QP) and that QP's path MTU, the payload of a FIRST or
// MIDDLE packet.
struct FlowReceiver {
  uint32_t qpn = 0;
  uint32_t path_mtu = 0;
};

struct FirstPacket {
  size_t bytes = 0;           // the first packet's length: that of every packet of the read but the last
  bool icrc_checked = false;  // the first packet's ICRC was found good on the way
  // A search through the read found it (equal packets, or any boundary):
  // a stream of packets whose length only their end tells, for which the
  // kernel's GRO size is cheaper (see find_first_packet).
  bool searched = false;
};

// Where the first packet of `read` ends. The headers give its length for
// most opcodes (no payload, an RDMA WRITE ONLY's RETH, a FIRST or MIDDLE
// packet's path MTU). For the others (SEND ONLY, any LAST) the read is
// tried as packets followed by a shorter one of fixed length (a request
// and the ACK held for it, as softverbs sends them), as one packet (a good
// ICRC over all of it), then searched: as equal packets, and if that fails
// for a boundary every four bytes (up to one path MTU); either search sets
// `searched`. A boundary is taken only where the next packet's BTH is the
// flow's, and one that the headers did not give only where the first
// packet's ICRC is good too, so a read is not split wrongly but for a CRC
// collision. A read that no boundary fits (its first packet damaged) is
// returned whole, for the receive path to reject.
FirstPacket find_first_packet(const FlowAddress& flow, std::span<const uint8_t> read, const FlowReceiver& receiver,
                              IcrcHeaderCache& cache);

}  // namespace softverbs::wire
