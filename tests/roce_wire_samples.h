// Sample packets and flows for the wire-format tests (roce_wire_test.cpp and
// roce_wire_icrc_test.cpp, one executable).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace softverbs::test {

inline std::vector<uint8_t> sample_payload(size_t length) {
  std::vector<uint8_t> bytes(length);
  for (size_t i = 0; i < length; ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  return bytes;
}

inline wire::TransportPacket sample_packet(uint8_t opcode_value, std::span<const uint8_t> payload) {
  wire::TransportPacket p;
  p.bth.opcode = opcode_value;
  p.bth.solicited = true;
  p.bth.pkey = 0xffff;
  p.bth.dest_qp = 0xabcdef;
  p.bth.ack_request = true;
  p.bth.psn = 0x123456;
  p.reth = {0x1122334455667788ull, 0x99aabbcc, 0x1000};
  p.aeth = {0x1f, 0x654321};
  p.atomic = {0x0102030405060708ull, 0x0a0b0c0d, 0x1111222233334444ull, 0x5555666677778888ull};
  p.atomic_ack_original = 0xdeadbeefcafef00dull;
  p.immediate = 0xabcd0123;
  p.invalidate_rkey = 0x0badf00d;
  p.deth = {0x80010000, 0x00beef};
  if (wire::opcode_info(opcode_value).headers & wire::header::kPayload) p.payload = payload;
  return p;
}

inline wire::FlowAddress ipv4_flow() {
  wire::FlowAddress flow;
  flow.source = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
  flow.destination = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2};
  flow.source_port = 0xc123;
  flow.destination_port = wire::kRoceV2Port;
  return flow;
}

inline wire::FlowAddress ipv6_flow() {
  wire::FlowAddress flow;
  flow.source = {0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  flow.destination = {0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2};
  flow.source_port = 0xd00d;
  flow.destination_port = wire::kRoceV2Port;
  flow.flow_label = 0x12345;
  return flow;
}

}  // namespace softverbs::test
