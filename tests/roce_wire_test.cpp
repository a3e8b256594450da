// The RoCEv2 wire format: headers per opcode, strict parsing, flow source
// ports and PSN arithmetic, fault injection settings and decisions, the
// packets of a coalesced read and of a GSO batch. (The ICRC and CRC-32:
// roce_wire_icrc_test.cpp, in the same executable.)
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>

#include "roce_wire_samples.h"
#include "udp/coalesced_read.h"
#include "udp/fault_injection.h"
#include "udp/gso.h"
#include "udp/qp.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace softverbs {
namespace {

using namespace wire;
using namespace test;

std::vector<uint8_t> valid_opcodes() {
  std::vector<uint8_t> out;
  for (int value = 0; value < 256; ++value)
    if (opcode_info(static_cast<uint8_t>(value)).valid) out.push_back(static_cast<uint8_t>(value));
  return out;
}

TEST(RoceHeaders, TheOpcodeTableHasRcUcAndUdAsIbaTable38Lists) {
  auto opcodes = valid_opcodes();
  // RC: 24 opcodes (6 sends, 6 writes, READ and its 4 responses, ACK, two
  // atomics and their ACK, 2 sends with invalidate, ATOMIC WRITE); UC: 12;
  // UD: 2.
  size_t rc = 0, uc = 0, ud = 0;
  for (uint8_t value : opcodes) {
    if ((value & 0xe0) == 0x00) ++rc;
    if ((value & 0xe0) == 0x20) ++uc;
    if ((value & 0xe0) == 0x60) ++ud;
  }
  EXPECT_EQ(rc, 24u);
  EXPECT_EQ(uc, 12u);
  EXPECT_EQ(ud, 2u);
  EXPECT_STREQ(opcode_info(0x04).name, "SEND_ONLY");
  EXPECT_STREQ(opcode_info(0x11).name, "ACKNOWLEDGE");
  EXPECT_STREQ(opcode_info(0x64).name, "SEND_ONLY");
  EXPECT_FALSE(opcode_info(0x2c).valid) << "no READ on UC";
  EXPECT_FALSE(opcode_info(0x40).valid) << "RD is not supported";
  EXPECT_FALSE(opcode_info(0x15).valid) << "reserved";
  EXPECT_STREQ(opcode_info(0x1d).name, "ATOMIC_WRITE");
  EXPECT_FALSE(opcode_info(0x3d).valid) << "no ATOMIC WRITE on UC";
}

// What each opcode is, as the requester, responder and completer ask the
// table: IBA table 38's names say it too.
TEST(RoceHeaders, XrcHasRcsOperationsAndItsRequestsCarryTheXrceth) {
  size_t xrc = 0;
  for (unsigned operation = 0; operation < 0x20; ++operation) {
    const OpcodeInfo& rc = opcode_info(static_cast<uint8_t>(operation));
    const OpcodeInfo& info = opcode_info(opcode(Service::Xrc, static_cast<uint8_t>(operation)));
    ASSERT_EQ(info.valid, rc.valid) << operation;
    if (!info.valid) continue;
    ++xrc;
    EXPECT_STREQ(info.name, rc.name);
    EXPECT_EQ(info.xrceth, !info.response()) << info.name << ": only requests name an XRC SRQ";
    EXPECT_EQ(header_bytes(info), header_bytes(rc) + (info.xrceth ? 4 : 0));
    EXPECT_FALSE(rc.xrceth);
  }
  EXPECT_EQ(xrc, 24u);  // RC's 24, ATOMIC WRITE included
  EXPECT_EQ(opcode_for(Service::Xrc, OpKind::Send, OpPosition::First, false), 0xa0);
  EXPECT_EQ(opcode_for(Service::Xrc, OpKind::Write, OpPosition::Only, true), 0xab);

  // The XRCETH follows the BTH: 8 reserved bits, then the 24-bit SRQ number,
  // before the RETH.
  const uint8_t payload[4] = {1, 2, 3, 4};
  TransportPacket write;
  write.bth.opcode = opcode(Service::Xrc, op::kWriteOnly);
  write.xrc_srqn = 0xabcdef;
  write.reth = {0x1122334455667788, 0x99aabbcc, 4};
  write.payload = payload;
  const std::vector<uint8_t> bytes = build(write);
  ASSERT_EQ(bytes.size(), kBthBytes + 4 + 16 + 4);
  EXPECT_EQ(bytes[12], 0);
  EXPECT_EQ(bytes[13], 0xab);
  EXPECT_EQ(bytes[15], 0xef);
  EXPECT_EQ(bytes[16], 0x11);  // the RETH's virtual address
  auto parsed = parse(bytes);
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->xrc_srqn, 0xabcdefu);
  EXPECT_EQ(parsed->reth.rkey, 0x99aabbccu);
  ASSERT_EQ(parsed->payload.size(), 4u);

  TransportPacket swap;
  swap.bth.opcode = opcode(Service::Xrc, op::kCompareSwap);
  std::array<uint8_t, kMaxHeaderBytes> headers;
  EXPECT_EQ(build_headers(swap, 0, headers), kMaxHeaderBytes) << "the longest headers of all";
}

TEST(RoceHeaders, TheTableSaysWhatEachOpcodeIsAndFindsItBack) {
  for (uint8_t value : valid_opcodes()) {
    const OpcodeInfo& info = opcode_info(value);
    const std::string name = info.name;
    const auto names = [&](const char* part) { return name.find(part) != std::string::npos; };
    EXPECT_EQ(info.immediate(), names("IMMEDIATE")) << name;
    EXPECT_EQ(info.response(), names("RESPONSE") || names("ACKNOWLEDGE")) << name;
    EXPECT_EQ(info.kind == OpKind::Write, names("RDMA_WRITE")) << name;
    EXPECT_EQ(info.position == OpPosition::First, names("FIRST")) << name;
    EXPECT_EQ(info.position == OpPosition::Middle, names("MIDDLE")) << name;
    EXPECT_EQ(info.position == OpPosition::Last, names("LAST")) << name;
    if ((info.headers & header::kIeth) || info.kind == OpKind::Atomic || info.kind == OpKind::AtomicWrite)
      continue;  // named by the work request
    EXPECT_EQ(opcode_for(static_cast<Service>(value & 0xe0), info.kind, info.position, info.immediate()), value)
        << name;
  }
  EXPECT_EQ(opcode_for(Service::Ud, OpKind::Write, OpPosition::Only, false), 0xff) << "no WRITE on UD";
  EXPECT_EQ(opcode_for(Service::Ud, OpKind::Send, OpPosition::First, false), 0xff) << "UD messages are one packet";
  EXPECT_EQ(opcode_for(Service::Uc, OpKind::ReadRequest, OpPosition::Only, false), 0xff) << "no READ on UC";
  EXPECT_EQ(opcode_for(Service::Rc, OpKind::Send, OpPosition::Middle, true), 0xff) << "only LAST and ONLY carry one";
  EXPECT_EQ(opcode_for(Service::Rc, OpKind::Atomic, OpPosition::Only, false), 0xff) << "CMP_AND_SWP or FETCH_ADD";
  EXPECT_EQ(opcode_for(Service::Rc, OpKind::AtomicWrite, OpPosition::Only, false), 0xff) << "the work request's";
}

TEST(RoceHeaders, EveryOpcodeRoundTrips) {
  for (size_t payload_length : {0, 1, 3, 4, 255, 1024}) {
    auto payload = sample_payload(payload_length);
    for (uint8_t value : valid_opcodes()) {
      TransportPacket original = sample_packet(value, payload);
      auto bytes = build(original);
      ASSERT_FALSE(bytes.empty()) << opcode_info(value).name;
      EXPECT_EQ(bytes.size() % 4, 0u);
      auto parsed = parse(bytes);
      ASSERT_TRUE(parsed) << opcode_info(value).name << " with " << payload_length << " bytes";
      const uint8_t headers = opcode_info(value).headers;
      EXPECT_EQ(parsed->bth.opcode, value);
      EXPECT_EQ(parsed->bth.dest_qp, 0xabcdefu);
      EXPECT_EQ(parsed->bth.psn, 0x123456u);
      EXPECT_TRUE(parsed->bth.ack_request);
      EXPECT_TRUE(parsed->bth.solicited);
      EXPECT_EQ(parsed->bth.pad, (headers & header::kPayload) ? pad_bytes(payload_length) : 0u);
      if (headers & header::kReth) {
        EXPECT_EQ(parsed->reth.virtual_address, original.reth.virtual_address);
        EXPECT_EQ(parsed->reth.rkey, original.reth.rkey);
        EXPECT_EQ(parsed->reth.dma_length, original.reth.dma_length);
      }
      if (headers & header::kAeth) {
        EXPECT_EQ(parsed->aeth.msn, 0x654321u);
      }
      if (headers & header::kAtomicEth) {
        EXPECT_EQ(parsed->atomic.swap_add, original.atomic.swap_add);
        EXPECT_EQ(parsed->atomic.compare, original.atomic.compare);
      }
      if (headers & header::kAtomicAckEth) {
        EXPECT_EQ(parsed->atomic_ack_original, original.atomic_ack_original);
      }
      if (headers & header::kImmDt) {
        EXPECT_EQ(parsed->immediate, original.immediate);
      }
      if (headers & header::kIeth) {
        EXPECT_EQ(parsed->invalidate_rkey, original.invalidate_rkey);
      }
      if (headers & header::kDeth) {
        EXPECT_EQ(parsed->deth.qkey, original.deth.qkey);
        EXPECT_EQ(parsed->deth.source_qp, original.deth.source_qp);
      }
      if (headers & header::kPayload) {
        EXPECT_TRUE(std::equal(parsed->payload.begin(), parsed->payload.end(), payload.begin(), payload.end()));
      } else {
        EXPECT_TRUE(parsed->payload.empty());
      }
    }
  }
}

TEST(RoceHeaders, BthFieldsSitWhereTheSpecPutsThem) {
  TransportPacket p = sample_packet(opcode(Service::Rc, op::kWriteOnlyImm), {});
  auto payload = sample_payload(5);
  p.payload = payload;
  auto bytes = build(p);
  ASSERT_GE(bytes.size(), kBthBytes + 16 + 4);
  EXPECT_EQ(bytes[0], 0x0b);
  EXPECT_EQ(bytes[1], 0x80 | (3 << 4)) << "solicited, pad 3, version 0";
  EXPECT_EQ(bytes[2], 0xff);
  EXPECT_EQ(bytes[3], 0xff) << "P_Key";
  EXPECT_EQ(bytes[5], 0xab);
  EXPECT_EQ(bytes[7], 0xef) << "destination QP";
  EXPECT_EQ(bytes[8], 0x80) << "AckReq";
  EXPECT_EQ(bytes[9], 0x12);
  EXPECT_EQ(bytes[11], 0x56) << "PSN";
  EXPECT_EQ(bytes[12], 0x11) << "RETH virtual address, big-endian";
  EXPECT_EQ(bytes[20], 0x99) << "RETH R_Key";
  EXPECT_EQ(bytes[28], 0xab) << "ImmDt after RETH";
  EXPECT_EQ(bytes.size(), kBthBytes + 16 + 4 + 5 + 3u);
}

TEST(RoceHeaders, InvalidOpcodesAreRejected) {
  std::set<uint8_t> valid;
  for (uint8_t value : valid_opcodes()) valid.insert(value);
  for (int value = 0; value < 256; ++value) {
    if (valid.count(static_cast<uint8_t>(value))) continue;
    std::vector<uint8_t> bytes(64, 0);
    bytes[0] = static_cast<uint8_t>(value);
    EXPECT_FALSE(parse(bytes)) << "opcode " << value;
    EXPECT_TRUE(build(sample_packet(static_cast<uint8_t>(value), {})).empty());
  }
}

TEST(RoceHeaders, MalformedPacketsAreRejected) {
  auto payload = sample_payload(8);
  for (uint8_t value : valid_opcodes()) {
    auto bytes = build(sample_packet(value, payload));
    const size_t headers = bytes.size() - ((opcode_info(value).headers & header::kPayload) ? payload.size() : 0);
    for (size_t cut = 0; cut < headers; ++cut)
      EXPECT_FALSE(parse(std::span(bytes).first(cut))) << opcode_info(value).name << " cut to " << cut;
    // Not a whole number of 4-byte words.
    auto odd = bytes;
    odd.push_back(0);
    EXPECT_FALSE(parse(odd)) << opcode_info(value).name;
    // Transport version other than 0.
    auto version = bytes;
    version[1] |= 0x01;
    EXPECT_FALSE(parse(version)) << opcode_info(value).name;
  }
  // A payload on an opcode that carries none.
  auto ack = build(sample_packet(opcode(Service::Rc, op::kAcknowledge), {}));
  ack.insert(ack.end(), 4, 0);
  EXPECT_FALSE(parse(ack));
  // A pad count larger than the payload.
  auto send = build(sample_packet(opcode(Service::Rc, op::kSendOnly), {}));
  send[1] |= 0x30;
  EXPECT_FALSE(parse(send));
}

TEST(RoceHeaders, ParseSurvivesRandomBytes) {
  std::mt19937 random(12345);
  size_t accepted = 0;
  for (int round = 0; round < 200000; ++round) {
    std::vector<uint8_t> bytes(random() % 96);
    for (auto& b : bytes) b = static_cast<uint8_t>(random());
    auto parsed = parse(bytes);
    if (!parsed) continue;
    ++accepted;
    // Whatever parses rebuilds to a packet of the same size that parses to
    // the same thing (reserved bits and pad bytes come back as zeros).
    auto rebuilt = build(*parsed);
    ASSERT_EQ(rebuilt.size(), bytes.size());
    auto reparsed = parse(rebuilt);
    ASSERT_TRUE(reparsed);
    EXPECT_EQ(build(*reparsed), rebuilt);
  }
  EXPECT_GT(accepted, 0u) << "some random packets are valid";
}

TEST(RocePacket, FlowSourcePortsUseTheTopQuarterAndSpread) {
  std::set<uint16_t> ports;
  for (uint32_t a = 0x11; a < 0x51; ++a)
    for (uint32_t b = 0x11; b < 0x19; ++b) {
      uint16_t port = flow_source_port(a, b);
      EXPECT_GE(port, 0xc000);
      ports.insert(port);
      EXPECT_EQ(port, flow_source_port(a, b)) << "stable";
    }
  EXPECT_GT(ports.size(), 400u);
}

TEST(Psn, ArithmeticWrapsAt24Bits) {
  EXPECT_EQ(udp::psn_add(0xffffff, 1), 0u);
  EXPECT_EQ(udp::psn_add(0xfffffe, 5), 3u);
  EXPECT_EQ(udp::psn_distance(2, 0xfffffe), 4);
  EXPECT_EQ(udp::psn_distance(0xfffffe, 2), -4);
  EXPECT_EQ(udp::psn_distance(100, 100), 0);
}

TEST(FaultSettings, ParsesRatesPercentagesAndKeys) {
  std::string error;
  auto s =
      FaultSettings::parse("loss=0.1, duplicate=5%,reorder=1e-2,delay=0.5,delay_us=250,corrupt=0.001,seed=42", &error);
  ASSERT_TRUE(s) << error;
  EXPECT_EQ(s->loss_ppm, 100000u);
  EXPECT_EQ(s->duplicate_ppm, 50000u);
  EXPECT_EQ(s->reorder_ppm, 10000u);
  EXPECT_EQ(s->delay_ppm, 500000u);
  EXPECT_EQ(s->delay_us, 250u);
  EXPECT_EQ(s->corrupt_ppm, 1000u);
  EXPECT_EQ(s->seed, 42u);
  auto again = FaultSettings::parse(s->to_string(), &error);
  ASSERT_TRUE(again) << error;
  EXPECT_EQ(*again, *s);
  auto none = FaultSettings::parse("none", &error);
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->any());
}

TEST(FaultSettings, RejectsBadInputWithAMessage) {
  for (const char* bad :
       {"loss", "loss=2", "loss=-0.1", "loss=abc", "drop=0.1", "delay_us=x", "seed=-1", "loss=10%%"}) {
    std::string error;
    EXPECT_FALSE(FaultSettings::parse(bad, &error)) << bad;
    EXPECT_FALSE(error.empty()) << bad;
  }
}

TEST(FaultGenerator, SameSeedSameDecisionsAndRatesAsAsked) {
  std::string error;
  auto settings = *FaultSettings::parse("loss=0.1,duplicate=0.05,reorder=0.05,corrupt=0.02,seed=7", &error);
  FaultGenerator a(settings.seed, 0x12), b(settings.seed, 0x12), other_qp(settings.seed, 0x13);
  std::map<FaultAction, int> counts;
  int corrupted = 0, differ = 0;
  constexpr int kPackets = 200000;
  for (int i = 0; i < kPackets; ++i) {
    FaultDecision x = a.decide(settings), y = b.decide(settings), z = other_qp.decide(settings);
    ASSERT_EQ(x.action, y.action);
    ASSERT_EQ(x.corrupt, y.corrupt);
    differ += x.action != z.action;
    ++counts[x.action];
    corrupted += x.corrupt;
  }
  EXPECT_GT(differ, 0) << "another QP draws its own sequence";
  EXPECT_NEAR(counts[FaultAction::Drop] / double(kPackets), 0.10, 0.01);
  // Duplication and reordering apply to packets that were not lost.
  EXPECT_NEAR(counts[FaultAction::Duplicate] / double(kPackets), 0.9 * 0.05, 0.005);
  EXPECT_NEAR(corrupted / double(kPackets), 0.02, 0.003);
  FaultSettings off;
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(a.decide(off).action, FaultAction::Deliver);
}

// The packets of a read from a connected flow's socket, as UDP GRO hands
// them over (all of one length but the last), found without the kernel's
// segment size.
constexpr uint32_t kFlowQpn = 0xabcdef;  // sample_packet's destination QP

std::vector<uint8_t> sealed_packet(const FlowAddress& flow, uint8_t operation, size_t payload_length,
                                   uint32_t psn = 0x123456, uint32_t destination_qpn = kFlowQpn) {
  auto payload = sample_payload(payload_length);
  TransportPacket packet = sample_packet(opcode(Service::Rc, operation), payload);
  packet.reth.dma_length = static_cast<uint32_t>(payload_length);
  packet.bth.psn = psn;
  packet.bth.dest_qp = destination_qpn;
  auto bytes = build(packet);
  seal(flow, bytes);
  return bytes;
}

struct Coalesced {
  std::vector<uint8_t> read;
  std::vector<size_t> lengths;  // of each packet in it
};

// Packets with consecutive PSNs, wrapping at 2^24 (the ACKs' too, which
// the receive path does not mind).
Coalesced coalesce(const FlowAddress& flow, std::initializer_list<std::pair<uint8_t, size_t>> packets) {
  Coalesced out;
  uint32_t psn = 0xfffffe;
  for (auto [operation, payload_length] : packets) {
    auto bytes = sealed_packet(flow, operation, payload_length, psn++ & 0xffffff);
    out.lengths.push_back(bytes.size());
    out.read.insert(out.read.end(), bytes.begin(), bytes.end());
  }
  return out;
}

TEST(CoalescedRead, FindsThePacketsOfTheReadsSoftverbsAndGroMake) {
  struct Case {
    const char* name;
    std::initializer_list<std::pair<uint8_t, size_t>> packets;
    uint32_t path_mtu;
    bool searched;
  };
  const Case cases[] = {
      {"an ACK", {{op::kAcknowledge, 0}}, 4096, false},
      {"a WRITE ONLY", {{op::kWriteOnly, 2}}, 4096, false},
      {"a SEND ONLY", {{op::kSendOnly, 1000}}, 4096, false},
      {"a WRITE and the held ACK (ib_write_lat)", {{op::kWriteOnly, 2}, {op::kAcknowledge, 0}}, 4096, false},
      {"a SEND and the held ACK, of one length", {{op::kSendOnly, 2}, {op::kAcknowledge, 0}}, 4096, false},
      {"a longer SEND and the held ACK", {{op::kSendOnly, 1024}, {op::kAcknowledge, 0}}, 4096, false},
      {"a SEND LAST and a READ request", {{op::kSendLast, 300}, {op::kReadRequest, 0}}, 1024, false},
      // A stream of SENDs takes the search for equal packets.
      {"64 short SENDs of one PSN", {}, 4096, true},  // filled below
      {"a stream of short SENDs",
       {{op::kSendOnly, 8},
        {op::kSendOnly, 8},
        {op::kSendOnly, 8},
        {op::kSendOnly, 8},
        {op::kSendOnly, 8},
        {op::kSendOnly, 8}},
       4096,
       true},
      {"WRITE MIDDLEs and the LAST",
       {{op::kWriteMiddle, 4096}, {op::kWriteMiddle, 4096}, {op::kWriteMiddle, 4096}, {op::kWriteLast, 4096}},
       4096,
       false},
      {"a WRITE FIRST and a shorter MIDDLE", {{op::kWriteFirst, 4096}, {op::kWriteMiddle, 4096}}, 4096, false},
      {"READ responses and a shorter LAST",
       {{op::kReadResponseMiddle, 1024}, {op::kReadResponseMiddle, 1024}, {op::kReadResponseLast, 500}},
       1024,
       false},
      {"SEND ONLYs and a shorter one (only a search tells)",
       {{op::kSendOnly, 100}, {op::kSendOnly, 100}, {op::kSendOnly, 100}, {op::kSendOnly, 40}},
       4096,
       true},
  };
  for (const FlowAddress& flow : {ipv4_flow(), ipv6_flow()}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      Coalesced read = coalesce(flow, c.packets);
      if (c.packets.size() == 0) {
        for (int i = 0; i < 64; ++i) {
          auto bytes = sealed_packet(flow, op::kSendOnly, 8);
          read.lengths.push_back(bytes.size());
          read.read.insert(read.read.end(), bytes.begin(), bytes.end());
        }
      }
      IcrcHeaderCache cache;
      const FirstPacket first = find_first_packet(flow, read.read, {kFlowQpn, c.path_mtu}, cache);
      EXPECT_EQ(first.bytes, read.lengths.front());
      EXPECT_EQ(first.searched, c.searched);
      // Told checked only where it was; a read of several always is.
      if (first.icrc_checked || read.lengths.size() > 1) {
        EXPECT_TRUE(first.icrc_checked && check_icrc(flow, std::span(read.read).first(first.bytes)));
      }
      // Split as the receive path splits it, every packet is whole.
      size_t count = 0;
      for (size_t at = 0; at < read.read.size(); at += first.bytes, ++count) {
        const size_t length = std::min(first.bytes, read.read.size() - at);
        ASSERT_LT(count, read.lengths.size());
        EXPECT_EQ(length, read.lengths[count]);
        EXPECT_TRUE(check_icrc(flow, std::span(read.read).subspan(at, length))) << "packet " << count;
      }
      EXPECT_EQ(count, read.lengths.size());
    }
  }
}

TEST(CoalescedRead, PacketsForTwoQpsOfOneFlowAreSplitToo) {
  // Two QP pairs whose UDP source ports collide share one flow, so GRO may
  // hand over packets for both in one read; each is found, not dropped.
  for (const FlowAddress& flow : {ipv4_flow(), ipv6_flow()}) {
    for (uint8_t operation : {op::kSendOnly, op::kWriteOnly}) {
      SCOPED_TRACE(static_cast<int>(operation));
      std::vector<uint8_t> read;
      std::vector<size_t> lengths;
      for (uint32_t qpn : {kFlowQpn, 0x000123u, kFlowQpn, 0x000123u}) {
        auto bytes = sealed_packet(flow, operation, 500, 0x123456, qpn);
        lengths.push_back(bytes.size());
        read.insert(read.end(), bytes.begin(), bytes.end());
      }
      IcrcHeaderCache cache;
      const FirstPacket first = find_first_packet(flow, read, {kFlowQpn, 4096}, cache);
      EXPECT_EQ(first.bytes, lengths.front());
      EXPECT_TRUE(first.icrc_checked);
      for (size_t at = 0; at < read.size(); at += first.bytes)
        EXPECT_TRUE(check_icrc(flow, std::span(read).subspan(at, std::min(first.bytes, read.size() - at))));
    }
  }
}

TEST(CoalescedRead, APayloadFullOfTheFlowsPacketsIsOnePacket) {
  // A SEND whose payload is the flow's own ACKs, back to back: a BTH of the
  // flow sits at every equal division of the read, but the ICRC of the
  // whole says it is one packet.
  const FlowAddress flow = ipv4_flow();
  auto ack = sealed_packet(flow, op::kAcknowledge, 0);
  std::vector<uint8_t> payload;
  for (int i = 0; i < 50; ++i) payload.insert(payload.end(), ack.begin(), ack.end());
  TransportPacket packet = sample_packet(opcode(Service::Rc, op::kSendOnly), payload);
  auto read = build(packet);
  seal(flow, read);
  IcrcHeaderCache cache;
  const FirstPacket first = find_first_packet(flow, read, {kFlowQpn, 4096}, cache);
  EXPECT_EQ(first.bytes, read.size());
  EXPECT_TRUE(first.icrc_checked);
  EXPECT_FALSE(first.searched);
}

TEST(CoalescedRead, ADamagedPacketIsDroppedAndTheOthersStandWhereItsHeadersGiveItsLength) {
  const FlowAddress flow = ipv4_flow();
  Coalesced read = coalesce(flow, {{op::kWriteOnly, 2}, {op::kAcknowledge, 0}});
  read.read[30] ^= 0x10;  // the WRITE's payload
  IcrcHeaderCache cache;
  FirstPacket first = find_first_packet(flow, read.read, {kFlowQpn, 4096}, cache);
  EXPECT_EQ(first.bytes, read.lengths.front());
  EXPECT_FALSE(first.icrc_checked);
  EXPECT_FALSE(check_icrc(flow, std::span(read.read).first(first.bytes)));
  EXPECT_TRUE(check_icrc(flow, std::span(read.read).subspan(first.bytes)));

  // A damaged SEND's length only its ICRC could tell: the read goes whole,
  // for the receive path to drop; never split where no packet ends.
  read = coalesce(flow, {{op::kSendOnly, 200}, {op::kSendOnly, 64}});
  read.read[40] ^= 0x01;
  first = find_first_packet(flow, read.read, {kFlowQpn, 4096}, cache);
  EXPECT_EQ(first.bytes, read.read.size());
  EXPECT_FALSE(first.icrc_checked);
  EXPECT_TRUE(first.searched);
}

TEST(CoalescedRead, AnyBytesGiveALengthWithinTheRead) {
  const FlowAddress flow = ipv4_flow();
  std::mt19937 random(7);
  IcrcHeaderCache cache;
  auto ack = sealed_packet(flow, op::kAcknowledge, 0);
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> read(random() % 300);
    for (auto& byte : read) byte = static_cast<uint8_t>(random());
    // Often the flow's BTH at the start and here and there, to go deep.
    if (read.size() >= ack.size() && round % 2 == 0) std::copy_n(ack.begin(), 12, read.begin());
    for (size_t at = 4 * (random() % 16); at + 12 <= read.size() && round % 3 == 0; at += 4 * (1 + random() % 16))
      std::copy_n(ack.begin(), 12, read.begin() + static_cast<std::ptrdiff_t>(at));
    const FirstPacket first =
        find_first_packet(flow, read, {kFlowQpn, static_cast<uint32_t>(256 << (round % 5))}, cache);
    ASSERT_LE(first.bytes, read.size());
    if (!read.empty()) {
      ASSERT_GT(first.bytes, 0u);
    }
  }
}

// Where GSO fails, a batch goes out one datagram at a time: each must be
// exactly its segment's bytes of the batch, whether its edges fall within
// a piece (a payload sent from the application's memory) or between two.
TEST(UdpGso, EachDatagramIsItsSegmentOfTheBatchsPieces) {
  // Pieces of 12, 300, 4, 12, 300, 4 and 368 bytes, each in a buffer of
  // its own (with bytes around it that belong to no piece); `bytes` is what
  // they hold, back to back.
  const std::vector<size_t> lengths = {12, 300, 4, 12, 300, 4, 368};
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<iovec> parts;
  std::vector<uint8_t> bytes;
  for (size_t length : lengths) {
    std::vector<uint8_t>& buffer = buffers.emplace_back(length + 16, uint8_t{0xee});
    for (size_t i = 0; i < length; ++i) buffer[8 + i] = static_cast<uint8_t>(bytes.size() + i * 13 + 5);
    parts.push_back({buffer.data() + 8, length});
    bytes.insert(bytes.end(), buffer.begin() + 8, buffer.begin() + 8 + static_cast<std::ptrdiff_t>(length));
  }
  ASSERT_EQ(bytes.size(), 1000u);
  for (size_t segment : {316u, 100u, 1u, 999u, 1000u, 4096u}) {
    SCOPED_TRACE("segment " + std::to_string(segment));
    std::vector<std::vector<uint8_t>> datagrams;
    for_each_datagram(parts, bytes.size(), segment, [&](std::span<const iovec> pieces, size_t length) {
      std::vector<uint8_t> datagram;
      for (const iovec& piece : pieces) {
        EXPECT_GT(piece.iov_len, 0u) << "no empty pieces";
        const auto* from = static_cast<const uint8_t*>(piece.iov_base);
        datagram.insert(datagram.end(), from, from + piece.iov_len);
      }
      EXPECT_EQ(datagram.size(), length);
      datagrams.push_back(std::move(datagram));
    });
    ASSERT_EQ(datagrams.size(), (bytes.size() + segment - 1) / segment);
    for (size_t i = 0; i < datagrams.size(); ++i) {
      const size_t start = i * segment;
      const size_t length = std::min(segment, bytes.size() - start);
      EXPECT_EQ(datagrams[i], std::vector<uint8_t>(bytes.begin() + static_cast<std::ptrdiff_t>(start),
                                                   bytes.begin() + static_cast<std::ptrdiff_t>(start + length)))
          << "datagram " << i;
    }
  }
}

}  // namespace
}  // namespace softverbs
