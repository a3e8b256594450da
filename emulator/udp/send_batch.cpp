// Sending: the socket each flow leaves from, the send batch's flush as one
// UDP GSO send, the socket's own GSO size that makes it a plain send(), and
// the ICRCs of a GSO send's datagrams made right for their identifications.
// (batch_room and send_bytes, which fill the batch, are in udp/engine.h.)
#include <netinet/udp.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "udp/engine.h"
#include "udp/gso.h"

namespace softverbs::udp {

using namespace wire;
using namespace parameters;

namespace {
// A send's errno that says the kernel or the device cannot do GSO.
bool gso_refused(int error) { return error == EINVAL || error == EIO || error == ENOPROTOOPT || error == EOPNOTSUPP; }
}  // namespace

PortEngine::SendSocket PortEngine::send_socket(const IpAddress& local, uint16_t port) {
  auto key = std::make_pair(local, port);
  if (auto it = send_sockets_.find(key); it != send_sockets_.end()) return {it->second.get(), port};
  // The flow's port is taken by another program (an ephemeral port of any
  // socket may be one): the packet leaves from port 4791, still a valid
  // RoCEv2 packet once its ICRC covers that port. Tried again a while
  // later, not at every packet: a failed bind costs three system calls.
  auto fallback = [&]() -> SendSocket {
    auto receive = receive_fd_by_address_.find(local);
    return {receive != receive_fd_by_address_.end() ? receive->second : -1, kRoceV2Port};
  };
  const Clock::time_point now = Clock::now();
  if (auto held = ports_held_elsewhere_.find(key); held != ports_held_elsewhere_.end()) {
    if (now < held->second) return fallback();
    ports_held_elsewhere_.erase(held);
  }
  int fd = bind_udp(local, port, ifindex_);
  if (fd < 0) {
    ports_held_elsewhere_[key] = now + kHeldPortRetry;
    return fallback();
  }
  send_sockets_.emplace(key, Fd(fd));
  send_peers_.emplace(fd, SendPeer{});
  last_peer_fd_ = -1;  // the number may be one a closed socket had
  return {fd, port};
}

const PortEngine::SendTarget& PortEngine::send_target(const Path& path, uint16_t source_port) {
  if (last_target_.same_flow(path, source_port)) return last_target_;
  const SendSocket socket = send_socket(path.local, source_port);
  SendTarget target{path.local,
                    path.remote,
                    source_port,
                    socket.leaves_from,
                    path.scope_id,
                    socket.fd,
                    to_sockaddr(path.remote, kRoceV2Port, path.scope_id)};
  // A flow sent from port 4791 is not remembered as the last, so that a
  // packet after kHeldPortRetry tries its own port again.
  if (socket.leaves_from != source_port) {
    fallback_target_ = target;
    return fallback_target_;
  }
  last_target_ = target;
  return last_target_;
}

void PortEngine::flush_sends() {
  SendBatch& b = batch_;
  if (b.count == 0) return;
  const iovec whole{b.copies.data(), b.used};
  send_now(b.fd, b.to, std::span(&whole, 1), b.used, b.count > 1 ? b.segment : 0);
  counters().add(Counter::TxPackets, b.count);
  counters().add(Counter::TxBytes, b.used);
  b.count = 0;
  b.closed = false;
  b.used = 0;
  b.held_for_qpn = 0;
}

PortEngine::PlainSend PortEngine::send_plain(int fd, SendPeer& peer, const iovec& piece, size_t total, size_t segment) {
  const auto asked = static_cast<uint16_t>(segment);
  const bool plain = asked != 0 ? asked == peer.segment : peer.segment == 0 || total <= peer.segment;
  if (!plain) return PlainSend::NotPlain;
  const ssize_t sent = peer.connected ? ::send(fd, piece.iov_base, piece.iov_len, MSG_DONTWAIT | MSG_NOSIGNAL)
                                      : ::sendto(fd, piece.iov_base, piece.iov_len, MSG_DONTWAIT | MSG_NOSIGNAL,
                                                 peer.address.get(), peer.address.length);
  return sent >= 0 ? PlainSend::Sent : PlainSend::Failed;
}

void PortEngine::number_datagrams(std::span<const iovec> parts, size_t total, size_t segment) {
  size_t index = 0;
  for (size_t start = segment; start < total; start += segment) {
    ++index;
    const size_t end = std::min(total, start + segment);
    const uint32_t change =
        icrc_headers_.identification_change(static_cast<uint16_t>(index), bytes_after_ipv4_identification(end - start));
    // The ICRC's four bytes end the datagram; XOR them in wire order.
    size_t offset = end - kIcrcBytes;
    for (size_t byte = 0; byte < kIcrcBytes; ++byte, ++offset) {
      size_t at = offset;
      for (const iovec& piece : parts) {
        if (at < piece.iov_len) {
          static_cast<uint8_t*>(piece.iov_base)[at] ^= static_cast<uint8_t>(change >> (8 * byte));
          break;
        }
        at -= piece.iov_len;
      }
    }
  }
}

void PortEngine::set_socket_segment(int fd, SendPeer& peer, uint16_t size) {
  const int value = size;
  if (::setsockopt(fd, SOL_UDP, UDP_SEGMENT, &value, sizeof value) == 0) peer.segment = size;
}

void PortEngine::note_send(int fd, SendPeer& peer, size_t segment) {
  const auto asked = static_cast<uint16_t>(segment);
  if (asked == 0) {
    peer.run = 0;
    if (peer.segment != 0 && ++peer.singles >= kSinglesBeforeSocketSizeGoes) {
      set_socket_segment(fd, peer, 0);
      peer.singles = 0;
    }
    return;
  }
  peer.singles = 0;
  if (asked != peer.run_size) {
    peer.run_size = asked;
    peer.run = 0;
  }
  if (peer.run < kGsoSendsBeforeSocketSize) ++peer.run;
  if (peer.run == kGsoSendsBeforeSocketSize && peer.segment != asked) set_socket_segment(fd, peer, asked);
}

void PortEngine::send_now(int fd, const SocketAddressStorage& to, std::span<const iovec> parts, size_t total,
                          size_t segment) {
  msghdr message{};
  message.msg_name = const_cast<sockaddr*>(to.get());
  message.msg_namelen = to.length;
  if (fd != last_peer_fd_) {
    auto peer = send_peers_.find(fd);
    last_peer_fd_ = fd;
    last_peer_ = peer != send_peers_.end() ? &peer->second : nullptr;
  }
  SendPeer* const peer = last_peer_;
  // Every datagram of a GSO send after the first gets its place as its IPv4
  // identification from the kernel, which the ICRC covers (roce_packet.h).
  const bool numbered = segment != 0 && total > segment && to.get()->sa_family == AF_INET;
  if (numbered) number_datagrams(parts, total, segment);
  if (peer != nullptr) {
    if (peer->address.length == 0) {
      // A connected IPv4 socket numbers its datagrams from a random start
      // that cannot be known here, so only IPv6 (no identification) connects.
      if (to.get()->sa_family != AF_INET && ::connect(fd, to.get(), to.length) == 0) peer->connected = true;
      if (peer->connected || to.get()->sa_family == AF_INET) peer->address = to;
    }
    if (peer->address.length == to.length && std::memcmp(&peer->address.storage, &to.storage, to.length) == 0) {
      if (gso_ok_) note_send(fd, *peer, segment);
      if (parts.size() == 1 && gso_ok_) {
        const PlainSend sent = send_plain(fd, *peer, parts[0], total, segment);
        if (sent == PlainSend::Sent) return;
        if (sent == PlainSend::Failed && !(segment != 0 && gso_refused(errno))) {
          counters().add(Counter::SendErrors);
          return;
        }
      }
      if (peer->connected) {
        message.msg_name = nullptr;
        message.msg_namelen = 0;
      }
    }
  }
  message.msg_iov = const_cast<iovec*>(parts.data());
  message.msg_iovlen = parts.size();
  UdpSegmentControl control;
  // The control message overrides the socket's setting, also with 0 (one datagram).
  if (segment != 0 || (peer != nullptr && peer->segment != 0))
    request_udp_segments(message, control, static_cast<uint16_t>(segment));
  if (fd >= 0 && ::sendmsg(fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) return;
  if (segment != 0 && errno == EINVAL && total > kMaxGsoSegmentsEverywhere * segment &&
      max_gso_segments_ > kMaxGsoSegmentsEverywhere) {
    // More segments than this kernel's UDP_MAX_SEGMENTS: sends of the
    // limit every kernel with GSO takes, from now on.
    max_gso_segments_ = kMaxGsoSegmentsEverywhere;
    if (numbered) number_datagrams(parts, total, segment);  // back to 0: each send below numbers its own
    for_each_datagram(parts, total, kMaxGsoSegmentsEverywhere * segment,
                      [&](std::span<const iovec> pieces, size_t length) {
                        send_now(fd, to, pieces, length, length > segment ? segment : 0);
                      });
    return;
  }
  if (segment != 0 && gso_refused(errno)) {
    // No GSO here (an old kernel, a device without checksum offload): one
    // datagram at a time from now on, and no socket sets a segment size.
    gso_ok_ = false;
    for (auto& [socket, settings] : send_peers_)
      if (settings.segment != 0) set_socket_segment(socket, settings, 0);
    if (numbered) number_datagrams(parts, total, segment);  // sent alone, each is 0
    for_each_datagram(parts, total, segment,
                      [&](std::span<const iovec> datagram, size_t length) { send_now(fd, to, datagram, length, 0); });
    return;
  }
  counters().add(Counter::SendErrors);
}

}  // namespace softverbs::udp
