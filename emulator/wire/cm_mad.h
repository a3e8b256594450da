// Communication Management MADs (IBA vol. 1, chapter 12) as they travel to
// QP1 on RoCE: a 24-byte MAD header and a 232-byte message, every field in
// network order at the bit offset the spec gives it. rdma_cm puts its IP
// addressing header (IBA annex A11, the kernel's struct cma_hdr) at the
// start of the private data of a REQ and SIDR_REQ, and builds the service ID
// from its port space and the destination port. Building and parsing live
// here and nowhere else; parse_cm_mad() takes only whole, known messages.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace softverbs::wire::cm {

inline constexpr size_t kMadBytes = 256;
inline constexpr size_t kMadHeaderBytes = 24;
inline constexpr uint8_t kCmClass = 0x07;
inline constexpr uint8_t kCmClassVersion = 2;
inline constexpr uint8_t kMethodSend = 0x03;
// The Q_Key of QP1 (GSI).
inline constexpr uint32_t kGsiQkey = 0x80010000;

enum class Attribute : uint16_t {
  Req = 0x0010,
  Mra = 0x0011,
  Rej = 0x0012,
  Rep = 0x0013,
  Rtu = 0x0014,
  Dreq = 0x0015,
  Drep = 0x0016,
  SidrReq = 0x0017,
  SidrRep = 0x0018,
  Lap = 0x0019,
  Apr = 0x001a,
};

// Private data areas (bytes) per message.
inline constexpr size_t kReqPrivate = 92;
inline constexpr size_t kMraPrivate = 222;
inline constexpr size_t kRejPrivate = 148;
inline constexpr size_t kRepPrivate = 196;
inline constexpr size_t kRtuPrivate = 224;
inline constexpr size_t kDreqPrivate = 220;
inline constexpr size_t kDrepPrivate = 224;
inline constexpr size_t kSidrReqPrivate = 216;
inline constexpr size_t kSidrRepPrivate = 136;
inline constexpr size_t kRejAriBytes = 72;

// REJ reasons (IBA table 112) rdma_cm users meet.
namespace reject {
inline constexpr uint16_t kNoQp = 1;
inline constexpr uint16_t kTimeout = 2;  // the ARI says which message timed out
inline constexpr uint16_t kInvalidCommId = 5;
inline constexpr uint16_t kInvalidServiceId = 8;
inline constexpr uint16_t kStaleConnection = 10;
inline constexpr uint16_t kInvalidTransportType = 25;
inline constexpr uint16_t kConsumer = 28;
}  // namespace reject

// SIDR_REP status (IBA table 119).
namespace sidr_status {
inline constexpr uint8_t kValid = 0;
inline constexpr uint8_t kUnsupported = 1;  // no such service ID
inline constexpr uint8_t kRejected = 2;
}  // namespace sidr_status

// Which message a REJ or MRA refers to.
enum class MessageRejected : uint8_t { Req = 0, Rep = 1, Other = 2 };

using Gid = std::array<uint8_t, 16>;

struct Path {
  uint16_t local_lid = 0xffff;  // RoCE: the permissive LID
  uint16_t remote_lid = 0xffff;
  Gid local_gid{};
  Gid remote_gid{};
  uint32_t flow_label = 0;  // 20 bits
  uint8_t packet_rate = 0;  // 6 bits
  uint8_t traffic_class = 0;
  uint8_t hop_limit = 0;
  uint8_t sl = 0;  // 4 bits
  bool subnet_local = false;
  uint8_t local_ack_timeout = 0;  // 5 bits
};

struct Req {
  uint32_t local_comm_id = 0;
  uint32_t vendor_id = 0;  // 24 bits (ECE)
  uint64_t service_id = 0;
  uint64_t local_ca_guid = 0;
  uint32_t local_qkey = 0;
  uint32_t local_qpn = 0;  // 24 bits
  uint8_t responder_resources = 0;
  uint32_t local_eecn = 0;  // 24 bits (ECE options on RoCE)
  uint8_t initiator_depth = 0;
  uint32_t remote_eecn = 0;
  uint8_t remote_cm_response_timeout = 0;  // 5 bits
  uint8_t transport_service_type = 0;      // 2 bits: 0 RC, 1 UC, 3 extended (XRC)
  bool end_to_end_flow_control = false;
  uint32_t starting_psn = 0;
  uint8_t local_cm_response_timeout = 0;
  uint8_t retry_count = 0;  // 3 bits
  uint16_t pkey = 0xffff;
  uint8_t path_mtu = 0;  // 4 bits, IBV_MTU_*
  bool rdc_exists = false;
  uint8_t rnr_retry_count = 0;  // 3 bits
  uint8_t max_cm_retries = 0;   // 4 bits
  bool srq = false;
  uint8_t extended_transport_type = 0;  // 3 bits
  Path primary;
  Path alternate{0, 0};
  std::array<uint8_t, kReqPrivate> private_data{};
};

struct Mra {
  uint32_t local_comm_id = 0;
  uint32_t remote_comm_id = 0;
  MessageRejected message = MessageRejected::Req;
  uint8_t service_timeout = 0;  // 5 bits
  std::array<uint8_t, kMraPrivate> private_data{};
};

struct Rej {
  uint32_t local_comm_id = 0;
  uint32_t remote_comm_id = 0;
  MessageRejected message = MessageRejected::Req;
  uint8_t reject_info_length = 0;  // 7 bits
  uint16_t reason = 0;
  std::array<uint8_t, kRejAriBytes> ari{};
  std::array<uint8_t, kRejPrivate> private_data{};
};

struct Rep {
  uint32_t local_comm_id = 0;
  uint32_t remote_comm_id = 0;
  uint32_t local_qkey = 0;
  uint32_t local_qpn = 0;   // 24 bits
  uint32_t local_eecn = 0;  // 24 bits (ECE options on RoCE)
  uint32_t starting_psn = 0;
  uint8_t responder_resources = 0;
  uint8_t initiator_depth = 0;
  uint8_t target_ack_delay = 0;  // 5 bits
  uint8_t failover_accepted = 0;
  bool end_to_end_flow_control = false;
  uint8_t rnr_retry_count = 0;
  bool srq = false;
  uint64_t local_ca_guid = 0;
  std::array<uint8_t, kRepPrivate> private_data{};
};

struct Rtu {
  uint32_t local_comm_id = 0;
  uint32_t remote_comm_id = 0;
  std::array<uint8_t, kRtuPrivate> private_data{};
};

struct Dreq {
  uint32_t local_comm_id = 0;
  uint32_t remote_comm_id = 0;
  uint32_t remote_qpn = 0;  // 24 bits
  std::array<uint8_t, kDreqPrivate> private_data{};
};

struct Drep {
  uint32_t local_comm_id = 0;
  uint32_t remote_comm_id = 0;
  std::array<uint8_t, kDrepPrivate> private_data{};
};

struct SidrReq {
  uint32_t request_id = 0;
  uint16_t pkey = 0xffff;
  uint64_t service_id = 0;
  std::array<uint8_t, kSidrReqPrivate> private_data{};
};

struct SidrRep {
  uint32_t request_id = 0;
  uint8_t status = 0;
  uint8_t additional_info_length = 0;
  uint32_t qpn = 0;  // 24 bits
  uint64_t service_id = 0;
  uint32_t qkey = 0;
  std::array<uint8_t, 72> class_port_info{};
  std::array<uint8_t, kSidrRepPrivate> private_data{};
};

struct Mad {
  Attribute attribute = Attribute::Req;
  uint64_t transaction_id = 0;
  // The message the attribute names; the others stay default.
  Req req;
  Mra mra;
  Rej rej;
  Rep rep;
  Rtu rtu;
  Dreq dreq;
  Drep drep;
  SidrReq sidr_req;
  SidrRep sidr_rep;
};

// The 256 bytes of a CM MAD (method Send, status 0).
std::array<uint8_t, kMadBytes> build_cm_mad(const Mad& mad);
// A DREQ of the connection between two communication IDs, naming the
// peer's QPN (that of the REQ or REP it sent).
std::array<uint8_t, kMadBytes> build_dreq(uint64_t transaction_id, uint32_t local_comm_id, uint32_t remote_comm_id,
                                          uint32_t remote_qpn);

// A CM MAD of 256 bytes with base version 1, class 0x07 version 2, method
// Send and one of the attributes above but LAP/APR; nullopt for anything
// else.
std::optional<Mad> parse_cm_mad(std::span<const uint8_t> bytes);

// What a QP1 receiver needs to route a CM MAD without parsing it all: its
// attribute, the service ID of a REQ or SIDR_REQ, the remote communication
// ID of the messages that carry one (the receiver's own), the request ID of
// a SIDR_REP. nullopt where the header is not a CM Send.
struct CmRoute {
  Attribute attribute = Attribute::Req;
  uint64_t service_id = 0;
  uint32_t receiver_id = 0;
};
std::optional<CmRoute> cm_route(std::span<const uint8_t> bytes);

// rdma_cm's service IDs: the port space in bits 16..31, the port below.
inline constexpr uint16_t kPortSpaceTcp = 0x0106;
inline constexpr uint16_t kPortSpaceUdp = 0x0111;
inline constexpr uint16_t kPortSpaceIb = 0x013f;
inline constexpr uint16_t kPortSpaceIpoib = 0x0002;
inline constexpr uint64_t service_id(uint16_t port_space, uint16_t port) { return uint64_t{port_space} << 16 | port; }

// rdma_cm's addressing header at the start of a REQ's or SIDR_REQ's private
// data: version 0, the IP version in the high nibble of the next byte, the
// source port, then both addresses (IPv4 in the last four bytes of each).
inline constexpr size_t kIpHeaderBytes = 36;
struct IpHeader {
  uint8_t ip_version = 4;  // 4 or 6
  uint16_t source_port = 0;
  Gid source{};  // IPv6, or IPv4 as ::ffff:a.b.c.d (as a GID holds it)
  Gid destination{};
};
void put_ip_header(const IpHeader& header, std::span<uint8_t> private_data);
// nullopt for a version that is not 0 or an IP version not 4 or 6.
std::optional<IpHeader> get_ip_header(std::span<const uint8_t> private_data);

}  // namespace softverbs::wire::cm
