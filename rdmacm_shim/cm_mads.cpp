// CM MADs and the Messages they carry: what an id's connection puts on
// the wire for each message (mad_for) and what a MAD that arrived says
// (message_of).
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

#include "cm_internal.h"

namespace softverbs::cm {

namespace {

mad::IpHeader ip_header(const sockaddr_storage& source, const sockaddr_storage& destination) {
  mad::IpHeader header;
  header.ip_version = source.ss_family == AF_INET6 ? 6 : 4;
  header.source_port = port_of(source);
  header.source = gid_bytes(source);
  header.destination = gid_bytes(destination);
  return header;
}

template <size_t N>
void put_private(std::array<uint8_t, N>& area, size_t at, const uint8_t* data, size_t length) {
  std::memcpy(area.data() + at, data, std::min(length, N - at));
}

void fill_req(const CmId* id, const ConnectRequest& req, mad::Req& m) {
  const sockaddr_storage& local = id->id.route.addr.src_storage;
  const sockaddr_storage& peer = id->id.route.addr.dst_storage;
  m.local_comm_id = id->local_comm_id;
  m.vendor_id = req.ece_vendor_id & 0xffffff;
  m.local_eecn = req.ece_options & 0xffffff;
  m.service_id = mad::service_id(port_space_of(id), port_of(peer));
  m.local_ca_guid = id->agent ? id->agent->node_guid() : 0;
  m.local_qpn = req.qp_num;
  m.responder_resources = req.responder_resources;
  m.initiator_depth = req.initiator_depth;
  m.remote_cm_response_timeout = kCmResponseTimeout;
  // IBA 12.6.5: RC 0, UC 1; XRC is the extended type 1 of service type 3.
  const bool xrc = req.qp_type == IBV_QPT_XRC_SEND;
  m.transport_service_type = req.qp_type == IBV_QPT_UC ? 1 : xrc ? 3 : 0;
  m.extended_transport_type = xrc ? 1 : 0;
  m.end_to_end_flow_control = req.flow_control != 0;
  m.starting_psn = req.start_psn;
  m.local_cm_response_timeout = kCmResponseTimeout;
  m.retry_count = req.retry_count;
  m.path_mtu = req.path_mtu;
  m.rnr_retry_count = req.rnr_retry_count;
  m.max_cm_retries = kMaxCmRetries;
  m.srq = req.srq != 0;
  m.primary.local_gid = id->local_gid;
  m.primary.remote_gid = id->peer_gid;
  m.primary.traffic_class = id->tos;
  m.primary.hop_limit = kHopLimit;
  m.primary.local_ack_timeout = id->ack_timeout;
  mad::put_ip_header(ip_header(local, peer), m.private_data);
  put_private(m.private_data, mad::kIpHeaderBytes, req.private_data, req.private_data_length);
}

void fill_rep(const CmId* id, const ConnectReply& rep, mad::Rep& m) {
  m.local_comm_id = id->local_comm_id;
  m.remote_comm_id = id->remote_comm_id;
  m.local_qpn = rep.qp_num;
  m.local_eecn = rep.ece_options & 0xffffff;
  m.starting_psn = rep.start_psn;
  m.responder_resources = rep.responder_resources;
  m.initiator_depth = rep.initiator_depth;
  m.end_to_end_flow_control = rep.flow_control != 0;
  m.rnr_retry_count = rep.rnr_retry_count;
  m.srq = rep.srq != 0;
  m.local_ca_guid = id->agent ? id->agent->node_guid() : 0;
  put_private(m.private_data, 0, rep.private_data, rep.private_data_length);
}

void fill_rej(const CmId* id, const Reject& rej, mad::Rej& m) {
  m.local_comm_id = id->local_comm_id;
  m.remote_comm_id = id->remote_comm_id;
  m.message = id->state == IdState::RequestSent || id->state == IdState::ResponseReceived ? mad::MessageRejected::Rep
                                                                                          : mad::MessageRejected::Req;
  m.reason = rej.reason;
  put_private(m.private_data, 0, rej.private_data, rej.private_data_length);
}

void fill_sidr_req(const CmId* id, const SidrRequest& req, mad::SidrReq& m) {
  const sockaddr_storage& local = id->id.route.addr.src_storage;
  const sockaddr_storage& peer = id->id.route.addr.dst_storage;
  m.request_id = id->local_comm_id;
  m.service_id = mad::service_id(port_space_of(id), port_of(peer));
  mad::put_ip_header(ip_header(local, peer), m.private_data);
  put_private(m.private_data, mad::kIpHeaderBytes, req.private_data, req.private_data_length);
}

void fill_sidr_rep(const CmId* id, const SidrReply& rep, mad::SidrRep& m) {
  m.request_id = id->remote_comm_id;
  m.status = static_cast<uint8_t>(rep.status);
  m.qpn = rep.qp_num;
  m.service_id = mad::service_id(port_space_of(id), port_of(id->id.route.addr.src_storage));
  m.qkey = rep.qkey;
  put_private(m.private_data, 0, rep.private_data, rep.private_data_length);
}

}  // namespace

uint32_t remote_qpn_of(const CmId* id) { return id->request ? id->request->qp_num : id->reply ? id->reply->qp_num : 0; }

MadBytes mad_for(const CmId* id, const Message& message) {
  mad::Mad out;
  out.transaction_id = id->transaction_id;
  switch (message.type) {
    case MessageType::Req:
      out.attribute = mad::Attribute::Req;
      fill_req(id, message.req, out.req);
      break;
    case MessageType::Rep:
      out.attribute = mad::Attribute::Rep;
      fill_rep(id, message.rep, out.rep);
      break;
    case MessageType::Rtu:
      out.attribute = mad::Attribute::Rtu;
      out.rtu.local_comm_id = id->local_comm_id;
      out.rtu.remote_comm_id = id->remote_comm_id;
      break;
    case MessageType::Rej:
      out.attribute = mad::Attribute::Rej;
      fill_rej(id, message.rej, out.rej);
      break;
    case MessageType::Dreq:
      return mad::build_dreq(id->transaction_id, id->local_comm_id, id->remote_comm_id, remote_qpn_of(id));
    case MessageType::Drep:
      out.attribute = mad::Attribute::Drep;
      out.drep.local_comm_id = id->local_comm_id;
      out.drep.remote_comm_id = id->remote_comm_id;
      break;
    case MessageType::SidrReq:
      out.attribute = mad::Attribute::SidrReq;
      fill_sidr_req(id, message.sidr_req, out.sidr_req);
      break;
    case MessageType::SidrRep:
      out.attribute = mad::Attribute::SidrRep;
      fill_sidr_rep(id, message.sidr_rep, out.sidr_rep);
      break;
  }
  return mad::build_cm_mad(out);
}

bool carries_dreq(const MadBytes& bytes) {
  const auto route = mad::cm_route(bytes);
  return route && route->attribute == mad::Attribute::Dreq;
}

// ---- what a MAD says ---------------------------------------------------------

namespace {

void take_private(uint8_t* to, uint8_t& length, const uint8_t* from, size_t size) {
  std::memcpy(to, from, size);
  length = static_cast<uint8_t>(size);
}

ConnectRequest request_of(const mad::Req& m) {
  ConnectRequest req;
  req.qp_num = m.local_qpn;
  req.start_psn = m.starting_psn;
  req.qp_type = static_cast<uint8_t>(m.transport_service_type == 1   ? IBV_QPT_UC
                                     : m.transport_service_type == 3 ? IBV_QPT_XRC_SEND
                                                                     : IBV_QPT_RC);
  req.responder_resources = m.responder_resources;
  req.initiator_depth = m.initiator_depth;
  req.retry_count = m.retry_count;
  req.rnr_retry_count = m.rnr_retry_count;
  req.flow_control = m.end_to_end_flow_control;
  req.srq = m.srq;
  req.path_mtu = m.path_mtu;
  req.ece_vendor_id = m.vendor_id;
  req.ece_options = m.local_eecn;
  if (const auto ip = mad::get_ip_header(m.private_data)) {
    req.source = wire_address(ip->source, ip->ip_version, ip->source_port);
    req.destination = wire_address(ip->destination, ip->ip_version, static_cast<uint16_t>(m.service_id));
  }
  take_private(req.private_data, req.private_data_length, m.private_data.data() + mad::kIpHeaderBytes, kReqPrivateData);
  return req;
}

ConnectReply reply_of(const mad::Rep& m) {
  ConnectReply rep;
  rep.qp_num = m.local_qpn;
  rep.start_psn = m.starting_psn;
  rep.responder_resources = m.responder_resources;
  rep.initiator_depth = m.initiator_depth;
  rep.rnr_retry_count = m.rnr_retry_count;
  rep.flow_control = m.end_to_end_flow_control;
  rep.srq = m.srq;
  rep.ece_options = m.local_eecn;
  take_private(rep.private_data, rep.private_data_length, m.private_data.data(), kRepPrivateData);
  return rep;
}

SidrRequest sidr_request_of(const mad::SidrReq& m) {
  SidrRequest req;
  if (const auto ip = mad::get_ip_header(m.private_data)) {
    req.source = wire_address(ip->source, ip->ip_version, ip->source_port);
    req.destination = wire_address(ip->destination, ip->ip_version, static_cast<uint16_t>(m.service_id));
  }
  take_private(req.private_data, req.private_data_length, m.private_data.data() + mad::kIpHeaderBytes,
               kSidrReqPrivateData);
  return req;
}

}  // namespace

Message message_of(const mad::Mad& in) {
  Message out;
  switch (in.attribute) {
    case mad::Attribute::Req:
      out.type = MessageType::Req;
      out.req = request_of(in.req);
      break;
    case mad::Attribute::Rep:
      out.type = MessageType::Rep;
      out.rep = reply_of(in.rep);
      break;
    case mad::Attribute::Rtu:
      out.type = MessageType::Rtu;
      break;
    case mad::Attribute::Rej:
      out.type = MessageType::Rej;
      out.rej.reason = in.rej.reason;
      take_private(out.rej.private_data, out.rej.private_data_length, in.rej.private_data.data(), kRejPrivateData);
      break;
    case mad::Attribute::Dreq:
      out.type = MessageType::Dreq;
      break;
    case mad::Attribute::Drep:
      out.type = MessageType::Drep;
      break;
    case mad::Attribute::SidrReq:
      out.type = MessageType::SidrReq;
      out.sidr_req = sidr_request_of(in.sidr_req);
      break;
    case mad::Attribute::SidrRep:
      out.type = MessageType::SidrRep;
      out.sidr_rep.status = in.sidr_rep.status;
      out.sidr_rep.qp_num = in.sidr_rep.qpn;
      out.sidr_rep.qkey = in.sidr_rep.qkey;
      take_private(out.sidr_rep.private_data, out.sidr_rep.private_data_length, in.sidr_rep.private_data.data(),
                   kSidrRepPrivateData);
      break;
    default:
      break;
  }
  return out;
}

}  // namespace softverbs::cm
