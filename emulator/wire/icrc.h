// The RoCEv2 invariant CRC (IBA Annex A17): CRC-32 over the packet with the
// fields that routers may change masked to ones, preceded by eight bytes of
// ones standing for the LRH that RoCE does not carry.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "wire/crc32.h"

namespace softverbs::wire {

// The ICRC of a RoCEv2 packet given as its IP and UDP headers (`headers`,
// IPv4 or IPv6) and the UDP payload up to, not including, the ICRC
// (`transport`, starting with the BTH). Returned as the four bytes travel
// (least significant byte first), packed into a host integer by position.
uint32_t icrc(std::span<const uint8_t> headers, std::span<const uint8_t> transport);

// The same in pieces: icrc_headers() covers the masked IP and UDP headers,
// which are the same for every datagram of one flow and length
// (roce_packet.h keeps them); icrc_add_transport() goes on over a transport
// packet's start (the BTH, masked, and what follows it in that span);
// continue with crc32() over the pieces after it and invert the result to
// get what icrc() returns. icrc_from_headers() does the last two steps for a
// transport packet in one span.
uint32_t icrc_headers(std::span<const uint8_t> headers);
uint32_t icrc_add_transport(uint32_t crc, std::span<const uint8_t> transport);
uint32_t icrc_from_headers(uint32_t headers_crc, std::span<const uint8_t> transport);

// The same for a whole IP packet without its ICRC.
uint32_t icrc(std::span<const uint8_t> ip_packet_without_icrc);

// The IPv4 identification field is covered by the ICRC, and a UDP socket
// does not show it. Linux gives a datagram that a socket sends alone with
// Don't Fragment set identification 0, and the datagrams of one UDP GSO
// send 0, 1, 2, ... in order (the segmentation numbers them, in software or
// in the NIC); rxe and RoCE NICs pick theirs. A CRC is linear, so the
// identification's part of the ICRC is a linear function of its 16 bits,
// which depends on how many bytes follow the field (the IPv4 header's last
// 14, the UDP header, the transport packet). This finds the identification
// that explains a received ICRC, and the change one makes to the ICRC
// computed with 0. Accepting some identification leaves 16 bits of the
// CRC's 32 to catch damage; one below kSegmentIdentifications, 25.
// Kept per length; one owner at a time (not thread-safe).
inline constexpr size_t kSegmentIdentifications = 128;
// The bytes of the ICRC's input after the identification field of a
// datagram of `udp_payload` bytes, its ICRC included.
constexpr size_t bytes_after_ipv4_identification(size_t udp_payload) { return 14 + 8 + udp_payload - 4; }

class IdentificationSolver {
 public:
  // What XORed into the ICRC computed with identification 0 gives the one
  // for `id`.
  uint32_t change(uint16_t id, size_t bytes_after);
  // The identification whose change is `difference` (the ICRC received XOR
  // the one computed with 0), if any.
  std::optional<uint16_t> solve(uint32_t difference, size_t bytes_after);

 private:
  static constexpr size_t kBits = 16;
  static constexpr size_t kLengthsKept = 8192;  // more than a path MTU's lengths
  struct Length {
    size_t bytes_after = 0;                // 0: empty
    std::array<uint32_t, kBits> images{};  // the change each bit alone makes
    // The images reduced to one pivot bit each, and the bits that make each.
    std::array<uint32_t, kBits> reduced{};
    std::array<uint32_t, kBits> pivots{};
    std::array<uint16_t, kBits> ids{};
    size_t rows = 0;
  };
  // A length in use, with the change of each GSO place and those changes
  // hashed (open addressing, place + 1 in `slot_place`, 0 empty): one load
  // for a sender's datagram and a probe or two for a receiver's, where the
  // elimination would take sixteen steps.
  struct Recent {
    Length length;
    std::array<uint32_t, kSegmentIdentifications> place_change{};
    std::array<uint32_t, 2 * kSegmentIdentifications> slot_change{};
    std::array<uint8_t, 2 * kSegmentIdentifications> slot_place{};
  };
  static Length make_length(size_t bytes_after);
  Recent& recent(size_t bytes_after);
  std::array<Recent, 16> recent_{};
  std::unordered_map<size_t, Length> all_;
};

// Appends the ICRC to a whole IP packet; verify_icrc checks the last four bytes.
void append_icrc(std::vector<uint8_t>& ip_packet);
bool verify_icrc(std::span<const uint8_t> ip_packet);

// The four ICRC bytes of `value` (as icrc() returns it) in wire order, and back.
void store_icrc(uint32_t value, uint8_t* out);
uint32_t load_icrc(const uint8_t* in);

}  // namespace softverbs::wire
