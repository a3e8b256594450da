// The connection-management messages as the engine handles them (IB CM's
// REQ/REP/RTU/REJ/DREQ/DREP, SIDR for UD), with the private-data sizes that
// rdma_cm presents on RoCE. On the wire they travel as CM MADs (cm_mad.h);
// cm_mads.cpp converts.
#pragma once

#include <cstddef>
#include <cstdint>

namespace softverbs::cm {

// Private data a user may pass, per message (IB CM sizes less rdma_cm's
// 36-byte header where it adds one).
inline constexpr size_t kReqPrivateData = 56;
inline constexpr size_t kRepPrivateData = 196;
inline constexpr size_t kRejPrivateData = 148;
inline constexpr size_t kSidrReqPrivateData = 180;
inline constexpr size_t kSidrRepPrivateData = 136;

// IB CM reject reasons reported as the REJECTED event's status.
inline constexpr int kRejectInvalidServiceId = 8;  // no listener
inline constexpr int kRejectConsumer = 28;         // rdma_reject()

enum class MessageType : uint8_t { Req = 1, Rep, Rtu, Rej, Dreq, Drep, SidrReq, SidrRep };

struct WireAddress {
  uint16_t family = 0;  // AF_INET or AF_INET6
  uint16_t port = 0;    // network byte order, as in sockaddr
  uint8_t address[16] = {};
};

struct ConnectRequest {
  uint32_t qp_num = 0;
  uint32_t start_psn = 0;
  uint8_t qp_type = 0;  // ibv_qp_type
  uint8_t responder_resources = 0;
  uint8_t initiator_depth = 0;
  uint8_t retry_count = 0;
  uint8_t rnr_retry_count = 0;
  uint8_t flow_control = 0;
  uint8_t srq = 0;
  uint8_t path_mtu = 0;
  uint32_t ece_vendor_id = 0;
  uint32_t ece_options = 0;
  WireAddress source;       // the active side's address
  WireAddress destination;  // the address it connected to
  uint8_t private_data_length = 0;
  uint8_t private_data[kReqPrivateData] = {};
};

struct ConnectReply {
  uint32_t qp_num = 0;
  uint32_t start_psn = 0;
  uint8_t responder_resources = 0;
  uint8_t initiator_depth = 0;
  uint8_t rnr_retry_count = 0;
  uint8_t flow_control = 0;
  uint8_t srq = 0;
  uint32_t ece_vendor_id = 0;
  uint32_t ece_options = 0;
  uint8_t private_data_length = 0;
  uint8_t private_data[kRepPrivateData] = {};
};

struct Reject {
  uint16_t reason = 0;
  uint8_t private_data_length = 0;
  uint8_t private_data[kRejPrivateData] = {};
};

struct SidrRequest {
  WireAddress source;
  WireAddress destination;
  uint8_t private_data_length = 0;
  uint8_t private_data[kSidrReqPrivateData] = {};
};

struct SidrReply {
  uint32_t status = 0;  // 0: accepted; else a reject reason
  uint32_t qp_num = 0;
  uint32_t qkey = 0;
  uint8_t private_data_length = 0;
  uint8_t private_data[kSidrRepPrivateData] = {};
};

struct Message {
  MessageType type = MessageType::Rtu;
  ConnectRequest req;
  ConnectReply rep;
  Reject rej;
  SidrRequest sidr_req;
  SidrReply sidr_rep;
};

}  // namespace softverbs::cm
