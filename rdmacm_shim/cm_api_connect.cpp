// Connection setup: the rdma_* calls that connect, listen, accept, reject
// and disconnect an id. Each sends the first MAD of its step; the engine's
// handlers (cm_protocol.cpp) take the handshake on from there.
#include <cstring>

#include "cm_internal.h"
#include "support/debug_log.h"
#include "support/random_bits.h"

namespace softverbs::cm {

namespace {

// The REQ (or SIDR_REQ) that rdma_connect sends for `id`.
Message connect_message(CmId* id, const rdma_conn_param* param) {
  const sockaddr_storage& destination = id->id.route.addr.dst_storage;
  Message message;
  if (is_ud(id)) {
    message.type = MessageType::SidrReq;
    message.sidr_req.source = to_wire(id->id.route.addr.src_storage);
    message.sidr_req.destination = to_wire(destination);
    if (param && param->private_data_len) {
      message.sidr_req.private_data_length = param->private_data_len;
      std::memcpy(message.sidr_req.private_data, param->private_data, param->private_data_len);
    }
    return message;
  }
  ConnectRequest& req = message.req;
  message.type = MessageType::Req;
  req.qp_num = id->id.qp ? id->id.qp->qp_num : (param ? param->qp_num : 0);
  req.start_psn = id->local_psn;
  req.qp_type = static_cast<uint8_t>(id->id.qp_type);
  req.responder_resources = id->responder_resources;
  req.initiator_depth = id->initiator_depth;
  req.retry_count = id->retry_count;
  req.rnr_retry_count = id->rnr_retry_count;
  req.flow_control = param ? param->flow_control : 1;
  req.srq = id->id.srq != nullptr || (param && param->srq);
  req.ece_vendor_id = id->local_ece.vendor_id;
  req.ece_options = id->local_ece.options;
  req.source = to_wire(id->id.route.addr.src_storage);
  req.destination = to_wire(destination);
  ibv_port_attr port{};
  if (ibv_query_port(id->id.verbs, 1, &port) == 0) req.path_mtu = static_cast<uint8_t>(port.active_mtu);
  if (param && param->private_data_len) {
    req.private_data_length = param->private_data_len;
    std::memcpy(req.private_data, param->private_data, param->private_data_len);
  }
  return message;
}

// Sends the id's REQ from this process's agent on its device; a failure is
// the id's UNREACHABLE event.
void send_request(Engine& engine, CmId* id, const rdma_conn_param* param) {
  const sockaddr_storage& destination = id->id.route.addr.dst_storage;
  CmAgent* agent = engine.agent_for(id->id.verbs);
  if (agent == nullptr) {
    set_state(id, IdState::Disconnected);
    deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ENODEV);
    return;
  }
  id->agent = agent;
  id->local_comm_id = agent->next_local_id();
  id->transaction_id = random_u64();
  id->local_gid = source_gid(agent, id->id.route.addr.src_storage, destination);
  id->peer_gid = gid_bytes(destination);
  const Message message = connect_message(id, param);
  set_state(id, IdState::RequestSent);
  id->request_sent_at = Clock::now();
  if (!send_to_peer(id, message)) {
    stop_resending(id);
    set_state(id, IdState::Disconnected);
    deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ENETUNREACH);
  }
}

}  // namespace

int connect(rdma_cm_id* public_id, const rdma_conn_param* param) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  CmId* id = priv(public_id);
  {
    std::lock_guard guard(engine.mutex);
    if (id->state != IdState::RouteResolved) return fail(EINVAL);
    size_t limit = is_ud(id) ? kSidrReqPrivateData : kReqPrivateData;
    if (param && param->private_data_len > limit) return fail(EINVAL);
    if (param && param->private_data_len && param->private_data == nullptr) return fail(EINVAL);
    id->local_psn = engine.random_psn();
    if (param) {
      id->responder_resources = param->responder_resources;
      id->initiator_depth = param->initiator_depth;
      id->retry_count = std::min<uint8_t>(param->retry_count, 7);
      id->rnr_retry_count = std::min<uint8_t>(param->rnr_retry_count, 7);
    }
    clamp_depths(id);
    send_request(engine, id, param);
  }
  if (!id->own_channel) return 0;
  auto event = wait_for(id, {RDMA_CM_EVENT_ESTABLISHED, RDMA_CM_EVENT_CONNECT_RESPONSE, RDMA_CM_EVENT_REJECTED,
                             RDMA_CM_EVENT_UNREACHABLE, RDMA_CM_EVENT_CONNECT_ERROR});
  rdma_cm_event_type success = event && event->event.event == RDMA_CM_EVENT_CONNECT_RESPONSE
                                   ? RDMA_CM_EVENT_CONNECT_RESPONSE
                                   : RDMA_CM_EVENT_ESTABLISHED;
  return finish_sync(id, std::move(event), success);
}

int establish(rdma_cm_id* public_id) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->id.qp != nullptr || id->state != IdState::ResponseReceived) return fail(EINVAL);
  Message rtu;
  rtu.type = MessageType::Rtu;
  if (!send_to_peer(id, rtu)) return fail(ECONNRESET);
  set_state(id, IdState::Connected);
  Engine::instance().schedule_resends();  // starts watching the peer
  return 0;
}

namespace {

// Registers a listener bound to `local` with the devices that route REQs
// for its port here: the address's, or for a wildcard every one (0 or an
// errno).
int register_listener(Engine& engine, CmId* id, const sockaddr_storage& local) {
  std::vector<ibv_context*> contexts;
  if (is_wildcard(local))
    contexts = engine.devices.all();
  else
    contexts.push_back(id->id.verbs);
  const uint64_t service_id = mad::service_id(port_space_of(id), port_of(local));
  const CmListenOn on = listen_on(local, id->afonly);
  int error = 0;
  for (ibv_context* context : contexts) {
    CmAgent* agent = engine.agent_for(context);
    if (agent == nullptr) continue;  // not a softverbs device
    error = agent->add_listener(service_id, on);
    if (error != 0) break;
    id->listening.emplace_back(agent, on);
  }
  if (error == 0 && id->listening.empty()) error = ENODEV;
  if (error != 0) {
    debug_log("rdma_listen on %s: %s", address_key(local).c_str(), strerror(error));
    for (const auto& [agent, where] : id->listening) agent->remove_listener(service_id, where);
    id->listening.clear();
  }
  return error;
}

}  // namespace

int listen(rdma_cm_id* public_id, int) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  {
    std::lock_guard guard(engine.mutex);
    CmId* id = priv(public_id);
    if (id->state == IdState::Idle) {
      sockaddr_in any{};
      any.sin_family = AF_INET;
      if (bind_addr(public_id, reinterpret_cast<sockaddr*>(&any)) != 0) return -1;
    }
    if (id->state != IdState::Bound) return fail(EINVAL);
    sockaddr_storage local = id->id.route.addr.src_storage;
    if (int error = engine.directory->claim(local)) return fail(error);
    if (int error = register_listener(engine, id, local)) {
      engine.directory->release(local);
      return fail(error);
    }
    id->listed = true;
    set_state(id, IdState::Listening);
  }
  return 0;
}

int get_request(rdma_cm_id* listen_id, rdma_cm_id** out) {
  if (listen_id == nullptr || out == nullptr) return fail(EINVAL);
  CmId* listener = priv(listen_id);
  if (!listener->own_channel || listener->state != IdState::Listening) return fail(EINVAL);
  auto event = wait_for(listener, {RDMA_CM_EVENT_CONNECT_REQUEST});
  if (!event) return fail(EIO);
  CmId* id = priv(event->event.id);
  std::lock_guard guard(Engine::instance().mutex);
  id->held_event = std::move(event);
  id->id.event = &id->held_event->event;
  if (listener->endpoint_qp_attr) {
    ibv_qp_init_attr attr = *listener->endpoint_qp_attr;
    if (create_qp(&id->id, listener->endpoint_pd, &attr) != 0) {
      int error = errno;
      reject(&id->id, nullptr, 0, kRejectConsumer);
      destroy_id(&id->id);
      return fail(error);
    }
  }
  *out = &id->id;
  return 0;
}

namespace {

// rdma_accept of a SIDR_REQ: the SIDR_REP, and the id is connected.
int accept_sidr(CmId* id, const rdma_conn_param* param) {
  Message message;
  message.type = MessageType::SidrRep;
  message.sidr_rep.qp_num = id->id.qp ? id->id.qp->qp_num : (param ? param->qp_num : 0);
  message.sidr_rep.qkey = RDMA_UDP_QKEY;
  if (param && param->private_data_len) {
    message.sidr_rep.private_data_length = param->private_data_len;
    std::memcpy(message.sidr_rep.private_data, param->private_data, param->private_data_len);
  }
  bool sent = send_to_peer(id, message);
  stop_resending(id);
  set_state(id, IdState::Connected);
  return sent ? 0 : fail(ECONNRESET);
}

Message reply_message(CmId* id, const rdma_conn_param* param) {
  Message message;
  ConnectReply& rep = message.rep;
  message.type = MessageType::Rep;
  rep.qp_num = id->id.qp ? id->id.qp->qp_num : (param ? param->qp_num : 0);
  rep.start_psn = id->local_psn;
  rep.responder_resources = id->responder_resources;
  rep.initiator_depth = id->initiator_depth;
  rep.rnr_retry_count = id->rnr_retry_count;
  rep.flow_control = param ? param->flow_control : 1;
  rep.srq = id->id.srq != nullptr || (param && param->srq);
  rep.ece_vendor_id = id->local_ece.vendor_id;
  rep.ece_options = id->local_ece.options;
  if (param && param->private_data_len) {
    rep.private_data_length = param->private_data_len;
    std::memcpy(rep.private_data, param->private_data, param->private_data_len);
  }
  return message;
}

}  // namespace

int accept(rdma_cm_id* public_id, const rdma_conn_param* param) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  CmId* id = priv(public_id);
  {
    std::lock_guard guard(engine.mutex);
    if (id->state != IdState::RequestReceived || id->agent == nullptr) return fail(EINVAL);
    size_t limit = is_ud(id) ? kSidrRepPrivateData : kRepPrivateData;
    if (param && param->private_data_len > limit) return fail(EINVAL);
    if (param && param->private_data_len && param->private_data == nullptr) return fail(EINVAL);
    if (is_ud(id)) return accept_sidr(id, param);
    if (param) {
      id->responder_resources = param->responder_resources;
      id->initiator_depth = param->initiator_depth;
      id->rnr_retry_count = std::min<uint8_t>(param->rnr_retry_count, 7);
      clamp_depths(id);
    }
    if (id->id.qp != nullptr && (modify(id, IBV_QPS_RTR) != 0 || modify(id, IBV_QPS_RTS) != 0)) {
      int error = errno ? errno : EINVAL;
      return fail(error);
    }
    set_state(id, IdState::ReplySent);
    if (!send_to_peer(id, reply_message(id, param))) {
      set_state(id, IdState::RequestReceived);
      return fail(ECONNRESET);
    }
    if (id->own_channel == nullptr) return 0;
  }
  auto event = wait_for(id, {RDMA_CM_EVENT_ESTABLISHED, RDMA_CM_EVENT_DISCONNECTED, RDMA_CM_EVENT_REJECTED});
  return finish_sync(id, std::move(event), RDMA_CM_EVENT_ESTABLISHED);
}

int reject(rdma_cm_id* public_id, const void* private_data, uint8_t length, uint16_t reason) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  if (id->state != IdState::RequestReceived || id->agent == nullptr) return fail(EINVAL);
  size_t limit = is_ud(id) ? kSidrRepPrivateData : kRejPrivateData;
  if (length > limit || (length && private_data == nullptr)) return fail(EINVAL);
  Message message;
  if (is_ud(id)) {
    message.type = MessageType::SidrRep;
    message.sidr_rep.status = mad::sidr_status::kRejected;  // the kernel's, whatever the reason
    message.sidr_rep.private_data_length = length;
    if (length) std::memcpy(message.sidr_rep.private_data, private_data, length);
  } else {
    message.type = MessageType::Rej;
    message.rej.reason = reason;
    message.rej.private_data_length = length;
    if (length) std::memcpy(message.rej.private_data, private_data, length);
  }
  send_to_peer(id, message);
  stop_resending(id);
  set_state(id, IdState::Disconnected);
  return 0;
}

int disconnect(rdma_cm_id* public_id) {
  if (public_id == nullptr) return fail(EINVAL);
  std::lock_guard guard(Engine::instance().mutex);
  CmId* id = priv(public_id);
  // The QP goes to ERR first, which flushes what is posted on it, as
  // librdmacm does whatever comes next.
  move_qp_to_error(id);
  // As the kernel's rdma_cm: EINVAL only for an id with no connection
  // under way; after the peer disconnected first, 0.
  if (id->state == IdState::Idle || id->state == IdState::Bound || id->state == IdState::AddressResolved ||
      id->state == IdState::RouteResolved || id->state == IdState::Listening)
    return fail(EINVAL);
  if (id->state == IdState::Disconnected) return 0;
  // Not connected yet (a REQ out, a REP in, a request not accepted): the
  // kernel's DREQ cannot be sent and it says 0; the handshake goes on or
  // times out as it would.
  if (id->state != IdState::Connected && id->state != IdState::ReplySent) return 0;
  if (id->agent != nullptr) {
    Message dreq;
    dreq.type = MessageType::Dreq;
    send_to_peer(id, dreq);
  }
  set_state(id, IdState::Disconnected);
  // Both ends see DISCONNECTED, as with the kernel's rdma_cm.
  if (!id->own_channel) {
    deliver(id, RDMA_CM_EVENT_DISCONNECTED, 0);
    enter_timewait(id);
  }
  return 0;
}

}  // namespace softverbs::cm
