// A RoCEv2 packet in its UDP datagram: the IP and UDP headers that the
// kernel puts in front of it, which the ICRC covers and a capture shows.
// Our IPv4 sockets send with DF set and are not connected, so Linux gives a
// datagram sent alone identification 0 and those of a GSO send 0, 1, 2, ...;
// the headers built here say 0, and the sender's batch (udp/send_batch.cpp)
// and the receiver account for the others (icrc.h).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "wire/icrc.h"

namespace softverbs::wire {

// An IP address as a GID holds it: IPv6, or IPv4-mapped (::ffff:a.b.c.d).
using IpAddress = std::array<uint8_t, 16>;

bool is_ipv4_mapped(const IpAddress& address);
std::string format_address(const IpAddress& address);

struct FlowAddress {
  IpAddress source{};
  IpAddress destination{};
  uint16_t source_port = 0;
  uint16_t destination_port = 0;
  uint8_t traffic_class = 0;  // masked in the ICRC; shown in captures
  uint8_t hop_limit = 64;
  uint32_t flow_label = 0;  // IPv6 only

  bool ipv4() const { return is_ipv4_mapped(source); }
};

inline constexpr size_t kMaxIpUdpHeaders = 40 + 8;

// Writes the IP and UDP headers of a datagram carrying `udp_payload` bytes
// into `out` (at least kMaxIpUdpHeaders); returns their length (28 or 48).
// With `checksums` the IPv4 header and UDP checksums are filled in as the
// kernel would; without, they are left 0 (the ICRC masks them anyway).
size_t write_ip_udp_headers(const FlowAddress& flow, size_t udp_payload, bool checksums, std::span<uint8_t> out,
                            std::span<const uint8_t> payload_for_checksum = {});

// How a datagram's ICRC fits: not at all; with IPv4 identification 0 (or
// IPv6), as a datagram sent alone or first in a GSO send; with one below
// kSegmentIdentifications, as a later datagram's place in a GSO send; or
// only with some other, as rxe and RoCE NICs send (they count up from
// anywhere, so now and then through 0 and the low ones too). The
// identification is not seen through a UDP socket, and checking for "some"
// leaves 16 bits of the 32 (icrc.h).
enum class IcrcFit : uint8_t { kNone, kAsSent, kGsoPlace, kSomeIdentification };

// The ICRC register after the masked IP and UDP headers of a datagram of
// `udp_payload` bytes on `flow` (icrc_headers()), kept for the few flows
// and lengths in use at once (a ping-pong's request and ACK, a stream's
// MTU-sized packets): a packet then costs the CRC of its own bytes only.
// The fields the ICRC masks (traffic class, hop limit, flow label) are not
// part of the key.
// It also learns which senders (address and port) send as softverbs does:
// from those a packet that fits only another identification is damaged,
// so they keep a 25-bit check. A sender counts as one after a few packets
// fit identification 0 with none between that fits only another (a
// counter that passes 0 goes on to 128 and beyond), and stops counting as
// one after a few in a row fit only another (another program took its port).
// One owner at a time (not thread-safe).
class IcrcHeaderCache {
 public:
  uint32_t headers_crc(const FlowAddress& flow, size_t udp_payload);
  // Whether a packet from `flow`'s sender that fits so is taken.
  bool takes(const FlowAddress& flow, IcrcFit fit);
  // Counts a packet that was taken or refused on `flow`.
  void learn(const FlowAddress& flow, IcrcFit fit);
  // The IPv4 identification that explains `difference`, the ICRC received
  // XOR the one computed with 0 (icrc.h).
  std::optional<uint16_t> identification(uint32_t difference, size_t bytes_after) {
    return identifications_.solve(difference, bytes_after);
  }
  // What XORed into the ICRC computed with 0 gives the one for `id`: the
  // sender's side, from the same tables (a GSO send's places).
  uint32_t identification_change(uint16_t id, size_t bytes_after) { return identifications_.change(id, bytes_after); }

 private:
  struct Entry {
    IpAddress source{};
    IpAddress destination{};
    uint16_t source_port = 0;
    uint16_t destination_port = 0;
    uint32_t udp_payload = 0;  // 0: empty (a datagram carries at least a BTH)
    uint32_t crc = 0;
  };
  struct Sender {
    IpAddress address{};
    uint16_t port = 0;
    uint8_t as_sent_run = 0;  // packets that fit identification 0, no other between
    uint8_t other_run = 0;    // packets in a row that fit only another one
    bool sends_as_softverbs = false;
  };
  Sender& sender(const FlowAddress& flow);
  static constexpr size_t kEntries = 16;
  static constexpr size_t kSenders = 64;
  std::array<Entry, kEntries> entries_{};
  IdentificationSolver identifications_;
  std::array<Sender, kSenders> senders_{};
};

// Appends the ICRC to `transport` (BTH .. pad) for a datagram sent on `flow`.
void seal(const FlowAddress& flow, std::vector<uint8_t>& transport);
// How the datagram's last four bytes fit as the ICRC for `flow`.
IcrcFit icrc_fit(const FlowAddress& flow, std::span<const uint8_t> datagram, IcrcHeaderCache& cache);
// True if the datagram's last four bytes are the ICRC for `flow`, from a
// sender not known (yet) to send identification 0.
bool check_icrc(const FlowAddress& flow, std::span<const uint8_t> datagram);
// The same, the headers' part of the ICRC taken from (or kept in) `cache`,
// which also learns from the packet and holds its sender to what it knows.
bool check_icrc(const FlowAddress& flow, std::span<const uint8_t> datagram, IcrcHeaderCache& cache);

// The whole IP packet (headers with checksums, then the datagram), as a
// capture shows it.
std::vector<uint8_t> ip_packet(const FlowAddress& flow, std::span<const uint8_t> datagram);

// The UDP source port of a RoCEv2 flow between two QPs: in 0xc000..0xffff
// (the range rxe and RoCE NICs use), stable for the pair.
uint16_t flow_source_port(uint32_t source_qpn, uint32_t destination_qpn);

}  // namespace softverbs::wire
