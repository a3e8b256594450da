// The RoCEv2 invariant CRC (IBA Annex A17): CRC-32 over the packet with the
// fields that routers may change masked to ones, preceded by eight bytes of
// ones standing for the LRH that RoCE does not carry.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
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

// The IPv4 identification field is covered by the ICRC, and Linux sends 0
// from softverbs' sockets, but rxe and RoCE NICs fill it and a UDP socket
// does not show it. A CRC is linear, so the identification's part of the
// ICRC is a linear function of its 16 bits: this finds the identification
// that turns `with_zero_id` (the ICRC computed with 0 there) into `received`,
// given the bytes of the ICRC's input after the field (the IPv4 header's
// last 14, the UDP header, the transport packet); nullopt if none does.
// Checking this way accepts one packet in 2^16 that a corrupted ICRC would
// otherwise reject: a 16-bit check left where a 32-bit one was.
std::optional<uint16_t> ipv4_id_for_icrc(uint32_t with_zero_id, uint32_t received, size_t bytes_after);

// Appends the ICRC to a whole IP packet; verify_icrc checks the last four bytes.
void append_icrc(std::vector<uint8_t>& ip_packet);
bool verify_icrc(std::span<const uint8_t> ip_packet);

// The four ICRC bytes of `value` (as icrc() returns it) in wire order, and back.
void store_icrc(uint32_t value, uint8_t* out);
uint32_t load_icrc(const uint8_t* in);

}  // namespace softverbs::wire
