// The sockets the engine reads and which of them a pass reads: every
// socket is in an epoll set (the ready set) that a pass asks, but the one a
// polling application finds busy pass after pass is read without asking,
// and may leave the set (kBusyReadsBeforeLeavingSet).
#include <sys/epoll.h>

#include "udp/engine.h"

namespace softverbs::udp {

using namespace wire;
using namespace parameters;

uint64_t PortEngine::add_watcher_locked(Fd fd, const IpAddress& local, bool forward) {
  uint64_t id = next_watcher_++;
  auto watcher = std::make_unique<Watcher>();
  watcher->fd = std::move(fd);
  watcher->id = id;
  watcher->local = local;
  watcher->forward = forward;
  join_ready_set_locked(*watcher);
  watchers_.emplace(id, std::move(watcher));
  return id;
}

void PortEngine::join_ready_set_locked(Watcher& watcher) {
  watcher.busy_reads = 0;
  if (watcher.in_ready_set) return;
  epoll_event interest{};
  interest.events = EPOLLIN;
  interest.data.u64 = watcher.id;
  // Level-triggered: what waits in the socket already makes it ready.
  watcher.in_ready_set = ::epoll_ctl(ready_set_.get(), EPOLL_CTL_ADD, watcher.fd.get(), &interest) == 0;
}

void PortEngine::leave_ready_set_locked(Watcher& watcher) {
  if (watcher.in_ready_set && ::epoll_ctl(ready_set_.get(), EPOLL_CTL_DEL, watcher.fd.get(), nullptr) == 0)
    watcher.in_ready_set = false;
}

void PortEngine::make_busy_locked(Watcher* watcher) {
  if (watcher == busy_watcher_) return;
  if (busy_watcher_ != nullptr) join_ready_set_locked(*busy_watcher_);
  busy_watcher_ = watcher;
  if (watcher != nullptr) watcher->busy_reads = 0;
}

void PortEngine::connect_flow_locked(const UdpQp& qp) {
  // The peer sends from the port of its flow to us (see flow_source_port);
  // a socket connected to that address and port gets exactly that flow.
  int fd = bind_udp(qp.path.local, kRoceV2Port, qp.path.scope_id);
  if (fd < 0) return;  // the reuseport group and forwarding still deliver
  SocketAddressStorage peer = to_sockaddr(qp.path.remote, flow_source_port(qp.dest_qpn, qp.qpn), qp.path.scope_id);
  if (::connect(fd, peer.get(), peer.length) != 0) {
    ::close(fd);
    return;
  }
  const uint64_t id = add_watcher_locked(Fd(fd), qp.path.local, false);
  Watcher& watcher = *watchers_.at(id);
  watcher.connected = true;
  watcher.sources_unknown = true;
  watcher.peer = qp.path.remote;
  watcher.peer_port = flow_source_port(qp.dest_qpn, qp.qpn);
  watcher.receiver = {qp.qpn, qp.mtu};
  qp_watchers_[qp.qpn] = id;
}

void PortEngine::retire_watcher_locked(uint64_t id) {
  auto it = watchers_.find(id);
  if (it == watchers_.end()) return;
  leave_ready_set_locked(*it->second);
  if (busy_watcher_ == it->second.get()) busy_watcher_ = nullptr;
  watchers_.erase(it);
}

void PortEngine::drain_all_locked(Reads reads) {
  // Reading everything is the watching io thread's way (or a poll's while it
  // watches): the socket a polling application took out of the set must be
  // in it again, as packets to it wake the io thread only through the set.
  if (reads == Reads::All && busy_watcher_ != nullptr) join_ready_set_locked(*busy_watcher_);
  // One system call finds the sockets with something to read; a pass that
  // finds nothing (most of a polling application's calls) costs only that.
  epoll_event ready[16];
  int count = ::epoll_wait(ready_set_.get(), ready, std::size(ready), 0);
  for (int i = 0; i < count; ++i) {
    auto it = watchers_.find(ready[i].data.u64);
    if (it == watchers_.end() || !drain(*it->second, reads)) continue;
    if (busy_watcher_ != nullptr && it->second.get() != busy_watcher_)
      several_flows_until_pass_ = polling_passes_ + kSeveralFlowsPasses;
    make_busy_locked(it->second.get());
  }
}

void PortEngine::drain_polling_locked() {
  if (watching_.load(std::memory_order_relaxed)) {
    // A datagram left in a socket would not wake the io thread (only new
    // ones do): if the application stops calling now, it would wait there.
    drain_all_locked(Reads::All);
    return;
  }
  if (++polling_passes_ < several_flows_until_pass_) {
    // Every socket is read through the set now: the busy one, which may
    // have left it, joins it again.
    if (busy_watcher_ != nullptr) join_ready_set_locked(*busy_watcher_);
    drain_all_locked(Reads::One);
    return;
  }
  // Left behind, it waits at most until the io thread's next look.
  if (busy_watcher_ != nullptr && ++passes_on_busy_watcher_ < kLookAroundEvery) {
    // Not while a thread sleeps on the set in ibv_get_cq_event: the
    // socket's packets would not wake it.
    if (drain(*busy_watcher_, Reads::One) && ++busy_watcher_->busy_reads == kBusyReadsBeforeLeavingSet &&
        channel_waiters_.load(std::memory_order_relaxed) == 0)
      leave_ready_set_locked(*busy_watcher_);
    return;
  }
  passes_on_busy_watcher_ = 0;
  drain_all_locked(Reads::One);
}

}  // namespace softverbs::udp
