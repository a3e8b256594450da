// The CM protocol's state transitions: what an id sends (send_to_peer) and
// what it does with each MAD that arrives for it, a REQ for a listener, or
// a MAD resent until its retries ran out.
#include <algorithm>

#include "cm_internal.h"
#include "device/cm_routing.h"
#include "support/debug_log.h"

namespace softverbs::cm {

namespace {

// What an MRA asks for: the listener's application has not accepted yet.
constexpr uint8_t kMraServiceTimeout = 20;
constexpr auto kMraWait = std::chrono::nanoseconds(4096ull << kMraServiceTimeout);
// A REQ that finds no listener within this long after it was first sent
// is tried again (a server re-listening between two connections, as
// perftest does, is a moment away on a real fabric too).
constexpr auto kListenerGrace = std::chrono::milliseconds(50);
constexpr auto kListenerRetry = std::chrono::milliseconds(5);

}  // namespace

void set_state(CmId* id, IdState next) {
  const bool was_connected = id->state == IdState::Connected;
  id->state = next;
  const bool connected = next == IdState::Connected;
  if (was_connected == connected || id->agent == nullptr || is_ud(id)) return;
  if (connected) {
    CmConnectionTable::Entry entry;
    entry.agent_qpn = id->agent->qpn();
    entry.local_comm_id = id->local_comm_id;
    entry.remote_comm_id = id->remote_comm_id;
    entry.remote_qpn = remote_qpn_of(id);
    entry.transaction_id = id->transaction_id;
    entry.local_gid = id->local_gid;
    entry.peer_gid = id->peer_gid;
    entry.traffic_class = id->tos;
    id->agent->record_connection(entry);
  } else {
    id->agent->forget_connection(id->local_comm_id);
  }
}

void announce_orphaned_connections(CmAgent* agent) {
  for (const CmConnectionTable::Entry& orphan : agent->due_orphan_dreqs()) {
    debug_log("rdma_cm: a DREQ for communication ID %#x, whose process died (%u more if unanswered)",
              orphan.local_comm_id, orphan.dreqs_left);
    agent->send(orphan.local_gid, orphan.peer_gid, orphan.traffic_class, orphan_dreq(orphan));
  }
}

// One the peer must answer (REQ, REP, DREQ, SIDR_REQ) is resent until it
// does; an answer is kept to be sent again should the peer resend what it
// answers.
bool send_to_peer(CmId* id, const Message& message) {
  if (id->agent == nullptr) return false;
  const MadBytes bytes = mad_for(id, message);
  const bool expects_answer = message.type == MessageType::Req || message.type == MessageType::Rep ||
                              message.type == MessageType::Dreq || message.type == MessageType::SidrReq;
  if (expects_answer) {
    id->awaiting_answer = Resending{bytes, Clock::now() + kCmResendAfter, kMaxCmRetries};
  } else {
    id->last_answer = bytes;
  }
  const bool sent = id->agent->send(id->local_gid, id->peer_gid, id->tos, bytes);
  if (!sent) debug_log("rdma_cm: a CM MAD to QP1 could not be posted");
  if (expects_answer) Engine::instance().schedule_resends();
  return sent;
}

namespace {

void fill_conn_event(QueuedEvent& event, uint8_t responder_resources, uint8_t initiator_depth, uint8_t flow_control,
                     uint8_t retry_count, uint8_t rnr_retry_count, uint8_t srq, uint32_t qp_num) {
  rdma_conn_param& conn = event.event.param.conn;
  conn.responder_resources = responder_resources;
  conn.initiator_depth = initiator_depth;
  conn.flow_control = flow_control;
  conn.retry_count = retry_count;
  conn.rnr_retry_count = rnr_retry_count;
  conn.srq = srq;
  conn.qp_num = qp_num;
}

// The CONNECT_REQUEST's event for a REQ; the id takes what the peer asks.
std::unique_ptr<QueuedEvent> take_request(CmId* id, const ConnectRequest& req) {
  id->request = req;
  id->remote_ece = {req.ece_vendor_id, req.ece_options, 0};
  // The peer's view, mirrored: what it can initiate is what we respond to.
  id->responder_resources = req.initiator_depth;
  id->initiator_depth = req.responder_resources;
  id->retry_count = req.retry_count;
  id->rnr_retry_count = req.rnr_retry_count;
  clamp_depths(id);
  auto event = event_with_private_data(req.private_data, kReqPrivateData, false);
  fill_conn_event(*event, req.initiator_depth, req.responder_resources, req.flow_control, req.retry_count,
                  req.rnr_retry_count, req.srq, req.qp_num);
  return event;
}

// A new id for a REQ or SIDR_REQ on `listener`, and its CONNECT_REQUEST.
void on_request(Engine& engine, CmId* listener, CmAgent* agent, const ReceivedMad& received, uint32_t peer_id,
                uint64_t transaction_id, const Message& message) {
  bool ud = message.type == MessageType::SidrReq;
  // An XRC initiator's REQ makes an XRC target, as the kernel's CM types the
  // new id by the REQ; the rest take the listener's type.
  const ibv_qp_type type = !ud && message.req.qp_type == IBV_QPT_XRC_SEND ? IBV_QPT_XRC_RECV : listener->id.qp_type;
  CmId* id = new_id(listener->own_channel ? nullptr : listener->channel, listener->id.context, listener->id.ps, type);
  if (id == nullptr) return;
  id->listener = listener;
  id->agent = agent;
  id->local_comm_id = agent->next_local_id();
  id->remote_comm_id = peer_id;
  id->transaction_id = transaction_id;
  id->local_gid = received.destination;
  id->peer_gid = received.source;
  set_state(id, IdState::RequestReceived);
  id->local_psn = engine.random_psn();
  const WireAddress& source = ud ? message.sidr_req.source : message.req.source;
  const WireAddress& destination = ud ? message.sidr_req.destination : message.req.destination;
  id->id.route.addr.src_storage = from_wire(destination);
  id->id.route.addr.dst_storage = from_wire(source);
  id->id.route.addr.addr.ibaddr.sgid = gid_of(id->id.route.addr.src_storage);
  id->id.route.addr.addr.ibaddr.dgid = gid_of(id->id.route.addr.dst_storage);
  id->id.verbs = agent->context();
  id->id.pd = engine.devices.pd_for(agent->context());
  id->id.port_num = 1;
  std::unique_ptr<QueuedEvent> event =
      ud ? event_with_private_data(message.sidr_req.private_data, kSidrReqPrivateData, true)
         : take_request(id, message.req);
  event->event.listen_id = &listener->id;
  // On the listener's channel: rdma_get_request waits there for a synchronous one.
  deliver(id, RDMA_CM_EVENT_CONNECT_REQUEST, 0, std::move(event), listener->channel);
}

void on_rep(CmId* id, const ConnectReply& rep) {
  if (id->state != IdState::RequestSent) return;
  id->reply = rep;
  id->remote_ece = {rep.ece_vendor_id, rep.ece_options, 0};
  id->initiator_depth = std::min(id->initiator_depth, rep.responder_resources);
  auto event = event_with_private_data(rep.private_data, kRepPrivateData, false);
  fill_conn_event(*event, rep.initiator_depth, rep.responder_resources, rep.flow_control, 0, rep.rnr_retry_count,
                  rep.srq, rep.qp_num);
  if (id->id.qp == nullptr) {
    // The application moves its own QP, then calls rdma_establish.
    set_state(id, IdState::ResponseReceived);
    deliver(id, RDMA_CM_EVENT_CONNECT_RESPONSE, 0, std::move(event));
    return;
  }
  if (modify(id, IBV_QPS_RTR) != 0 || modify(id, IBV_QPS_RTS) != 0) {
    Message rej;
    rej.type = MessageType::Rej;
    rej.rej.reason = mad::reject::kNoQp;
    send_to_peer(id, rej);
    stop_resending(id);
    move_qp_to_error(id);
    set_state(id, IdState::Disconnected);
    deliver(id, RDMA_CM_EVENT_CONNECT_ERROR, -EINVAL);
    return;
  }
  Message rtu;
  rtu.type = MessageType::Rtu;
  send_to_peer(id, rtu);
  set_state(id, IdState::Connected);
  deliver(id, RDMA_CM_EVENT_ESTABLISHED, 0, std::move(event));
}

void on_sidr_rep(CmId* id, const SidrReply& rep) {
  if (id->state != IdState::RequestSent) return;
  stop_resending(id);
  if (rep.status != 0) {
    // As librdmacm reports a SIDR_REP that refuses: UNREACHABLE with its
    // status (1: nobody listens, 2: rejected).
    set_state(id, IdState::Disconnected);
    deliver(id, RDMA_CM_EVENT_UNREACHABLE, static_cast<int>(rep.status),
            event_with_private_data(rep.private_data, kSidrRepPrivateData, true));
    return;
  }
  auto event = event_with_private_data(rep.private_data, kSidrRepPrivateData, true);
  event->event.param.ud.ah_attr = path_to_peer(id);
  event->event.param.ud.qp_num = rep.qp_num;
  event->event.param.ud.qkey = rep.qkey;
  set_state(id, IdState::Connected);
  deliver(id, RDMA_CM_EVENT_ESTABLISHED, 0, std::move(event));
}

// A message on an id's connection, in the id's state.
void on_message(CmId* id, const Message& message) {
  switch (message.type) {
    case MessageType::Rep:
      on_rep(id, message.rep);
      return;
    case MessageType::Rtu:
      if (id->state != IdState::ReplySent) return;
      set_state(id, IdState::Connected);
      deliver(id, RDMA_CM_EVENT_ESTABLISHED, 0);
      return;
    case MessageType::Rej: {
      if (id->state != IdState::RequestSent && id->state != IdState::ReplySent) return;
      auto event = event_with_private_data(message.rej.private_data, kRejPrivateData, false);
      stop_resending(id);
      move_qp_to_error(id);
      set_state(id, IdState::Disconnected);
      deliver(id, RDMA_CM_EVENT_REJECTED, message.rej.reason, std::move(event));
      return;
    }
    case MessageType::SidrRep:
      on_sidr_rep(id, message.sidr_rep);
      return;
    case MessageType::Dreq: {
      Message drep;
      drep.type = MessageType::Drep;
      send_to_peer(id, drep);
      ended_by_peer(id);
      return;
    }
    case MessageType::Drep:
      stop_resending(id);
      return;
    case MessageType::Req:
    case MessageType::SidrReq:
      return;  // only on a listener's fresh connection
  }
}

// Answers a MAD for which no id exists, as the kernel's CM does, but a
// REP: one for an id destroyed after its REQ went out is left to time out
// (docs/rdmacm.md).
void answer_without_id(CmAgent* agent, const ReceivedMad& received, const mad::Mad& in) {
  if (in.attribute == mad::Attribute::Rep) return;
  if (const auto answer = unclaimed_answer(in)) agent->send(received.destination, received.source, 0, *answer);
}

CmId* id_by_local(Engine& engine, const CmAgent* agent, uint32_t local_comm_id) {
  for (CmId* id : engine.ids)
    if (id->agent == agent && id->local_comm_id == local_comm_id && id->state != IdState::Listening) return id;
  return nullptr;
}

// A REQ or SIDR_REQ the peer resent, if it is one: the application has not
// accepted yet (an MRA says to wait), or our REP was lost (sent again).
bool answered_resent_request(Engine& engine, CmAgent* agent, const ReceivedMad& received, const mad::Mad& in,
                             uint32_t peer_id) {
  const bool ud = in.attribute == mad::Attribute::SidrReq;
  for (CmId* id : engine.ids) {
    if (id->agent != agent || id->remote_comm_id != peer_id || id->peer_gid != received.source ||
        id->listener == nullptr)
      continue;
    if (id->state == IdState::RequestReceived && !ud) {
      mad::Mad mra;
      mra.attribute = mad::Attribute::Mra;
      mra.transaction_id = in.transaction_id;
      mra.mra.local_comm_id = id->local_comm_id;
      mra.mra.remote_comm_id = peer_id;
      mra.mra.message = mad::MessageRejected::Req;
      mra.mra.service_timeout = kMraServiceTimeout;
      agent->send(id->local_gid, id->peer_gid, id->tos, mad::build_cm_mad(mra));
    } else if (id->awaiting_answer) {
      agent->send(id->local_gid, id->peer_gid, id->tos, id->awaiting_answer->mad);
    } else if (id->last_answer) {
      agent->send(id->local_gid, id->peer_gid, id->tos, *id->last_answer);
    }
    return true;
  }
  return false;
}

// The listener registered on `agent` for `service_id` at `wanted`: one
// bound to that address, else a wildcard one that takes its IP version.
CmId* listener_for(Engine& engine, CmAgent* agent, uint64_t service_id, const sockaddr_storage& wanted) {
  const auto wanted_gid = gid_bytes(wanted);
  const uint8_t wanted_version = wanted.ss_family == AF_INET6 ? 6 : 4;
  CmId* listener = nullptr;
  for (CmId* id : engine.ids) {
    if (id->state != IdState::Listening || port_space_of(id) != (service_id >> 16 & 0xffff) ||
        port_of(id->id.route.addr.src_storage) != (service_id & 0xffff))
      continue;
    const auto registration = std::find_if(id->listening.begin(), id->listening.end(),
                                           [&](const auto& entry) { return entry.first == agent; });
    if (registration == id->listening.end()) continue;
    if (gid_bytes(id->id.route.addr.src_storage) == wanted_gid) return id;
    const uint8_t takes = registration->second.ip_version;
    if (is_wildcard(id->id.route.addr.src_storage) && (takes == 0 || takes == wanted_version)) listener = id;
  }
  return listener;
}

// A REQ or SIDR_REQ: a new id for the listener it names, or the answer to
// one resent.
void on_incoming_request(Engine& engine, CmAgent* agent, const ReceivedMad& received, const mad::Mad& in) {
  const bool ud = in.attribute == mad::Attribute::SidrReq;
  const uint32_t peer_id = ud ? in.sidr_req.request_id : in.req.local_comm_id;
  if (answered_resent_request(engine, agent, received, in, peer_id)) return;
  const uint64_t service_id = ud ? in.sidr_req.service_id : in.req.service_id;
  const Message message = message_of(in);
  const WireAddress& destination = ud ? message.sidr_req.destination : message.req.destination;
  CmId* listener = listener_for(engine, agent, service_id, from_wire(destination));
  if (listener == nullptr) {
    answer_without_id(agent, received, in);
    return;
  }
  on_request(engine, listener, agent, received, peer_id, in.transaction_id, message);
}

// What a MAD for `id` does to the MAD the id resends; false where the MAD
// goes no further (it asks to wait, or repeats what was handled).
bool settle_resending(CmId* id, CmAgent* agent, const mad::Mad& in) {
  const Clock::time_point now = Clock::now();
  switch (in.attribute) {
    case mad::Attribute::Mra:
      // The peer's application has yet to accept: wait as long as it asks.
      if (id->awaiting_answer) {
        id->awaiting_answer->at = now + kMraWait + kCmResendAfter;
        id->awaiting_answer->left = kMaxCmRetries;
      }
      return false;
    case mad::Attribute::Rep:
      if (id->state != IdState::RequestSent) {
        // Our RTU was lost and the REP comes again.
        if (id->last_answer && id->remote_comm_id == in.rep.local_comm_id)
          agent->send(id->local_gid, id->peer_gid, id->tos, *id->last_answer);
        return false;
      }
      id->remote_comm_id = in.rep.local_comm_id;
      stop_resending(id);
      return true;
    case mad::Attribute::Rej:
      if (id->state == IdState::RequestSent && in.rej.reason == mad::reject::kInvalidServiceId &&
          now - id->request_sent_at < kListenerGrace) {
        // No listener yet: one may be a moment away (see kListenerGrace).
        if (id->awaiting_answer) {
          id->awaiting_answer->at = now + kListenerRetry;
          ++id->awaiting_answer->left;
        }
        return false;
      }
      stop_resending(id);
      return true;
    case mad::Attribute::Rtu:
    case mad::Attribute::Drep:
    case mad::Attribute::SidrRep:
      stop_resending(id);
      return true;
    default:
      return true;
  }
}

}  // namespace

void on_mad(Engine& engine, CmAgent* agent, const ReceivedMad& received) {
  const auto parsed = mad::parse_cm_mad(received.bytes);
  if (!parsed) return;
  const mad::Mad& in = *parsed;
  if (in.attribute == mad::Attribute::Req || in.attribute == mad::Attribute::SidrReq) {
    on_incoming_request(engine, agent, received, in);
    return;
  }
  const auto route = mad::cm_route(received.bytes);
  if (in.attribute == mad::Attribute::Drep && route) {
    std::erase_if(engine.lingering, [&](const Engine::Lingering& entry) {
      return entry.agent == agent && entry.local_comm_id == route->receiver_id;
    });
  }
  CmId* id = route ? id_by_local(engine, agent, route->receiver_id) : nullptr;
  if (id == nullptr || id->peer_gid != received.source) {
    if (id == nullptr) answer_without_id(agent, received, in);
    return;
  }
  if (settle_resending(id, agent, in)) on_message(id, message_of(in));
}

void ended_by_peer(CmId* id) {
  stop_resending(id);
  // The application moves the QP (rdma_disconnect) or destroys it, maybe
  // with ibv_destroy_qp behind the shim's back, so the runtime's handler
  // must not touch it.
  if (id->state == IdState::Connected || id->state == IdState::ReplySent) {
    set_state(id, IdState::Disconnected);
    deliver(id, RDMA_CM_EVENT_DISCONNECTED, 0);
    if (!id->own_channel) enter_timewait(id);
  }
}

void enter_timewait(CmId* id) {
  if (is_ud(id)) return;
  id->timewait_ends = Clock::now() + kTimewait;
  Engine::instance().schedule_resends();
}

void on_no_answer(CmId* id) {
  id->awaiting_answer.reset();
  switch (id->state) {
    case IdState::RequestSent:
    case IdState::ReplySent:
      // As the kernel's rdma_cm reports a REQ or REP that timed out.
      set_state(id, IdState::Disconnected);
      deliver(id, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT);
      break;
    default:
      break;  // a DREQ: the disconnect was reported already
  }
}

}  // namespace softverbs::cm
