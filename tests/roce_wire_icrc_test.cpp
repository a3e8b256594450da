// The RoCEv2 ICRC and the IP/UDP framing around it, and the CRC-32 it is
// made of (part of the roce_wire_test executable).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>

#include "process_runner.h"
#include "roce_wire_samples.h"
#include "wire/crc32_fold.h"
#include "wire/icrc.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace softverbs {
namespace {

using namespace wire;
using namespace test;

TEST(Icrc, SealedPacketsCheckAndEveryFlippedBitIsCaught) {
  for (const FlowAddress& flow : {ipv4_flow(), ipv6_flow()}) {
    auto payload = sample_payload(61);
    auto bytes = build(sample_packet(opcode(Service::Rc, op::kSendOnly), payload));
    seal(flow, bytes);
    ASSERT_TRUE(check_icrc(flow, bytes));
    for (size_t bit = 0; bit < bytes.size() * 8; ++bit) {
      // BTH byte 4 (FECN, BECN, reserved) is masked: changing it is allowed.
      if (bit / 8 == 4) continue;
      auto flipped = bytes;
      flipped[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      EXPECT_FALSE(check_icrc(flow, flipped)) << "bit " << bit;
    }
    auto congested = bytes;
    congested[4] |= 0xc0;
    EXPECT_TRUE(check_icrc(flow, congested)) << "FECN/BECN may change on the way";
  }
}

TEST(Icrc, MaskedIpFieldsDoNotCountAndTheAddressesDo) {
  auto bytes = build(sample_packet(opcode(Service::Rc, op::kAcknowledge), {}));
  FlowAddress flow = ipv4_flow();
  seal(flow, bytes);
  FlowAddress routed = flow;
  routed.hop_limit = 3;
  routed.traffic_class = 0x28;  // DSCP/ECN rewritten by a router
  EXPECT_TRUE(check_icrc(routed, bytes));
  FlowAddress other_source = flow;
  other_source.source[15] = 9;
  EXPECT_FALSE(check_icrc(other_source, bytes));
  FlowAddress other_port = flow;
  other_port.source_port = 0xc124;
  EXPECT_FALSE(check_icrc(other_port, bytes));

  auto bytes6 = build(sample_packet(opcode(Service::Rc, op::kAcknowledge), {}));
  FlowAddress flow6 = ipv6_flow();
  seal(flow6, bytes6);
  FlowAddress relabelled = flow6;
  relabelled.flow_label = 0xfffff;
  relabelled.traffic_class = 0xb8;
  relabelled.hop_limit = 1;
  EXPECT_TRUE(check_icrc(relabelled, bytes6));
}

// rxe and RoCE NICs fill the IPv4 identification, which the ICRC covers and
// a UDP socket does not show: a packet is accepted when some identification
// makes its ICRC right, and a damaged one is still refused.
TEST(Icrc, PacketsSentWithAnyIpv4IdentificationAreAccepted) {
  const FlowAddress flow = ipv4_flow();
  uint32_t state = 12345;
  const auto next = [&] { return state = state * 1103515245u + 12345u; };
  for (int round = 0; round < 200; ++round) {
    auto bytes = build(sample_packet(opcode(Service::Rc, op::kSendOnly), sample_payload(round * 7 % 300)));
    bytes.resize(bytes.size() + kIcrcBytes);
    // The ICRC as a sender with identification `id` computes it.
    std::vector<uint8_t> packet = ip_packet(flow, bytes);
    const uint16_t id = static_cast<uint16_t>(next() >> 8);
    packet[4] = static_cast<uint8_t>(id >> 8);
    packet[5] = static_cast<uint8_t>(id);
    packet.resize(packet.size() - kIcrcBytes);
    store_icrc(icrc(packet), bytes.data() + bytes.size() - kIcrcBytes);
    EXPECT_TRUE(check_icrc(flow, bytes)) << "identification " << id;
    auto damaged = bytes;
    damaged[kBthBytes + (round % 5)] ^= static_cast<uint8_t>(1u << (round % 8));
    EXPECT_FALSE(check_icrc(flow, damaged)) << "identification " << id << ", round " << round;
    FlowAddress elsewhere = flow;
    elsewhere.source[15] ^= 1;
    EXPECT_FALSE(check_icrc(elsewhere, bytes)) << "the addresses still count";
  }
}

// The packet of `round` on `flow` with its ICRC as a sender using IPv4
// identification `id` computes it.
std::vector<uint8_t> packet_sent_with_identification(const FlowAddress& flow, int round, uint16_t id) {
  auto bytes = build(sample_packet(opcode(Service::Rc, op::kSendOnly), sample_payload(64 + round % 200)));
  bytes.resize(bytes.size() + kIcrcBytes);
  std::vector<uint8_t> packet = ip_packet(flow, bytes);
  packet[4] = static_cast<uint8_t>(id >> 8);
  packet[5] = static_cast<uint8_t>(id);
  packet.resize(packet.size() - kIcrcBytes);
  store_icrc(icrc(packet), bytes.data() + bytes.size() - kIcrcBytes);
  return bytes;
}

// softverbs' datagrams carry identification 0 when sent alone and their
// place in a GSO send (below kSegmentIdentifications) otherwise; rxe and
// NICs pick any. Damage that happens to fit some other identification (1
// in 2^16 of it) is refused from a sender known to send as softverbs does:
// over a lossy link with corruption a soak test met such a packet. A sender
// that starts using other identifications (rxe took the port) is taken
// again after a few packets.
TEST(Icrc, ASenderOfSegmentIdentificationsKeepsTheStrongerCheck) {
  const FlowAddress flow = ipv4_flow();
  std::vector<uint8_t> damaged;
  {
    IcrcHeaderCache cache;
    const auto good = packet_sent_with_identification(flow, 0, 0);
    for (size_t at = kBthBytes; damaged.empty() && at + 1 < good.size() - kIcrcBytes; at += 2) {
      auto candidate = good;
      for (uint32_t change = 1; change <= 0xffff; ++change) {
        candidate[at] = static_cast<uint8_t>(good[at] ^ (change >> 8));
        candidate[at + 1] = static_cast<uint8_t>(good[at + 1] ^ change);
        if (icrc_fit(flow, candidate, cache) == IcrcFit::kSomeIdentification) {
          damaged = candidate;
          break;
        }
      }
    }
    ASSERT_FALSE(damaged.empty()) << "no damage of two bytes fits another identification";
  }
  IcrcHeaderCache fresh;
  EXPECT_TRUE(check_icrc(flow, damaged, fresh)) << "from a sender not known, it cannot be told from rxe's";

  IcrcHeaderCache cache;
  EXPECT_EQ(icrc_fit(flow, packet_sent_with_identification(flow, 0, 0), cache), IcrcFit::kAsSent);
  for (uint16_t place = 1; place < kSegmentIdentifications; ++place)
    ASSERT_EQ(icrc_fit(flow, packet_sent_with_identification(flow, place, place), cache), IcrcFit::kGsoPlace) << place;
  // A counter passing through 0 (rxe, a NIC) is not taken for softverbs.
  for (uint32_t id = 0xfffe; id < 0x10000 + 200; ++id)
    ASSERT_TRUE(check_icrc(flow, packet_sent_with_identification(flow, 1, static_cast<uint16_t>(id)), cache)) << id;
  EXPECT_TRUE(check_icrc(flow, damaged, cache)) << "a counting sender keeps the 16-bit check";
  // GSO sends of 50: their first datagrams are 0, the others their places.
  for (int send = 0; send < 3; ++send)
    for (uint16_t place = 0; place < 50; ++place)
      ASSERT_TRUE(check_icrc(flow, packet_sent_with_identification(flow, place, place), cache));
  EXPECT_FALSE(check_icrc(flow, damaged, cache));
  FlowAddress other_port = flow;
  other_port.source_port ^= 1;
  EXPECT_TRUE(check_icrc(other_port, packet_sent_with_identification(other_port, 1, 0x1234), cache))
      << "each sender is learned by itself";
  ASSERT_TRUE(check_icrc(flow, packet_sent_with_identification(flow, 9, 0), cache));
  for (int round = 0; round < 3; ++round) {
    EXPECT_FALSE(
        check_icrc(flow, packet_sent_with_identification(flow, round, static_cast<uint16_t>(0x700 + round)), cache))
        << round;
  }
  EXPECT_TRUE(check_icrc(flow, packet_sent_with_identification(flow, 3, 0x4321), cache)) << "a new sender on the port";
  EXPECT_TRUE(check_icrc(flow, packet_sent_with_identification(flow, 4, 0x4322), cache));
  EXPECT_TRUE(check_icrc(flow, packet_sent_with_identification(flow, 5, 0), cache)) << "identification 0 fits always";
}

// The change an identification makes to the ICRC, XORed into the one
// computed with 0, gives the ICRC of the packet with that identification.
TEST(Icrc, AnIdentificationsChangeTurnsTheIcrcComputedWithZeroIntoItsOwn) {
  const FlowAddress flow = ipv4_flow();
  IdentificationSolver solver;
  for (uint16_t id : {uint16_t{1}, uint16_t{2}, uint16_t{77}, uint16_t{127}, uint16_t{0x8001}, uint16_t{0xffff}}) {
    const auto with_zero = packet_sent_with_identification(flow, 3, 0);
    const auto with_id = packet_sent_with_identification(flow, 3, id);
    ASSERT_EQ(with_zero.size(), with_id.size());
    const size_t at = with_zero.size() - kIcrcBytes;
    const uint32_t change = solver.change(id, bytes_after_ipv4_identification(with_zero.size()));
    EXPECT_EQ(load_icrc(with_zero.data() + at) ^ change, load_icrc(with_id.data() + at)) << id;
    EXPECT_EQ(solver.solve(change, bytes_after_ipv4_identification(with_zero.size())), id) << id;
  }
}

// Packets that scapy's RoCE layer builds (tests/scripts/scapy_roce_packets.py),
// with nonzero identifications: softverbs takes every one, and refuses each
// with a changed byte.
TEST(Icrc, AnIndependentImplementationsPacketsWithIdentificationsAreAccepted) {
  const auto generated = test::run_process({SCAPY_PACKETS_SCRIPT, "40"});
  if (generated.exit_code != 0 && generated.err.find("No module named 'scapy'") != std::string::npos)
    GTEST_SKIP() << "python3-scapy is not installed";
  ASSERT_EQ(generated.exit_code, 0) << generated.err;
  std::istringstream lines(generated.out);
  std::string verdict, hex;
  size_t good = 0, bad = 0, nonzero_ids = 0;
  while (lines >> verdict >> hex) {
    std::vector<uint8_t> packet;
    for (size_t i = 0; i + 1 < hex.size(); i += 2)
      packet.push_back(static_cast<uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
    ASSERT_GE(packet.size(), 28u + kBthBytes + kIcrcBytes);
    FlowAddress flow;
    flow.source = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, packet[12], packet[13], packet[14], packet[15]};
    flow.destination = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, packet[16], packet[17], packet[18], packet[19]};
    flow.source_port = static_cast<uint16_t>(packet[20] << 8 | packet[21]);
    flow.destination_port = static_cast<uint16_t>(packet[22] << 8 | packet[23]);
    const std::span<const uint8_t> datagram(packet.data() + 28, packet.size() - 28);
    if (verdict == "good") {
      ++good;
      nonzero_ids += (packet[4] | packet[5]) != 0;
      EXPECT_TRUE(check_icrc(flow, datagram)) << hex;
      EXPECT_TRUE(parse(datagram.first(datagram.size() - kIcrcBytes))) << hex;
    } else {
      ++bad;
      EXPECT_FALSE(check_icrc(flow, datagram)) << hex;
    }
  }
  EXPECT_EQ(good, 40u);
  EXPECT_GT(bad, 30u);
  EXPECT_EQ(nonzero_ids, good);
}

TEST(Icrc, TheHeaderCacheGivesTheSameVerdictsAcrossFlowsAndLengths) {
  // Many more flows than the cache holds, each set differing from the
  // others in one field of the key only, visited in turn and again: entries
  // are replaced, and a slot often holds another flow when asked. Every
  // verdict must be the one computed without the cache.
  IcrcHeaderCache cache;
  std::vector<std::vector<FlowAddress>> sets;
  for (const FlowAddress& base : {ipv4_flow(), ipv6_flow()}) {
    std::vector<FlowAddress> by_source, by_destination, by_source_port, by_destination_port, by_prefix;
    for (uint16_t n = 0; n < 40; ++n) {
      FlowAddress flow = base;
      flow.source[15] = static_cast<uint8_t>(n + 1);
      by_source.push_back(flow);
      flow = base;
      flow.destination[15] = static_cast<uint8_t>(n + 1);
      by_destination.push_back(flow);
      flow = base;
      flow.source_port = static_cast<uint16_t>(0xc000 + n);
      by_source_port.push_back(flow);
      flow = base;
      flow.destination_port = static_cast<uint16_t>(0x1000 + n);
      by_destination_port.push_back(flow);
      flow = base;
      flow.destination[3] = static_cast<uint8_t>(n + 1);  // high bytes: an IPv6 prefix
      by_prefix.push_back(flow);
    }
    sets.insert(sets.end(), {by_source, by_destination, by_source_port, by_destination_port});
    if (!base.ipv4()) sets.push_back(by_prefix);  // IPv4-mapped addresses have no such byte
  }
  for (size_t s = 0; s < sets.size(); ++s) {
    const auto& flows = sets[s];
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t f = 0; f < flows.size(); ++f) {
        for (size_t length : {size_t{0}, size_t{61}, size_t{4096}, 4100 + f}) {
          auto bytes = build(sample_packet(opcode(Service::Rc, op::kSendOnly), sample_payload(length)));
          seal(flows[f], bytes);
          ASSERT_TRUE(check_icrc(flows[f], bytes, cache)) << "set " << s << " flow " << f << " length " << length;
          const FlowAddress& other = flows[(f + 1) % flows.size()];
          ASSERT_FALSE(check_icrc(other, bytes, cache)) << "set " << s << " flow " << f << " as the next one";
          FlowAddress routed = flows[f];
          routed.hop_limit = 2;
          routed.traffic_class = 0x2a;
          routed.flow_label = 0xabcde;
          ASSERT_TRUE(check_icrc(routed, bytes, cache)) << "masked fields are not part of the key";
          auto flipped = bytes;
          flipped.back() ^= 0x01;
          ASSERT_FALSE(check_icrc(flows[f], flipped, cache));
        }
      }
    }
  }
}

TEST(Icrc, WholeIpPacketFormAgreesWithTheFlowForm) {
  auto payload = sample_payload(100);
  for (const FlowAddress& flow : {ipv4_flow(), ipv6_flow()}) {
    auto bytes = build(sample_packet(opcode(Service::Ud, op::kSendOnlyImm), payload));
    seal(flow, bytes);
    auto packet = ip_packet(flow, bytes);
    EXPECT_TRUE(verify_icrc(packet));
    EXPECT_EQ(packet.size(), bytes.size() + (flow.ipv4() ? 28u : 48u));
    if (flow.ipv4()) {
      EXPECT_EQ(packet[0], 0x45);
      EXPECT_EQ(packet[9], 17);
      EXPECT_EQ(packet[6], 0x40) << "DF";
      // The IPv4 header checksum verifies (sums to 0xffff).
      uint32_t sum = 0;
      for (int i = 0; i < 20; i += 2) sum += static_cast<uint32_t>(packet[i] << 8 | packet[i + 1]);
      while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
      EXPECT_EQ(sum, 0xffffu);
      EXPECT_EQ((packet[22] << 8 | packet[23]), kRoceV2Port);
    } else {
      EXPECT_EQ(packet[0] >> 4, 6);
      EXPECT_EQ(packet[6], 17);
    }
  }
}

TEST(Icrc, Crc32IsTheStandardOne) {
  // The CRC-32 check value of "123456789" (IEEE 802.3) is 0xcbf43926.
  const uint8_t text[] = {'1', '2', '3', '4', '5', '6', '7', '8', '9'};
  EXPECT_EQ(~crc32(0xffffffffu, text), 0xcbf43926u);
}

uint32_t bitwise_crc32(uint32_t crc, std::span<const uint8_t> bytes) {
  for (uint8_t byte : bytes) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1) ? 0xedb88320u ^ (crc >> 1) : crc >> 1;
  }
  return crc;
}

std::vector<uint8_t> crc_test_data(size_t size) {
  std::vector<uint8_t> data(size);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 37 + 11 + (i >> 8));
  return data;
}

TEST(Icrc, Crc32AgreesWithTheBitwiseDefinitionAtEveryLengthAndStart) {
  // The table-driven steps (eight bytes, then four, then single ones), the
  // library above kLibraryFrom and the 256-bit folding (crc32_fold.h, where
  // the CPU has it) from kFoldFrom: its rounds of 128 bytes, its vectors of
  // 32 after them and the bytes after those, against the polynomial applied
  // bit by bit.
  const std::vector<uint8_t> data = crc_test_data(1300);
  for (size_t start = 0; start < 8; ++start)
    for (size_t length = 0; start + length <= data.size(); ++length) {
      const auto bytes = std::span<const uint8_t>(data).subspan(start, length);
      ASSERT_EQ(crc32(0x12345678u, bytes), bitwise_crc32(0x12345678u, bytes))
          << "start " << start << " length " << length;
    }
}

TEST(Icrc, Crc32CopyCopiesExactlyAndAgreesWithCrc32) {
  const std::vector<uint8_t> data = crc_test_data(9100);
  for (size_t length : {0, 1, 100, 255, 256, 1023, 1024, 1025, 1151, 4096, 4099, 8999}) {
    for (size_t start : {0, 3}) {
      const auto bytes = std::span<const uint8_t>(data).subspan(start, length);
      std::vector<uint8_t> out(length + 64, 0xee);
      const uint32_t crc = crc32_copy(0xffffffffu, out.data() + 32, bytes);
      EXPECT_EQ(crc, bitwise_crc32(0xffffffffu, bytes)) << "length " << length << " start " << start;
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), out.begin() + 32)) << "length " << length;
      EXPECT_TRUE(std::all_of(out.begin(), out.begin() + 32, [](uint8_t b) { return b == 0xee; }));
      EXPECT_TRUE(std::all_of(out.end() - 32, out.end(), [](uint8_t b) { return b == 0xee; })) << "length " << length;
    }
  }
}

TEST(Icrc, FoldedCrc32AgreesAtPacketSizes) {
  if (!crc32_fold_available()) GTEST_SKIP() << "this CPU has no VPCLMULQDQ with AVX2";
  const std::vector<uint8_t> data = crc_test_data(65536 + 64);
  for (size_t start = 0; start < 4; ++start)
    for (size_t length = kFoldMinimum; length <= 700; ++length) {
      const auto bytes = std::span<const uint8_t>(data).subspan(start, length);
      ASSERT_EQ(crc32_fold(0x12345678u, bytes.data(), length, nullptr), bitwise_crc32(0x12345678u, bytes))
          << "start " << start << " length " << length;
    }
  for (size_t length : {4096, 4112, 4128, 65536}) {
    const auto bytes = std::span<const uint8_t>(data).subspan(5, length);
    EXPECT_EQ(crc32_fold(0x0u, bytes.data(), length, nullptr), bitwise_crc32(0x0u, bytes)) << "length " << length;
    EXPECT_EQ(crc32_fold(0xdeadbeefu, bytes.data(), length, nullptr), bitwise_crc32(0xdeadbeefu, bytes));
  }
}

}  // namespace
}  // namespace softverbs
