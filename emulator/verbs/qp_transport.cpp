// How a QP's sends reach their peer: the transport chosen at RTR, and each
// post's way onto shared memory or into the UDP requester.
#include <cstdio>
#include <cstring>
#include <string>

#include "device/device_limits.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "device/shared_mutex.h"
#include "support/debug_log.h"
#include "verbs/device_context.h"
#include "verbs/device_qp.h"
#include "wire/roce_headers.h"

namespace softverbs {

// Whether the QP takes the UDP transport, decided when it moves to RTR:
// 0 and `over_udp`, or an errno that the Modify QP fails with.
int DeviceQp::choose_transport(const QpAttributes& next, bool& over_udp) const {
  over_udp = false;
  const TransportChoice choice = context_.config.transport;
  if (choice == TransportChoice::SharedMemory) return 0;
  if (record().type == QpType::Ud) {
    if (!context_.ud_over_udp()) return 0;
    if (context_.udp_transport() == nullptr) return choice == TransportChoice::Udp ? EADDRNOTAVAIL : 0;
    over_udp = true;
    return 0;
  }
  Gid dgid;
  std::memcpy(dgid.raw.data(), next.dgid, 16);
  if (choice == TransportChoice::Auto) {
    // Same host (a GID of this very device, or a loopback netdev) means
    // shared memory; anything else is another host, reached over UDP.
    if (context_.netdev_is_loopback || !next.is_global) return 0;
    for (const GidEntry& entry : context_.gids)
      if (entry.gid == dgid) return 0;
  }
  if (!next.is_global) {
    std::fprintf(stderr,
                 "softverbs: QP %#x: the UDP transport needs a GRH (ah_attr.is_global = 1 and the peer's GID, "
                 "e.g. ibv_rc_pingpong -g <gid index>)\n",
                 qpn_);
    return EINVAL;
  }
  UdpTransport* udp = context_.udp_transport();
  if (udp == nullptr) return EADDRNOTAVAIL;
  std::string error;
  if (!udp->usable_source_gid(next.sgid_index, &error) ||
      !udp->resolve_path(next.sgid_index, dgid, next.traffic_class, next.hop_limit, next.flow_label, &error)) {
    std::fprintf(stderr, "softverbs: QP %#x: %s\n", qpn_, error.c_str());
    return EINVAL;
  }
  over_udp = true;
  return 0;
}

int DeviceQp::change_state(QpState current, QpState target, const QpAttributes& next) {
  if (current == QpState::Init && target == QpState::Rtr) {
    bool over_udp = false;
    if (int error = choose_transport(next, over_udp)) return error;
    over_udp_ = over_udp;
  }
  QpRecord& qp = record();
  {
    SharedLock lock(qp.lock);
    qp.attributes = next;
    if (target != QpState::Error) set_state(qp, target);
    if (target == QpState::Reset) {
      discard_receive_queue(memory_, qp);  // after the state: see post_receive
      qp.attributes = QpAttributes{};
      qp.attributes.path_mtu = context_.active_mtu;
    }
  }
  if (target == QpState::Error) enter_error_state();
  int error = 0;
  if (over_udp_) {
    error = context_.udp_transport()->sync_qp(index_);
    if (target == QpState::Reset) over_udp_ = false;
  }
  if (target == QpState::Reset) {
    // After the UDP engine has forgotten the QP: until then its background
    // thread may still complete a request whose ACK just arrived, and a
    // completion purged before that would have come back.
    drop_waiting_sends();
    purge_own_completions();
  }
  return error;
}

// RC and UC QPs on UDP send everything there; a UD QP sends to GIDs that
// are not this device's (or to all, with --transport udp).
bool DeviceQp::goes_over_udp(const SendWqe& request) const {
  if (record().type != QpType::Ud) return true;
  if (!request.has_grh) return false;
  Gid dgid{request.destination_gid};
  // A group address goes out as IP multicast, and every member on this host
  // as elsewhere gets its copy from the kernel; a group GID of another
  // family than the source (ff0e::ffff:a.b.c.d, RoCE v1's form of an IPv4
  // group, from an IPv4 GID) has no IP form here and reaches local members.
  if (dgid.is_multicast())
    return wire::is_ipv4_mapped(request.destination_gid) == wire::is_ipv4_mapped(request.source_gid);
  if (context_.config.transport == TransportChoice::Udp) return true;
  for (const GidEntry& entry : context_.gids)
    if (entry.gid == dgid) return false;
  return true;
}

// Readies a WQE for the UDP requester, which keeps it past the post: an
// inline send's bytes are copied, and errors an HCA finds while executing
// (lengths, an unroutable address) ride along and complete in order.
void DeviceQp::prepare_for_udp(SendWqe& wqe) {
  if (wqe.flags & send_flag::kInline) {
    wqe.keep_inline();
    wqe.sges.clear();  // the requester sends inline_bytes
  }
  if (wqe.length > limits::kMaxMessageSize) wqe.error = WcStatus::LocalLengthError;
  if (send_opcode_info(wqe.opcode).is(wr_mask::kAtomic) && wqe.length != 8) wqe.error = WcStatus::LocalLengthError;
  const QpRecord& qp = record();
  if (qp.type != QpType::Ud) return;
  std::string error;
  auto path = context_.udp_transport()->resolve_path(wqe.sgid_index, Gid{wqe.destination_gid}, wqe.traffic_class,
                                                     wqe.hop_limit, wqe.flow_label, &error);
  if (path) {
    wqe.ud_path = *path;
  } else {
    debug_log("UD QP %#x wr_id %#llx: %s", qpn_, static_cast<unsigned long long>(wqe.wr_id), error.c_str());
    wqe.error = WcStatus::LocalQpOperationError;
  }
  uint32_t mtu = qp.attributes.path_mtu != 0 ? mtu_bytes(static_cast<Mtu>(qp.attributes.path_mtu)) : 4096;
  if (wqe.length > mtu) wqe.error = WcStatus::LocalLengthError;
}

}  // namespace softverbs
