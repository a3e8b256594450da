#include "udp/coalesced_read.h"

#include <algorithm>
#include <array>
#include <cstdint>

#include "wire/roce_headers.h"

namespace softverbs::wire {

namespace {

// The shortest packet: a BTH and the ICRC.
constexpr size_t kShortest = kBthBytes + kIcrcBytes;
// UDP GRO coalesces at most 64 datagrams into one (UDP_GRO_CNT_MAX).
constexpr uint32_t kMostPacketsPerRead = 64;
// The lengths of the packets without a payload (ACK; ATOMIC ACK; READ
// request; compare&swap and fetch&add), which may end a read of longer ones.
constexpr std::array<size_t, 4> kFixedLengths = {kBthBytes + 4 + kIcrcBytes, kBthBytes + 4 + 8 + kIcrcBytes,
                                                 kBthBytes + 16 + kIcrcBytes, kBthBytes + 28 + kIcrcBytes};

uint16_t load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
uint32_t load24(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) << 16 | static_cast<uint32_t>(p[1]) << 8 | p[2];
}
uint32_t load32(const uint8_t* p) { return static_cast<uint32_t>(load16(p)) << 16 | load16(p + 2); }

// What the packets of one read share, to recognize where the next begins.
struct Flow {
  uint32_t qpn;
  uint8_t service;  // the opcode's top three bits
  uint16_t pkey;
  // Also packets for other QPs: two QP pairs whose UDP source ports
  // collide (flow_source_port) share the flow, and GRO mixes their packets.
  bool any_qpn;
};

// Whether a BTH of the flow's could begin `offset` bytes into `read`.
bool begins_packet(std::span<const uint8_t> read, size_t offset, const Flow& flow) {
  if (offset % 4 != 0 || offset >= read.size() || read.size() - offset < kShortest) return false;
  const uint8_t* bth = read.data() + offset;
  return (bth[0] & 0xe0) == flow.service && opcode_info(bth[0]).valid && (bth[1] & 0x0f) == 0 &&
         load16(bth + 2) == flow.pkey && (flow.any_qpn || load24(bth + 5) == flow.qpn);
}

// The length of the packet at the start of `read` where its headers give
// it; 0 where only its end does.
size_t known_length(std::span<const uint8_t> read, uint32_t path_mtu) {
  const OpcodeInfo& info = opcode_info(read[0]);
  const size_t headers = header_bytes(info);
  if (!(info.headers & header::kPayload)) return headers + kIcrcBytes;
  // FIRST and MIDDLE packets carry a whole path MTU; a WRITE ONLY's RETH
  // gives its length; the rest end where the read does.
  if (info.position == OpPosition::First || info.position == OpPosition::Middle) return headers + path_mtu + kIcrcBytes;
  if (info.kind == OpKind::Write && info.position == OpPosition::Only) {
    const size_t reth = kBthBytes + (info.xrceth ? 4 : 0);  // an XRC request's XRCETH comes first
    if (read.size() < reth + 16) return 0;
    const uint32_t length = load32(read.data() + reth + 12);  // the RETH's DMA length
    return length <= path_mtu ? headers + length + pad_bytes(length) + kIcrcBytes : 0;
  }
  return 0;
}

// find_first_packet with boundaries where the BTH is for `flow`'s QP, or
// for any QP.
FirstPacket find_first_packet_of(const FlowAddress& address, std::span<const uint8_t> read,
                                 const FlowReceiver& receiver, IcrcHeaderCache& cache, bool any_qpn) {
  const size_t total = read.size();
  const FirstPacket whole{total, false, false};
  if (total < kShortest || total > UINT32_MAX || !opcode_info(read[0]).valid) return whole;
  const Flow flow{receiver.qpn, static_cast<uint8_t>(read[0] & 0xe0), load16(read.data() + 2), any_qpn};
  const uint32_t path_mtu = receiver.path_mtu != 0 ? receiver.path_mtu : 4096;
  // Whether the first `bytes` of the read are a packet with a good ICRC.
  // Only the packet taken in the end teaches the cache about its sender.
  IcrcFit taken_fit = IcrcFit::kNone;
  auto icrc_good = [&](size_t bytes) {
    const IcrcFit fit = icrc_fit(address, read.first(bytes), cache);
    if (!cache.takes(address, fit)) return false;
    taken_fit = fit;
    return true;
  };
  auto found = [&](size_t bytes, bool searched) {
    cache.learn(address, taken_fit);
    return FirstPacket{bytes, true, searched};
  };
  // A packet boundary `bytes` into the read, the first packet's ICRC good.
  auto ends_first = [&](size_t bytes) {
    return bytes >= kShortest && begins_packet(read, bytes, flow) && icrc_good(bytes);
  };

  const size_t longest = header_bytes(opcode_info(read[0])) + path_mtu + kIcrcBytes;
  if (const size_t known = known_length(read, path_mtu); known != 0) {
    if (known >= total) return whole;  // one packet (or a malformed one, which the receive path rejects)
    // Taken with a bad ICRC too: the first packet is dropped, not the rest.
    if (begins_packet(read, known, flow)) return {known, check_icrc(address, read.first(known), cache), false};
  }
  // Packets and a shorter one of fixed length at the end (a request and
  // the ACK held for it). Divisions in 32 bits: a 64-bit one costs up to
  // four times as much here, and reads are at most 64 KiB.
  const auto bytes32 = static_cast<uint32_t>(total);
  for (size_t last : kFixedLengths) {
    if (total < last + kShortest || !begins_packet(read, total - last, flow)) continue;
    const OpcodeInfo& info = opcode_info(read[total - last]);
    if ((info.headers & header::kPayload) || header_bytes(info) + kIcrcBytes != last) continue;
    const uint32_t before = bytes32 - static_cast<uint32_t>(last);
    for (uint32_t count = 1; count < kMostPacketsPerRead && before / count >= kShortest; ++count) {
      if (before % count == 0 && ends_first(before / count)) return found(before / count, false);
    }
  }
  // One packet that only its end gives the length of.
  if (total <= longest && icrc_good(total)) return found(total, false);
  // Equal packets (a GSO send, or GRO's coalescing of a stream). The first
  // boundary candidate where the flow's BTH sits may span several packets
  // (half of 64 ...); in a stream of requests, which take consecutive PSNs,
  // the PSN found there says how many, and saves an ICRC over each.
  for (uint32_t count = 2; count <= kMostPacketsPerRead && bytes32 / count >= kShortest; ++count) {
    const uint32_t length = bytes32 / count;
    if (bytes32 % count != 0 || !begins_packet(read, length, flow)) continue;
    const uint32_t packets = (load24(read.data() + length + 9) - load24(read.data() + 9)) & 0xffffff;
    if (packets > 1 && packets <= kMostPacketsPerRead && length % packets == 0 && ends_first(length / packets))
      return found(length / packets, true);
    if (ends_first(length)) return found(length, true);
  }
  // Anything else GRO may coalesce: the boundary wherever it is.
  const size_t limit = std::min(total - kShortest, longest);
  for (size_t bytes = kShortest; bytes <= limit; bytes += 4) {
    if (ends_first(bytes)) return found(bytes, true);
  }
  return {total, false, true};
}

}  // namespace

FirstPacket find_first_packet(const FlowAddress& address, std::span<const uint8_t> read, const FlowReceiver& receiver,
                              IcrcHeaderCache& cache) {
  const FirstPacket first = find_first_packet_of(address, read, receiver, cache, false);
  // Nothing found with the flow's QP: packets for another QP that shares
  // the flow may follow the first (the QPN no longer narrows the search).
  if (first.searched && !first.icrc_checked && first.bytes == read.size())
    return find_first_packet_of(address, read, receiver, cache, true);
  return first;
}

}  // namespace softverbs::wire
