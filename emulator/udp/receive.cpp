// The receive path: reads a socket (a UDP GRO batch split into its
// packets), checks each packet's ICRC, and hands it to its QP's role, to the
// CM agents (QP1), to the QPs of a multicast group, or to the process of the
// device that owns its QP (over the loopback forwarding socket).
#include <arpa/inet.h>

#include <cerrno>
#include <cstring>

#include "device/cm_routing.h"
#include "support/debug_log.h"
#include "support/process_id.h"
#include "udp/coalesced_read.h"
#include "udp/engine.h"
#include "udp/gso.h"
#include "udp/internal.h"
#include "wire/icrc.h"

namespace softverbs::udp {

using namespace wire;
using namespace parameters;

// ---- reading -----------------------------------------------------------------------------

bool PortEngine::read_connected(Watcher& watcher) {
  std::span<uint8_t> buffer(buffers_[0]);
  const ssize_t length = ::recv(watcher.fd.get(), buffer.data(), buffer.size(), MSG_DONTWAIT | MSG_TRUNC);
  if (length < 0) return false;
  if (static_cast<size_t>(length) > buffer.size()) {
    counters().add(Counter::MalformedPackets);
    return true;
  }
  const std::span<const uint8_t> bytes = buffer.first(static_cast<size_t>(length));
  const FlowAddress flow = arriving_flow(watcher);
  const FirstPacket first = find_first_packet(flow, bytes, watcher.receiver, icrc_headers_);
  // A flow whose reads need searching (a stream of SENDs, an unusual mix
  // of lengths) pays the recvmsg rather than the search for a while.
  if (first.searched) watcher.reads_with_gro_size = kReadsWithGroSizeAfterSearch;
  const uint64_t packets = handle_read(flow, bytes, first.bytes, first.icrc_checked);
  if (packets != 0) {
    counters().add(Counter::RxPackets, packets);
    counters().add(Counter::RxBytes, bytes.size());
  }
  return true;
}

FlowAddress PortEngine::arriving_flow(const Watcher& watcher) {
  FlowAddress flow;
  if (watcher.connected) {
    flow.source = watcher.peer;
    flow.source_port = watcher.peer_port;
  }
  flow.destination = watcher.local;
  flow.destination_port = kRoceV2Port;
  return flow;
}

uint64_t PortEngine::handle_read(const FlowAddress& flow, std::span<const uint8_t> read, size_t packet_bytes,
                                 bool first_checked) {
  uint64_t packets = 0;
  for (size_t at = 0; at < read.size(); at += packet_bytes, ++packets)
    handle_datagram(flow, read.subspan(at, std::min(packet_bytes, read.size() - at)), false, at == 0 && first_checked);
  return packets;
}

bool PortEngine::drain(Watcher& watcher, Reads reads) {
  // A connected socket's reads name their source until it was read empty once.
  const bool ask_source = !watcher.forward && (!watcher.connected || watcher.sources_unknown);
  if (reads == Reads::One && watcher.connected && !watcher.sources_unknown) {
    if (watcher.reads_with_gro_size == 0) return read_connected(watcher);
    --watcher.reads_with_gro_size;
  }
  const int fd = watcher.fd.get();
  const size_t batch = reads == Reads::One ? 1 : kReceiveBatch;
  bool any = false;
  for (;;) {
    mmsghdr messages[kReceiveBatch];
    iovec vectors[kReceiveBatch];
    sockaddr_storage sources[kReceiveBatch];
    UdpGroControl controls[kReceiveBatch];
    for (size_t i = 0; i < batch; ++i) {
      vectors[i] = {buffers_[i].data(), buffers_[i].size()};
      messages[i] = {};
      messages[i].msg_hdr.msg_iov = &vectors[i];
      messages[i].msg_hdr.msg_iovlen = 1;
      messages[i].msg_hdr.msg_control = controls[i].bytes;
      messages[i].msg_hdr.msg_controllen = sizeof controls[i].bytes;
      if (ask_source) {
        messages[i].msg_hdr.msg_name = &sources[i];
        messages[i].msg_hdr.msg_namelen = sizeof sources[i];
      }
    }
    int count;
    if (batch == 1) {
      // recvmsg costs ~20 ns less than a recvmmsg of one, and a polling
      // application makes many reads that find nothing.
      const ssize_t length = ::recvmsg(fd, &messages[0].msg_hdr, MSG_DONTWAIT);
      count = length < 0 ? -1 : 1;
      if (length >= 0) messages[0].msg_len = static_cast<unsigned>(length);
    } else {
      count = ::recvmmsg(fd, messages, static_cast<unsigned>(batch), MSG_DONTWAIT, nullptr);
    }
    if (count <= 0) {
      if (count < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) watcher.sources_unknown = false;
      return any;
    }
    any = true;
    uint64_t received_packets = 0, received_bytes = 0;
    for (int i = 0; i < count; ++i) {
      std::span<const uint8_t> bytes(buffers_[i].data(), messages[i].msg_len);
      if (messages[i].msg_hdr.msg_flags & MSG_TRUNC) {
        counters().add(Counter::MalformedPackets);
        continue;
      }
      if (watcher.forward) {
        take_forwarded(bytes);
        continue;
      }
      const size_t segment = udp_gro_segment(messages[i].msg_hdr, bytes.size());
      FlowAddress flow = arriving_flow(watcher);
      if (ask_source && !from_sockaddr(sources[i], flow.source, flow.source_port)) continue;
      received_packets += handle_read(flow, bytes, segment, false);
      received_bytes += bytes.size();
    }
    // Counted once per read, not per packet: the counters live in one cache
    // line of device memory that the sending process writes too, and a
    // locked add on a line the other core holds costs ~100 ns.
    if (received_packets != 0) {
      counters().add(Counter::RxPackets, received_packets);
      counters().add(Counter::RxBytes, received_bytes);
    }
    if (static_cast<size_t>(count) < batch) {
      watcher.sources_unknown = false;  // read empty
      return any;
    }
    if (reads == Reads::One) return any;
  }
}

void PortEngine::take_forwarded(std::span<const uint8_t> bytes) {
  ForwardHeader header;
  if (bytes.size() < sizeof header) return;
  std::memcpy(&header, bytes.data(), sizeof header);
  if (header.magic != kForwardMagic || header.secret != memory_->shared().forward_secret) {
    counters().add(Counter::MalformedPackets);
    return;
  }
  FlowAddress flow;
  std::memcpy(flow.source.data(), header.source, 16);
  std::memcpy(flow.destination.data(), header.destination, 16);
  flow.source_port = header.source_port;
  flow.destination_port = header.destination_port;
  handle_datagram(flow, bytes.subspan(sizeof header), true);
}

// ---- one packet --------------------------------------------------------------------------

void PortEngine::handle_datagram(const FlowAddress& flow, std::span<const uint8_t> datagram, bool forwarded,
                                 bool icrc_checked) {
  if (!forwarded) {
    // A packet from one of our own addresses was captured when it was sent.
    if (memory_->shared().capture.active.load(std::memory_order_relaxed) && !is_local_address(flow.source)) {
      capture(flow, datagram);
    }
  }
  if (datagram.size() < kBthBytes + kIcrcBytes) {
    counters().add(Counter::MalformedPackets);
    return;
  }
  if (!icrc_checked && !check_icrc(flow, datagram, icrc_headers_)) {
    counters().add(Counter::IcrcErrors);
    debug_log("packet from %s:%u dropped: bad ICRC", format_address(flow.source).c_str(), flow.source_port);
    return;
  }
  auto packet = parse(datagram.first(datagram.size() - kIcrcBytes));
  if (!packet) {
    counters().add(Counter::MalformedPackets);
    return;
  }
  uint32_t qpn = packet->bth.dest_qp;
  if (qpn == kMulticastQpn) {
    deliver_to_group_locked(flow, *packet);
    return;
  }
  if (qpn == kGsiQpn) {
    qpn = route_to_cm_agent(flow, *packet, forwarded);
    if (qpn == 0) return;
  }
  if (UdpQp* qp = owned_qp_locked(qpn, flow, datagram, forwarded)) dispatch_locked(*qp, flow, *packet, datagram);
}

inline UdpQp* PortEngine::owned_qp_locked(uint32_t qpn, const FlowAddress& flow, std::span<const uint8_t> datagram,
                                          bool forwarded) {
  const QpRecord* record = memory_->qp_by_number(qpn);
  if (record == nullptr) {
    counters().add(Counter::UnknownQp);
    return nullptr;
  }
  const pid_t owner = record->owner_pid;
  if (owner != current_pid()) {
    // Read unlocked: a port that changes under us only misdirects one packet.
    const uint16_t port = record->forward_port;
    if (forwarded || port == 0) {
      counters().add(Counter::UnknownQp);  // its owner does not use UDP
      return nullptr;
    }
    forward(port, flow, datagram);
    return nullptr;
  }
  UdpQp* qp = find(qpn);
  if (qp == nullptr) counters().add(Counter::UnknownQp);
  return qp;
}

inline void PortEngine::dispatch_locked(UdpQp& qp, const FlowAddress& flow, const TransportPacket& packet,
                                        std::span<const uint8_t> datagram) {
  const uint8_t service = packet.bth.opcode & 0xe0;
  if (qp.type == QpType::Ud) {
    if (service != static_cast<uint8_t>(Service::Ud)) {
      counters().add(Counter::MalformedPackets);
      return;
    }
    ud_receive(*this, qp, packet, flow);
    return;
  }
  // As rxe's check_addr: a connected QP takes packets only from its peer's
  // address to its own. RoCE authenticates nothing, but a local user who
  // guessed the QPN, PSN and rkey still cannot speak for a remote peer.
  if (flow.source != qp.path.remote || flow.destination != qp.path.local) {
    counters().add(Counter::WrongSourceDropped);
    debug_log("QP %#x: packet from %s dropped: its peer is %s", qp.qpn, format_address(flow.source).c_str(),
              format_address(qp.path.remote).c_str());
    return;
  }
  if (opcode_info(packet.bth.opcode).response()) {
    completer_receive(*this, qp, packet);
    note_timer_locked(qp);
    touched_.push_back(qp.qpn);
  } else {
    take_request_locked(qp, packet, datagram.first(datagram.size() - kIcrcBytes));
  }
}

uint32_t PortEngine::route_to_cm_agent(const FlowAddress& flow, const TransportPacket& packet, bool forwarded) {
  if (packet.bth.opcode != opcode(Service::Ud, op::kSendOnly) || packet.deth.qkey != wire::cm::kGsiQkey) {
    counters().add(Counter::UnknownQp);
    return 0;
  }
  const CmDelivery delivery = route_cm_mad(*memory_, packet.payload);
  // A forwarded packet was answered where it arrived.
  if (delivery.answer && !forwarded) send_cm_answer(flow, *delivery.answer);
  if (delivery.agent_qpn == 0 && !delivery.answer) counters().add(Counter::UnknownQp);
  return delivery.agent_qpn;
}

// ---- passing a packet on to its QP's process ---------------------------------------------

void PortEngine::forward(uint16_t port, const FlowAddress& flow, std::span<const uint8_t> datagram) {
  ForwardHeader header;
  header.secret = memory_->shared().forward_secret;
  header.source_port = flow.source_port;
  header.destination_port = flow.destination_port;
  std::memcpy(header.source, flow.source.data(), 16);
  std::memcpy(header.destination, flow.destination.data(), 16);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  iovec parts[2] = {{&header, sizeof header}, {const_cast<uint8_t*>(datagram.data()), datagram.size()}};
  msghdr message{};
  message.msg_name = &to;
  message.msg_namelen = sizeof to;
  message.msg_iov = parts;
  message.msg_iovlen = 2;
  if (::sendmsg(forward_fd_, &message, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    counters().add(Counter::SendErrors);
    return;
  }
  counters().add(Counter::ForwardedPackets);
}

}  // namespace softverbs::udp
