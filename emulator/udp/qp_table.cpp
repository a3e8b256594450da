// The QPs this process carries over UDP: attached, updated after each
// Modify QP, moved to ERR, forgotten; and the multicast groups its UD QPs
// are in.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>

#include "device/shared_mutex.h"
#include "udp/engine.h"

namespace softverbs::udp {

using namespace wire;
using namespace parameters;

// ---- QPs ---------------------------------------------------------------------------------

int PortEngine::sync_qp(int qp_index) {
  QpRecord& record = memory_->shared().qps[qp_index];
  QpSnapshot snapshot;
  {
    SharedLock lock(record.lock);
    if (!record.live) return EINVAL;
    snapshot = {record.state,   record.type,    record.attributes,     record.qpn, record.pd_handle,
                record.send_cq, record.recv_cq, record.gsi_agent != 0, record.xrc};
  }
  std::lock_guard guard(mutex_);
  flush_sends();  // what a post left waiting goes before the QP changes
  if (snapshot.state == QpState::Reset || snapshot.state == QpState::Init) {
    forget_locked(snapshot.qpn);
    return 0;
  }
  UdpQp* qp = find(snapshot.qpn);
  if (snapshot.state == QpState::Error) {
    // An HCA acknowledged what the QP received long before the application
    // could move it to ERR: a held ACK leaves first.
    send_held_ack_locked(snapshot.qpn);
    if (qp != nullptr && (qp->connected || qp->sending)) enter_error(*this, *qp);
    return 0;
  }
  if (qp == nullptr) qp = attach_locked(qp_index, snapshot);
  if (qp == nullptr) return EINVAL;
  update_locked(*qp, snapshot);
  return 0;
}

UdpQp* PortEngine::attach_locked(int qp_index, const QpSnapshot& record) {
  const QpAttributes& attributes = record.attributes;
  UdpQp fresh;
  fresh.index = qp_index;
  fresh.qpn = record.qpn;
  fresh.type = record.type;
  fresh.cm_agent = record.cm_agent;
  fresh.xrc = record.xrc;
  fresh.faults = FaultGenerator(fault_settings_for(fresh).seed, record.qpn);
  if (record.type != QpType::Ud) {
    Gid dgid;
    std::memcpy(dgid.raw.data(), attributes.dgid, 16);
    std::string error;
    auto path = attributes.is_global ? resolve_path(attributes.sgid_index, dgid, attributes.traffic_class,
                                                    attributes.hop_limit, attributes.flow_label, &error)
                                     : std::nullopt;
    if (!path) {
      if (!attributes.is_global) error = "RoCE needs a GRH (ah_attr.is_global = 1 and a destination GID)";
      std::fprintf(stderr, "softverbs: QP %#x cannot use the UDP transport: %s\n", record.qpn, error.c_str());
      return nullptr;
    }
    fresh.path = *path;
    fresh.dest_qpn = attributes.dest_qpn;
    fresh.responder.expected_psn = attributes.rq_psn & kPsnMask;
  }
  UdpQp* qp = &qps_.emplace(record.qpn, std::move(fresh)).first->second;
  qp->connected = true;
  if (record.type != QpType::Ud) connect_flow_locked(*qp);
  QpRecord& shared = memory_->shared().qps[qp_index];
  SharedLock lock(shared.lock);
  if (shared.live && shared.qpn == record.qpn) shared.forward_port = forward_port_;
  return qp;
}

void PortEngine::update_locked(UdpQp& qp, const QpSnapshot& record) {
  // An XRC_RECV QP has no PD: each request's XRC SRQ lends its own (see
  // the responder's check_xrc_srq).
  if (record.xrc != XrcRole::Recv) qp.pd_handle = record.pd_handle;
  qp.send_cq = record.send_cq;
  qp.recv_cq = record.recv_cq;
  // Never above what the netdev carries (packets leave with DF set).
  const QpAttributes& attributes = record.attributes;
  const uint32_t port_mtu = mtu_bytes(port_attributes(config_).active_mtu);
  qp.mtu = std::min(attributes.path_mtu != 0 ? mtu_bytes(static_cast<Mtu>(attributes.path_mtu)) : 1024, port_mtu);
  if (auto flow = qp_watchers_.find(qp.qpn); flow != qp_watchers_.end())
    watchers_.at(flow->second)->receiver.path_mtu = qp.mtu;
  qp.attributes = attributes;
  if ((record.state == QpState::Rts || record.state == QpState::Sqd) && !qp.sending) {
    qp.sending = true;
    RequesterState& r = qp.requester;
    r.next_psn = attributes.sq_psn & kPsnMask;
    r.acked_psn = psn_add(r.next_psn, kPsnMask);
    r.retries_left = qp.attributes.retry_count;
    r.rnr_retries_left = qp.attributes.rnr_retry == 7 ? -1 : qp.attributes.rnr_retry;
  }
  qp.draining = record.state == QpState::Sqd;
  if (qp.sending) requester_run(*this, qp);
  note_timer_locked(qp);
  after_work();
}

void PortEngine::forget_qp(uint32_t qpn) {
  std::lock_guard guard(mutex_);
  // An HCA acknowledged what the QP received long before it was destroyed:
  // a held ACK leaves first, or its sender would time out and retry.
  send_held_ack_locked(qpn);
  flush_sends();
  forget_locked(qpn);
}

void PortEngine::forget_locked(uint32_t qpn) {
  // What this QP received was acknowledged by the time it went (by an HCA,
  // long before): a held ACK leaves now.
  send_held_ack_locked(qpn);
  held_acks_.forget_pacing(qpn);
  if (UdpQp* qp = find(qpn); qp != nullptr && qp->timer_listed) std::erase(timed_qps_, qp);
  qps_.erase(qpn);
  fault_delays_.release_qp(qpn, std::bind_front(&PortEngine::send_bytes, this));
  flush_sends();
  std::erase(touched_, qpn);
  std::erase(awaiting_receive_qps_, qpn);
  note_awaiting_count_locked();
  if (auto it = qp_watchers_.find(qpn); it != qp_watchers_.end()) {
    retire_watcher_locked(it->second);
    qp_watchers_.erase(it);
  }
}

// ---- multicast groups ----------------------------------------------------------------------

int PortEngine::join_group(const Gid& group, uint32_t qpn) {
  if (!group.is_multicast()) return EINVAL;
  std::lock_guard guard(mutex_);
  auto it = groups_.find(group.raw);
  if (it == groups_.end()) {
    Fd fd;
    if (int error = open_group_socket(group, fd); error != 0) return error;
    it = groups_.emplace(group.raw, GroupMembers{add_watcher_locked(std::move(fd), group.raw, false), {}}).first;
  }
  if (std::find(it->second.qpns.begin(), it->second.qpns.end(), qpn) == it->second.qpns.end())
    it->second.qpns.push_back(qpn);
  return 0;
}

int PortEngine::open_group_socket(const Gid& group, Fd& fd) {
  const bool v4 = is_ipv4_mapped(group.raw);
  fd = Fd(bind_udp(group.raw, kRoceV2Port, ifindex_));
  if (fd.get() < 0) return errno;
  int joined;
  if (v4) {
    ip_mreqn request{};
    std::memcpy(&request.imr_multiaddr, group.raw.data() + 12, 4);
    request.imr_ifindex = static_cast<int>(ifindex_);
    joined = setsockopt(fd.get(), IPPROTO_IP, IP_ADD_MEMBERSHIP, &request, sizeof request);
  } else {
    ipv6_mreq request{};
    std::memcpy(&request.ipv6mr_multiaddr, group.raw.data(), 16);
    request.ipv6mr_interface = ifindex_;
    joined = setsockopt(fd.get(), IPPROTO_IPV6, IPV6_ADD_MEMBERSHIP, &request, sizeof request);
  }
  if (joined != 0) {
    const int saved = errno;
    std::fprintf(stderr, "softverbs: cannot join multicast group %s on %s: %s\n", format_address(group.raw).c_str(),
                 config_.netdev.c_str(), std::strerror(saved));
    return saved;
  }
  return 0;
}

void PortEngine::leave_group(const Gid& group, uint32_t qpn) {
  std::lock_guard guard(mutex_);
  if (auto it = groups_.find(group.raw); it != groups_.end()) leave_group_locked(it, qpn);
}

void PortEngine::leave_groups(uint32_t qpn) {
  std::lock_guard guard(mutex_);
  for (auto it = groups_.begin(); it != groups_.end();) leave_group_locked(it++, qpn);
}

void PortEngine::leave_group_locked(std::map<IpAddress, GroupMembers>::iterator group, uint32_t qpn) {
  std::erase(group->second.qpns, qpn);
  if (!group->second.qpns.empty()) return;
  retire_watcher_locked(group->second.watcher);  // closing the socket leaves the group
  groups_.erase(group);
}

// A packet to QPN 0xffffff: a copy for each of this process's QPs attached
// to the group it was sent to, as an HCA replicates it to every QP attached.
void PortEngine::deliver_to_group_locked(const FlowAddress& flow, const TransportPacket& packet) {
  auto group = groups_.find(flow.destination);
  if (group == groups_.end() || (packet.bth.opcode & 0xe0) != static_cast<uint8_t>(Service::Ud)) {
    counters().add(Counter::UnknownQp);
    return;
  }
  for (uint32_t qpn : group->second.qpns)
    if (UdpQp* qp = find(qpn); qp != nullptr && qp->type == QpType::Ud) ud_receive(*this, *qp, packet, flow);
}

}  // namespace softverbs::udp
