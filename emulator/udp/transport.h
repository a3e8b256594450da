// The UDP transport of one device in one process: RoCEv2 packets to and
// from UDP port 4791 on the device's IP addresses.
//
// Addressing (docs/udp-transport.md): a peer is named by a GID, which is an
// IP address (IPv4-mapped or IPv6), and a QPN. Every process that uses the
// device binds port 4791 on the device's addresses with SO_REUSEPORT, so the
// kernel hands each flow to one of them; the QPN in the BTH says which QP
// the packet is for, the device memory says which process owns that QP, and
// a packet that reached another process is passed to the owner over a local
// datagram socket. The owner runs the protocol for its QPs: the responder
// writes into its own memory, the completer completes its own work.
//
// Progress: verbs calls drive the protocol (post_send sends at once,
// drive() from poll_cq reads what has arrived); one background thread per
// device and process, blocked in Boost.Asio's reactor, does the rest while
// the application is elsewhere: ACKs, retransmissions, one-sided operations.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "device/device_attributes.h"
#include "device/device_memory.h"
#include "host/device_config.h"
#include "host/gid.h"
#include "udp/qp.h"

namespace softverbs {

namespace udp {
class PortEngine;  // udp/engine.h
}  // namespace udp

class UdpTransport {
 public:
  // This process's transport for the device, started on first use (sockets
  // bound, thread running). nullptr and a message if the device cannot use
  // UDP here (another device or rxe owns an address's port 4791, ...).
  static std::shared_ptr<UdpTransport> acquire(const std::shared_ptr<DeviceMemory>& memory, const DeviceConfig& config,
                                               const std::vector<GidEntry>& gids, std::string* error);
  ~UdpTransport();
  UdpTransport(const UdpTransport&) = delete;
  UdpTransport& operator=(const UdpTransport&) = delete;

  // False in a forked child, whose transports are its own (acquire makes
  // them anew there): the parent's engine thread, sockets and epoll set
  // are the parent's.
  bool started_here() const;

  // True if `gid` is one of this device's GIDs.
  bool is_local_gid(const Gid& gid) const;

  // Whether packets can leave from GID `sgid_index`: it is set, and its IP
  // address is one of the netdev's; if not, false and a message that names
  // the GIDs that can. Asked when a QP or an address handle is set up (it
  // may read the netdev), not for each datagram.
  bool usable_source_gid(int sgid_index, std::string* error) const;
  // The path to `dgid` from the address of GID `sgid_index`; nullopt (and
  // a message) if the source GID is empty or the two are not IP addresses
  // of the same family.
  std::optional<udp::Path> resolve_path(int sgid_index, const Gid& dgid, uint8_t traffic_class, uint8_t hop_limit,
                                        uint32_t flow_label, std::string* error) const;

  // Brings the QP's protocol state in line with its record after a Modify
  // QP (attach at RTR, start sending at RTS, flush at ERR, forget at RESET).
  // 0 or an errno (EINVAL: the path cannot be resolved).
  int sync_qp(int qp_index);
  // Drops the QP's state without completions (destroy).
  void forget_qp(uint32_t qpn);
  bool carries(uint32_t qpn) const;
  // The QP's send work requests posted and not yet completed.
  size_t outstanding_sends(uint32_t qpn) const;

  // UD multicast over IP multicast: QP `qpn` of this process receives what
  // is sent to `group` (Gid::is_multicast) on the device's netdev, from this
  // host or any other. 0, or an errno from joining the group.
  int join_group(const Gid& group, uint32_t qpn);
  void leave_group(const Gid& group, uint32_t qpn);
  // Every group the QP is in (destroy).
  void leave_groups(uint32_t qpn);

  // Queues a send work request on an attached QP: 0, or EINVAL if the QP
  // is not attached or not in RTS/SQD.
  int post_send(uint32_t qpn, const udp::SendWqe& wqe);

  // Progress from a verbs call: handles what has arrived and what is due,
  // without blocking (skipped if the background thread is at it).
  void drive();
  // A receive was posted (to a QP or an SRQ): a SEND that waits for one
  // (see kReceiveGrace in udp/parameters.h) is taken in now.
  void receive_posted();
  // The application is about to block (it armed a CQ for an event): the
  // background thread takes over at once.
  void application_waits();
  // A thread of the application is about to block reading completion
  // channel `channel_fd`: it reads the device's sockets itself until the
  // channel has a datagram (at once if the fd is non-blocking).
  // Returns the CQ handle of an event this thread raised on the channel (at
  // `channel`, its address) while it waited, which then was not sent; 0 if
  // none: the channel has a datagram then (or the fd is non-blocking).
  // kChannelWaitInterrupted: a signal handler ran that would have ended a
  // read of the channel with EINTR.
  uint64_t wait_for_channel(int channel_fd, const SocketAddress& channel);
  static constexpr uint64_t kChannelWaitInterrupted = ~uint64_t{0};

  // Runs `change` (a deregistration or reregistration of this process's
  // memory) while no engine of this process for the device is using
  // registered memory: the engines look keys up briefly under the device's
  // memory_lock and then use the addresses under their own mutex, which this
  // holds.
  static void hold_data_paths(const DeviceMemory& memory, const std::function<void()>& change);

  // The process is leaving: every transport of it sends what an HCA would
  // already have sent (udp::PortEngine::send_what_is_owed_before_exit).
  // Runs at exit() by itself (atexit); the preload library calls it from
  // _exit() and _Exit().
  static void send_what_is_owed_before_exit();

 private:
  explicit UdpTransport(std::unique_ptr<udp::PortEngine> engine);
  std::unique_ptr<udp::PortEngine> engine_;
};

}  // namespace softverbs
