// Communication Management MADs: every field survives building and parsing,
// malformed MADs are refused, and tshark's InfiniBand dissector reads the
// packets softverbs builds field for field as the IB CM.
#include "wire/cm_mad.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "device/cm_routing.h"
#include "device/device_memory.h"
#include "process_runner.h"
#include "wire/pcap_file.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace softverbs {
namespace {

using namespace wire::cm;

Gid gid_of(uint8_t seed) {
  Gid gid{};
  for (size_t i = 0; i < gid.size(); ++i) gid[i] = static_cast<uint8_t>(seed + 17 * i);
  return gid;
}

template <size_t N>
std::array<uint8_t, N> pattern(uint8_t seed) {
  std::array<uint8_t, N> bytes{};
  for (size_t i = 0; i < N; ++i) bytes[i] = static_cast<uint8_t>(seed + 3 * i);
  return bytes;
}

Path sample_path(uint8_t seed) {
  Path path;
  path.local_lid = static_cast<uint16_t>(0x1234 + seed);
  path.remote_lid = static_cast<uint16_t>(0x4321 + seed);
  path.local_gid = gid_of(seed);
  path.remote_gid = gid_of(static_cast<uint8_t>(seed + 100));
  path.flow_label = 0xabcde;
  path.packet_rate = 0x2a;
  path.traffic_class = 0x60;
  path.hop_limit = 0x40;
  path.sl = 0x9;
  path.subnet_local = true;
  path.local_ack_timeout = 0x13;
  return path;
}

Mad sample_req() {
  Mad mad;
  mad.attribute = Attribute::Req;
  mad.transaction_id = 0x0102030405060708;
  Req& m = mad.req;
  m.local_comm_id = 0xa1b2c3d4;
  m.vendor_id = 0x15b3;
  m.service_id = service_id(kPortSpaceTcp, 7471);
  m.local_ca_guid = 0x0011223344556677;
  m.local_qkey = 0x11111111;
  m.local_qpn = 0x123456;
  m.responder_resources = 16;
  m.local_eecn = 0x000003;
  m.initiator_depth = 8;
  m.remote_eecn = 0;
  m.remote_cm_response_timeout = 20;
  m.transport_service_type = 1;
  m.end_to_end_flow_control = true;
  m.starting_psn = 0xfedcba;
  m.local_cm_response_timeout = 19;
  m.retry_count = 6;
  m.pkey = 0xffff;
  m.path_mtu = 5;
  m.rdc_exists = false;
  m.rnr_retry_count = 7;
  m.max_cm_retries = 15;
  m.srq = true;
  m.extended_transport_type = 0;
  m.primary = sample_path(1);
  m.primary.local_gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2};
  m.primary.remote_gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
  m.alternate = sample_path(2);
  m.private_data = pattern<kReqPrivate>(9);
  IpHeader ip;
  ip.ip_version = 4;
  ip.source_port = 40000;
  ip.source = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2};
  ip.destination = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
  put_ip_header(ip, m.private_data);
  return mad;
}

Mad sample(Attribute attribute) {
  Mad mad = attribute == Attribute::Req ? sample_req() : Mad{};
  mad.attribute = attribute;
  mad.transaction_id = 0x1122334455667788;
  switch (attribute) {
    case Attribute::Req:
      break;
    case Attribute::Mra:
      mad.mra = {0x01020304, 0x05060708, MessageRejected::Rep, 17, pattern<kMraPrivate>(3)};
      break;
    case Attribute::Rej:
      mad.rej = {0x0a0b0c0d,
                 0x01010101,
                 MessageRejected::Other,
                 72,
                 reject::kConsumer,
                 pattern<kRejAriBytes>(1),
                 pattern<kRejPrivate>(5)};
      break;
    case Attribute::Rep: {
      Rep& m = mad.rep;
      m.local_comm_id = 0x55aa55aa;
      m.remote_comm_id = 0xa1b2c3d4;
      m.local_qkey = 0x22222222;
      m.local_qpn = 0x654321;
      m.local_eecn = 0x000005;
      m.starting_psn = 0x0abcde;
      m.responder_resources = 4;
      m.initiator_depth = 2;
      m.target_ack_delay = 21;
      m.failover_accepted = 3;
      m.end_to_end_flow_control = true;
      m.rnr_retry_count = 5;
      m.srq = true;
      m.local_ca_guid = 0x8899aabbccddeeff;
      m.private_data = pattern<kRepPrivate>(7);
      break;
    }
    case Attribute::Rtu:
      mad.rtu = {0x11112222, 0x33334444, pattern<kRtuPrivate>(11)};
      break;
    case Attribute::Dreq:
      mad.dreq = {0x11112222, 0x33334444, 0x00beef, pattern<kDreqPrivate>(13)};
      break;
    case Attribute::Drep:
      mad.drep = {0x33334444, 0x11112222, pattern<kDrepPrivate>(15)};
      break;
    case Attribute::SidrReq:
      mad.sidr_req = {0xdeadbeef, 0x7fff, service_id(kPortSpaceUdp, 7174), pattern<kSidrReqPrivate>(17)};
      break;
    case Attribute::SidrRep:
      mad.sidr_rep = {
          0xdeadbeef,      sidr_status::kValid,         0, 0x000123, service_id(kPortSpaceUdp, 7174), 0x01234567,
          pattern<72>(19), pattern<kSidrRepPrivate>(23)};
      break;
    case Attribute::Lap:
    case Attribute::Apr:
      break;
  }
  return mad;
}

constexpr Attribute kSent[] = {Attribute::Req,  Attribute::Mra,  Attribute::Rej,     Attribute::Rep,    Attribute::Rtu,
                               Attribute::Dreq, Attribute::Drep, Attribute::SidrReq, Attribute::SidrRep};

// Parsing what was built gives it back: built again, the same bytes.
TEST(CmMad, EveryMessageSurvivesBuildingAndParsing) {
  for (Attribute attribute : kSent) {
    const auto bytes = build_cm_mad(sample(attribute));
    const auto parsed = parse_cm_mad(bytes);
    ASSERT_TRUE(parsed) << static_cast<int>(attribute);
    EXPECT_EQ(parsed->attribute, attribute);
    EXPECT_EQ(parsed->transaction_id, 0x1122334455667788u) << static_cast<int>(attribute);
    EXPECT_EQ(build_cm_mad(*parsed), bytes) << static_cast<int>(attribute);
  }
  const auto req = parse_cm_mad(build_cm_mad(sample_req()));
  ASSERT_TRUE(req);
  EXPECT_EQ(req->req.local_qpn, 0x123456u);
  EXPECT_EQ(req->req.starting_psn, 0xfedcbau);
  EXPECT_EQ(req->req.primary.flow_label, 0xabcdeu);
  EXPECT_EQ(req->req.alternate.remote_gid, gid_of(102));
  EXPECT_EQ(req->req.max_cm_retries, 15);
  EXPECT_TRUE(req->req.srq);
  const auto ip = get_ip_header(req->req.private_data);
  ASSERT_TRUE(ip);
  EXPECT_EQ(ip->ip_version, 4);
  EXPECT_EQ(ip->source_port, 40000);
  EXPECT_EQ(ip->destination[15], 1);
  EXPECT_EQ(ip->destination[10], 0xff) << "IPv4 comes back as a GID holds it";
}

// Routing needs three fields; they come straight from the bytes.
TEST(CmMad, RouteNamesTheServiceOrTheReceiversId) {
  auto route = cm_route(build_cm_mad(sample_req()));
  ASSERT_TRUE(route);
  EXPECT_EQ(route->service_id, service_id(kPortSpaceTcp, 7471));
  route = cm_route(build_cm_mad(sample(Attribute::Rep)));
  ASSERT_TRUE(route);
  EXPECT_EQ(route->receiver_id, 0xa1b2c3d4u) << "a REP goes to the REQ's sender";
  route = cm_route(build_cm_mad(sample(Attribute::SidrRep)));
  ASSERT_TRUE(route);
  EXPECT_EQ(route->receiver_id, 0xdeadbeefu);
}

TEST(CmMad, MalformedMadsAreRefused) {
  auto bytes = build_cm_mad(sample(Attribute::Rtu));
  EXPECT_FALSE(parse_cm_mad(std::span(bytes).first(255))) << "short";
  for (size_t at : {0, 1, 2, 3}) {
    auto changed = bytes;
    changed[at] ^= 0x40;
    EXPECT_FALSE(parse_cm_mad(changed)) << "header byte " << at;
    EXPECT_FALSE(cm_route(changed)) << "header byte " << at;
  }
  for (uint16_t attribute : {0x0000, 0x000f, 0x0019, 0x001a, 0x001b, 0xffff}) {
    auto changed = bytes;
    changed[16] = static_cast<uint8_t>(attribute >> 8);
    changed[17] = static_cast<uint8_t>(attribute);
    EXPECT_FALSE(parse_cm_mad(changed)) << "attribute " << attribute;
  }
  auto rej = build_cm_mad(sample(Attribute::Rej));
  rej[kMadHeaderBytes + 8] = 0xc0;  // message code 3
  EXPECT_FALSE(parse_cm_mad(rej));
  rej = build_cm_mad(sample(Attribute::Rej));
  rej[kMadHeaderBytes + 9] = 73 << 1;  // more ARI than there is room for
  EXPECT_FALSE(parse_cm_mad(rej));
}

TEST(CmMad, IpHeaderOfBothVersions) {
  std::array<uint8_t, kReqPrivate> area{};
  IpHeader six;
  six.ip_version = 6;
  six.source_port = 0x1234;
  six.source = gid_of(0xfe);
  six.destination = gid_of(0x20);
  put_ip_header(six, area);
  EXPECT_EQ(area[0], 0);
  EXPECT_EQ(area[1], 0x60);
  const auto back = get_ip_header(area);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->source, six.source);
  EXPECT_EQ(back->destination, six.destination);
  area[1] = 0x50;
  EXPECT_FALSE(get_ip_header(area)) << "IP version 5";
  area[1] = 0x40;
  area[0] = 1;
  EXPECT_FALSE(get_ip_header(area)) << "header version 1";
}

// The MAD as the UD SEND to QP1 it travels in, sealed for `flow`.
std::vector<uint8_t> gsi_packet(const wire::FlowAddress& flow, const Mad& mad) {
  const auto bytes = build_cm_mad(mad);
  wire::TransportPacket packet;
  packet.bth.opcode = static_cast<uint8_t>(wire::Service::Ud) | wire::op::kSendOnly;
  packet.bth.dest_qp = 1;
  packet.bth.psn = 7;
  packet.deth.qkey = kGsiQkey;
  packet.deth.source_qp = 1;
  packet.payload = bytes;
  auto transport = wire::build(packet);
  wire::seal(flow, transport);
  return wire::ip_packet(flow, transport);
}

// tshark's reading of the given fields of the one packet in `capture`:
// numbers (shown in hex or decimal, as the dissector declares each field)
// as numbers, anything else as text.
struct Decoded {
  std::map<std::string, std::string> text;
  uint64_t number(const std::string& field) const {
    const std::string& value = text.at(field);
    EXPECT_FALSE(value.empty()) << field << " not decoded";
    return std::strtoull(value.c_str(), nullptr, 0);
  }
};

Decoded decode(const std::string& capture, const std::vector<std::string>& fields) {
  std::vector<std::string> argv = {"tshark", "-r", capture, "-T", "fields", "-E", "separator=|", "-E", "occurrence=f"};
  for (const auto& field : fields) {
    argv.push_back("-e");
    argv.push_back("infiniband." + field);
  }
  const auto result = test::run_process(argv);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  Decoded decoded;
  std::stringstream line(result.out.substr(0, result.out.find('\n')));
  for (const auto& field : fields) std::getline(line, decoded.text[field], '|');
  return decoded;
}

class CmMadTshark : public ::testing::Test {
 protected:
  std::string write(const Mad& mad) {
    const std::string path = dir_.path() + "/cm.pcap";
    EXPECT_TRUE(create_pcap_file(path, nullptr));
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND);
    EXPECT_GE(fd, 0);
    wire::FlowAddress flow;
    flow.source = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2};
    flow.destination = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
    flow.source_port = 0xc123;
    flow.destination_port = wire::kRoceV2Port;
    EXPECT_TRUE(append_pcap_record(fd, gsi_packet(flow, mad)));
    ::close(fd);
    return path;
  }
  test::TemporaryDirectory dir_;
};

// The fields of a REQ that tshark's dissector reads, as the test below
// asks for them.
const std::vector<std::string> kReqFields = {"mad.mgmtclass",
                                             "mad.classversion",
                                             "mad.method",
                                             "mad.attributeid",
                                             "mad.transactionid",
                                             "cm.req",
                                             "cm.req.serviceid.dport",
                                             "cm.req.localcaguid",
                                             "cm.req.localqkey",
                                             "cm.req.localqpn",
                                             "cm.req.responderres",
                                             "cm.req.localeecn",
                                             "cm.req.initdepth",
                                             "cm.req.remoteeecn",
                                             "cm.req.remoteresptout",
                                             "cm.req.transpsvctype",
                                             "cm.req.e2eflowctrl",
                                             "cm.req.startpsn",
                                             "cm.req.localresptout",
                                             "cm.req.retrcount",
                                             "cm.req.pkey",
                                             "cm.req.pppmtu",
                                             "cm.req.rdcexist",
                                             "cm.req.rnrretrcount",
                                             "cm.req.maxcmretr",
                                             "cm.req.srq",
                                             "cm.req.ext_transport",
                                             "cm.req.prim_locallid",
                                             "cm.req.prim_remotelid",
                                             "cm.req.prim_localgid_ipv4",
                                             "cm.req.prim_remotegid_ipv4",
                                             "cm.req.alt_localgid",
                                             "cm.req.alt_remotegid",
                                             "cm.req.prim_tfcclass",
                                             "cm.req.prim_hoplim",
                                             "cm.req.prim_sl",
                                             "cm.req.prim_subnetlocal",
                                             "cm.req.prim_localacktout",
                                             "cm.req.alt_locallid",
                                             "cm.req.alt_remotelid",
                                             "cm.req.alt_tfcclass",
                                             "cm.req.alt_hoplim",
                                             "cm.req.alt_sl",
                                             "cm.req.alt_subnetlocal",
                                             "cm.req.alt_localacktout",
                                             "cm.req.ip_cm.majv",
                                             "cm.req.ip_cm.ipv",
                                             "cm.req.ip_cm.sport",
                                             "cm.req.ip_cm.sip4",
                                             "cm.req.ip_cm.dip4"};

// Every REQ field the dissector knows but the primary and alternate flow
// label and packet rate: Wireshark 4.0 reads those from the wrong bytes (it
// shows the low six bits of the flow label's first byte as the packet rate).
TEST_F(CmMadTshark, ReqAsTheDissectorReadsIt) {
  const Mad mad = sample_req();
  const Req& m = mad.req;
  const auto v = decode(write(mad), kReqFields);
  EXPECT_EQ(v.number("mad.mgmtclass"), kCmClass);
  EXPECT_EQ(v.number("mad.classversion"), kCmClassVersion);
  EXPECT_EQ(v.number("mad.method"), kMethodSend);
  EXPECT_EQ(v.number("mad.attributeid"), 0x10u);
  EXPECT_EQ(v.number("mad.transactionid"), mad.transaction_id);
  EXPECT_EQ(v.number("cm.req"), m.local_comm_id);
  EXPECT_EQ(v.number("cm.req.serviceid.dport"), 7471u);
  EXPECT_EQ(v.number("cm.req.localcaguid"), m.local_ca_guid);
  EXPECT_EQ(v.number("cm.req.localqkey"), m.local_qkey);
  EXPECT_EQ(v.number("cm.req.localqpn"), m.local_qpn);
  EXPECT_EQ(v.number("cm.req.responderres"), m.responder_resources);
  EXPECT_EQ(v.number("cm.req.localeecn"), m.local_eecn);
  EXPECT_EQ(v.number("cm.req.initdepth"), m.initiator_depth);
  EXPECT_EQ(v.number("cm.req.remoteeecn"), m.remote_eecn);
  EXPECT_EQ(v.number("cm.req.remoteresptout"), m.remote_cm_response_timeout);
  EXPECT_EQ(v.number("cm.req.transpsvctype"), m.transport_service_type);
  EXPECT_EQ(v.number("cm.req.e2eflowctrl"), 1u);
  EXPECT_EQ(v.number("cm.req.startpsn"), m.starting_psn);
  EXPECT_EQ(v.number("cm.req.localresptout"), m.local_cm_response_timeout);
  EXPECT_EQ(v.number("cm.req.retrcount"), m.retry_count);
  EXPECT_EQ(v.number("cm.req.pkey"), m.pkey);
  EXPECT_EQ(v.number("cm.req.pppmtu"), m.path_mtu);
  EXPECT_EQ(v.number("cm.req.rdcexist"), 0u);
  EXPECT_EQ(v.number("cm.req.rnrretrcount"), m.rnr_retry_count);
  EXPECT_EQ(v.number("cm.req.maxcmretr"), m.max_cm_retries);
  EXPECT_EQ(v.number("cm.req.srq"), 1u);
  EXPECT_EQ(v.number("cm.req.ext_transport"), m.extended_transport_type);
  for (const auto& [prefix, path] : {std::pair{"cm.req.prim_", &m.primary}, std::pair{"cm.req.alt_", &m.alternate}}) {
    const std::string p = prefix;
    EXPECT_EQ(v.number(p + "locallid"), path->local_lid) << p;
    EXPECT_EQ(v.number(p + "remotelid"), path->remote_lid) << p;
    EXPECT_EQ(v.number(p + "tfcclass"), path->traffic_class) << p;
    EXPECT_EQ(v.number(p + "hoplim"), path->hop_limit) << p;
    EXPECT_EQ(v.number(p + "sl"), path->sl) << p;
    EXPECT_EQ(v.number(p + "subnetlocal"), path->subnet_local ? 1u : 0u) << p;
    EXPECT_EQ(v.number(p + "localacktout"), path->local_ack_timeout) << p;
  }
  EXPECT_EQ(v.text.at("cm.req.prim_localgid_ipv4"), "10.0.0.2") << "an IPv4-mapped GID, as RoCE's are";
  EXPECT_EQ(v.text.at("cm.req.prim_remotegid_ipv4"), "10.0.0.1");
  const auto bytes_text = [](const Gid& gid) {
    std::string text;
    for (uint8_t byte : gid) text += "0123456789abcdef"[byte >> 4], text += "0123456789abcdef"[byte & 15];
    return text;
  };
  EXPECT_EQ(v.text.at("cm.req.alt_localgid"), bytes_text(m.alternate.local_gid));
  EXPECT_EQ(v.text.at("cm.req.alt_remotegid"), bytes_text(m.alternate.remote_gid));
  EXPECT_EQ(v.number("cm.req.ip_cm.majv"), 0u);
  EXPECT_EQ(v.number("cm.req.ip_cm.ipv"), 4u);
  EXPECT_EQ(v.number("cm.req.ip_cm.sport"), 40000u);
  EXPECT_EQ(v.text.at("cm.req.ip_cm.sip4"), "10.0.0.2");
  EXPECT_EQ(v.text.at("cm.req.ip_cm.dip4"), "10.0.0.1");
}

TEST_F(CmMadTshark, RepAsTheDissectorReadsIt) {
  const Mad mad = sample(Attribute::Rep);
  const Rep& m = mad.rep;
  const auto v = decode(write(mad), {"mad.attributeid", "cm.rep", "cm.rep.remotecommid", "cm.rep.localqkey",
                                     "cm.rep.localqpn", "cm.rep.localeecn", "cm.rep.startpsn", "cm.rep.respres",
                                     "cm.rep.initdepth", "cm.rep.tgtackdelay", "cm.rep.failoveracc",
                                     "cm.rep.e2eflowctrl", "cm.rep.rnrretrcount", "cm.rep.srq", "cm.rep.localcaguid"});
  EXPECT_EQ(v.number("mad.attributeid"), 0x13u);
  EXPECT_EQ(v.number("cm.rep"), m.local_comm_id);
  EXPECT_EQ(v.number("cm.rep.remotecommid"), m.remote_comm_id);
  EXPECT_EQ(v.number("cm.rep.localqkey"), m.local_qkey);
  EXPECT_EQ(v.number("cm.rep.localqpn"), m.local_qpn);
  EXPECT_EQ(v.number("cm.rep.localeecn"), m.local_eecn);
  EXPECT_EQ(v.number("cm.rep.startpsn"), m.starting_psn);
  EXPECT_EQ(v.number("cm.rep.respres"), m.responder_resources);
  EXPECT_EQ(v.number("cm.rep.initdepth"), m.initiator_depth);
  EXPECT_EQ(v.number("cm.rep.tgtackdelay"), m.target_ack_delay);
  EXPECT_EQ(v.number("cm.rep.failoveracc"), m.failover_accepted);
  EXPECT_EQ(v.number("cm.rep.e2eflowctrl"), 1u);
  EXPECT_EQ(v.number("cm.rep.rnrretrcount"), m.rnr_retry_count);
  EXPECT_EQ(v.number("cm.rep.srq"), 1u);
  EXPECT_EQ(v.number("cm.rep.localcaguid"), m.local_ca_guid);
}

TEST_F(CmMadTshark, RtuRejDreqDrepAsTheDissectorReadsThem) {
  auto v = decode(write(sample(Attribute::Rtu)), {"mad.attributeid", "cm.rtu.localcommid", "cm.rtu.remotecommid"});
  EXPECT_EQ(v.number("mad.attributeid"), 0x14u);
  EXPECT_EQ(v.number("cm.rtu.localcommid"), 0x11112222u);
  EXPECT_EQ(v.number("cm.rtu.remotecommid"), 0x33334444u);

  v = decode(write(sample(Attribute::Rej)), {"mad.attributeid", "cm.rej.localcommid", "cm.rej.remotecommid",
                                             "cm.rej.msgrej", "cm.rej.rejinfolen", "cm.rej.reason"});
  EXPECT_EQ(v.number("mad.attributeid"), 0x12u);
  EXPECT_EQ(v.number("cm.rej.localcommid"), 0x0a0b0c0du);
  EXPECT_EQ(v.number("cm.rej.remotecommid"), 0x01010101u);
  EXPECT_EQ(v.number("cm.rej.msgrej"), 2u);
  EXPECT_EQ(v.number("cm.rej.rejinfolen"), 72u);
  EXPECT_EQ(v.number("cm.rej.reason"), reject::kConsumer);

  v = decode(write(sample(Attribute::Dreq)),
             {"mad.attributeid", "cm.dreq.localcommid", "cm.dreq.remotecommid", "cm.req.remoteqpneecn"});
  EXPECT_EQ(v.number("mad.attributeid"), 0x15u);
  EXPECT_EQ(v.number("cm.dreq.localcommid"), 0x11112222u);
  EXPECT_EQ(v.number("cm.dreq.remotecommid"), 0x33334444u);
  EXPECT_EQ(v.number("cm.req.remoteqpneecn"), 0x00beefu);

  v = decode(write(sample(Attribute::Drep)), {"mad.attributeid", "cm.drsp.localcommid", "cm.drsp.remotecommid"});
  EXPECT_EQ(v.number("mad.attributeid"), 0x16u);
  EXPECT_EQ(v.number("cm.drsp.localcommid"), 0x33334444u);
  EXPECT_EQ(v.number("cm.drsp.remotecommid"), 0x11112222u);
}

// QP1's routing in device memory: a REQ to the agent listening on its
// service ID (an exact address before a wildcard), other messages to the
// agent their communication ID names, and the kernel CM's answers where no
// live agent takes them.
class CmRouting : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    memory_ = DeviceMemory::open(dir_.path() + "/device.mem", &error);
    ASSERT_TRUE(memory_) << error;
    exact_ = make_agent();
    wildcard_ = make_agent();
  }
  uint32_t make_agent() {
    const int index = memory_->allocate_qp();
    EXPECT_GE(index, 0);
    QpRecord& qp = memory_->shared().qps[index];
    qp.type = QpType::Ud;
    qp.gsi_agent = 1;
    return qp.qpn;
  }
  std::array<uint8_t, kMadBytes> req_to(uint16_t port, const Gid& destination, uint32_t comm_id = 0x0abc0001,
                                        uint8_t ip_version = 4) {
    Mad mad = sample_req();
    mad.req.local_comm_id = comm_id;
    mad.req.service_id = service_id(kPortSpaceTcp, port);
    IpHeader ip;
    ip.ip_version = ip_version;
    ip.source_port = 40000;
    ip.source = ip_version == 4 ? Gid{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2}
                                : Gid{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2};
    ip.destination = destination;
    put_ip_header(ip, mad.req.private_data);
    return build_cm_mad(mad);
  }
  static constexpr Gid kAddress = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
  test::TemporaryDirectory dir_;
  std::shared_ptr<DeviceMemory> memory_;
  uint32_t exact_ = 0, wildcard_ = 0;
};

TEST_F(CmRouting, RequestsGoToTheirListenerOthersAreRejectedAsByTheKernel) {
  const uint64_t port_7471 = service_id(kPortSpaceTcp, 7471);
  ASSERT_EQ(add_cm_listener(*memory_, port_7471, {}, wildcard_), 0);
  ASSERT_EQ(add_cm_listener(*memory_, port_7471, {kAddress, 4}, exact_), 0);
  EXPECT_EQ(add_cm_listener(*memory_, port_7471, {kAddress, 4}, wildcard_), EADDRINUSE);

  EXPECT_EQ(route_cm_mad(*memory_, req_to(7471, kAddress)).agent_qpn, exact_) << "the exact address first";
  Gid elsewhere = kAddress;
  elsewhere[15] = 9;
  EXPECT_EQ(route_cm_mad(*memory_, req_to(7471, elsewhere)).agent_qpn, wildcard_) << "then the wildcard";

  const CmDelivery nobody = route_cm_mad(*memory_, req_to(7472, kAddress, 0x0abc0042));
  EXPECT_EQ(nobody.agent_qpn, 0u);
  ASSERT_TRUE(nobody.answer);
  const auto rej = parse_cm_mad(*nobody.answer);
  ASSERT_TRUE(rej);
  EXPECT_EQ(rej->attribute, Attribute::Rej);
  EXPECT_EQ(rej->rej.reason, reject::kInvalidServiceId);
  EXPECT_EQ(rej->rej.remote_comm_id, 0x0abc0042u) << "addressed to the REQ's sender";
  EXPECT_EQ(rej->transaction_id, sample_req().transaction_id);

  remove_cm_listener(*memory_, port_7471, {kAddress, 4}, exact_);
  EXPECT_EQ(route_cm_mad(*memory_, req_to(7471, kAddress)).agent_qpn, wildcard_) << "removed";
}

// rdma_cm's AFONLY: an IPv4 wildcard and an IPv6-only one share a port,
// each taking its own version's REQs (tgtd listens so for iSER), where an
// IPv6 wildcard that also takes IPv4 conflicts with both.
TEST_F(CmRouting, WildcardsOfEachIpVersionShareAPort) {
  const uint64_t port_3260 = service_id(kPortSpaceTcp, 3260);
  const CmListenOn ipv4{{}, 4}, ipv6_only{{}, 6}, both{{}, 0};
  ASSERT_EQ(add_cm_listener(*memory_, port_3260, ipv4, exact_), 0);
  ASSERT_EQ(add_cm_listener(*memory_, port_3260, ipv6_only, wildcard_), 0);
  EXPECT_EQ(add_cm_listener(*memory_, port_3260, both, wildcard_), EADDRINUSE);
  EXPECT_EQ(add_cm_listener(*memory_, port_3260, ipv4, wildcard_), EADDRINUSE);

  const Gid v6_address{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  EXPECT_EQ(route_cm_mad(*memory_, req_to(3260, kAddress)).agent_qpn, exact_) << "IPv4 to the IPv4 wildcard";
  EXPECT_EQ(route_cm_mad(*memory_, req_to(3260, v6_address, 0x0abc0002, 6)).agent_qpn, wildcard_)
      << "IPv6 to the IPv6 one";

  remove_cm_listener(*memory_, port_3260, ipv6_only, wildcard_);
  const CmDelivery refused = route_cm_mad(*memory_, req_to(3260, v6_address, 0x0abc0003, 6));
  EXPECT_EQ(refused.agent_qpn, 0u) << "the IPv4 wildcard takes no IPv6 REQ";
  ASSERT_TRUE(refused.answer);
  EXPECT_EQ(parse_cm_mad(*refused.answer)->rej.reason, reject::kInvalidServiceId);
  EXPECT_EQ(route_cm_mad(*memory_, req_to(3260, kAddress)).agent_qpn, exact_) << "removing one left the other";

  remove_cm_listener(*memory_, port_3260, ipv4, exact_);
  ASSERT_EQ(add_cm_listener(*memory_, port_3260, both, wildcard_), 0);
  EXPECT_EQ(route_cm_mad(*memory_, req_to(3260, kAddress)).agent_qpn, wildcard_) << "both versions";
  EXPECT_EQ(route_cm_mad(*memory_, req_to(3260, v6_address, 0x0abc0004, 6)).agent_qpn, wildcard_);
}

TEST_F(CmRouting, CommunicationIdsNameTheirAgentAndDeadOnesAreAnswered) {
  const uint32_t ours = cm_local_id(exact_, 77);
  Mad rep = sample(Attribute::Rep);
  rep.rep.remote_comm_id = ours;
  EXPECT_EQ(route_cm_mad(*memory_, build_cm_mad(rep)).agent_qpn, exact_);

  // The agent's QP is gone (its process ended and its records were freed).
  memory_->shared().qps[exact_ & ((1u << kQpnIndexBits) - 1)].live = 0;
  const CmDelivery to_rep = route_cm_mad(*memory_, build_cm_mad(rep));
  EXPECT_EQ(to_rep.agent_qpn, 0u);
  ASSERT_TRUE(to_rep.answer);
  const auto rej = parse_cm_mad(*to_rep.answer);
  ASSERT_TRUE(rej);
  EXPECT_EQ(rej->attribute, Attribute::Rej);
  EXPECT_EQ(rej->rej.reason, reject::kInvalidCommId);
  EXPECT_EQ(rej->rej.message, MessageRejected::Rep);
  EXPECT_EQ(rej->rej.remote_comm_id, rep.rep.local_comm_id);

  Mad dreq = sample(Attribute::Dreq);
  dreq.dreq.remote_comm_id = ours;
  const CmDelivery to_dreq = route_cm_mad(*memory_, build_cm_mad(dreq));
  ASSERT_TRUE(to_dreq.answer);
  const auto drep = parse_cm_mad(*to_dreq.answer);
  ASSERT_TRUE(drep);
  EXPECT_EQ(drep->attribute, Attribute::Drep);
  EXPECT_EQ(drep->drep.remote_comm_id, dreq.dreq.local_comm_id);

  Mad rtu = sample(Attribute::Rtu);
  rtu.rtu.remote_comm_id = ours;
  const CmDelivery to_rtu = route_cm_mad(*memory_, build_cm_mad(rtu));
  EXPECT_EQ(to_rtu.agent_qpn, 0u);
  EXPECT_FALSE(to_rtu.answer) << "an RTU needs no answer";
  EXPECT_FALSE(route_cm_mad(*memory_, std::array<uint8_t, kMadBytes>{}).answer) << "not a CM MAD";
}

// A connection of a process that died is announced as the kernel's CM
// announces it: a DREQ at once, resent every ~1.07 s until the peer's DREP
// (which reaches whichever process of the device receives it) or until the
// retries run out.
TEST_F(CmRouting, ADeadAgentsConnectionsAreAnnouncedUntilTheirDrepComes) {
  using std::chrono::milliseconds;
  const auto start = std::chrono::steady_clock::now();
  const auto at = [&](int ms) { return start + milliseconds(ms); };
  CmConnectionTable::Entry answered;
  answered.agent_qpn = exact_;
  answered.local_comm_id = cm_local_id(exact_, 5);
  answered.remote_comm_id = 0x0def0001;
  CmConnectionTable::Entry unanswered = answered;
  unanswered.local_comm_id = cm_local_id(exact_, 6);
  unanswered.remote_comm_id = 0x0def0002;
  ASSERT_TRUE(add_cm_connection(*memory_, answered));
  ASSERT_TRUE(add_cm_connection(*memory_, unanswered));
  EXPECT_TRUE(due_orphan_dreqs(*memory_, at(0)).empty()) << "its agent lives";

  memory_->shared().qps[exact_ & ((1u << kQpnIndexBits) - 1)].live = 0;  // its process died
  auto due = due_orphan_dreqs(*memory_, at(0));
  ASSERT_EQ(due.size(), 2u) << "both announced at once";
  EXPECT_EQ(due[0].dreqs_left, kMaxCmRetries);
  const auto dreq = parse_cm_mad(orphan_dreq(due[0]));
  ASSERT_TRUE(dreq);
  EXPECT_EQ(dreq->attribute, Attribute::Dreq);
  EXPECT_EQ(dreq->dreq.local_comm_id, answered.local_comm_id);
  EXPECT_EQ(dreq->dreq.remote_comm_id, answered.remote_comm_id);
  EXPECT_TRUE(due_orphan_dreqs(*memory_, at(500)).empty()) << "not before the response timeout";

  // The peer's DREP for the first: nobody holds its ID, and the device takes it.
  Mad drep = sample(Attribute::Drep);
  drep.drep.local_comm_id = answered.remote_comm_id;
  drep.drep.remote_comm_id = answered.local_comm_id;
  const CmDelivery to_drep = route_cm_mad(*memory_, build_cm_mad(drep));
  EXPECT_EQ(to_drep.agent_qpn, 0u);
  EXPECT_FALSE(to_drep.answer);

  int sends = 1;
  for (int ms = 1100; ms <= 11000; ms += 1100) {
    for (const auto& entry : due_orphan_dreqs(*memory_, at(ms))) {
      EXPECT_EQ(entry.local_comm_id, unanswered.local_comm_id) << "the answered one is not resent";
      ++sends;
    }
  }
  EXPECT_EQ(sends, 1 + kMaxCmRetries) << "the unanswered one, until its retries ran out";
  EXPECT_FALSE(cm_connections_recorded(*memory_)) << "both entries freed";
}

}  // namespace
}  // namespace softverbs
