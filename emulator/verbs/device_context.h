// One process's use of one device, as an ibv_context is: the device's
// shared memory, the GIDs and transport it was brought up with, and the
// device work that needs this process: sends waiting out an RNR or a peer
// that is not ready, the device's removal, and the UDP transport.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "device/device_memory.h"
#include "host/device_config.h"
#include "host/gid.h"
#include "udp/transport.h"
#include "verbs/retry_timer.h"

namespace softverbs {

class DeviceQp;

class DeviceContext {
 public:
  using Clock = std::chrono::steady_clock;

  DeviceContext();
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  DeviceConfig config;
  std::shared_ptr<DeviceMemory> memory;  // one mapping per process
  std::vector<GidEntry> gids;            // as the sysfs tree shows them
  bool netdev_is_loopback = true;
  uint8_t active_mtu = 0;  // the port's (an ibv_mtu), a QP's path MTU after RESET

  // What a poll does besides reading the CQ: retries the sends that are
  // due, acts on the device's removal, and drives the UDP engine.
  void progress();
  // The application is about to sleep until a completion event.
  void application_waits();

  // The context's UDP transport, started if need be; nullptr (and a message
  // on stderr) if it cannot start.
  UdpTransport* udp_transport();
  UdpTransport* udp_if_running() const { return udp_running_.load(std::memory_order_acquire); }
  // In a forked child: the parent's transport is not the child's.
  void forget_udp_transport();
  // Whether UD datagrams go over UDP: on a udp device, and on an auto one
  // whose netdev is not a loopback (a peer may be on another host).
  bool ud_over_udp() const;

  // Multicast membership of a UD QP, in the device and, where UD goes over
  // UDP, on the netdev. 0 or an errno.
  int attach_multicast(const Gid& group, uint32_t qpn);
  int detach_multicast(const Gid& group, uint32_t qpn);

  // Held while QPs come and go and while a retry pass walks them; the
  // provider counts its CQs' and SRQs' QP references under it too.
  std::mutex qps_mutex;

 private:
  friend class DeviceQp;
  Clock::time_point retry_due_sends();
  void handle_removal();

  std::vector<DeviceQp*> qps_;         // under qps_mutex
  std::atomic<int> waiting_sends_{0};  // lets a poll skip the pass when none waits
  // The QPs with waiting sends, so that a retry pass does not walk every QP
  // of the process. Taken after qps_mutex and a QP's mutex, never before.
  std::mutex waiting_qps_mutex_;
  std::vector<DeviceQp*> waiting_qps_;  // under waiting_qps_mutex_
  std::atomic<bool> removal_handled_{false};
  std::mutex udp_mutex_;
  std::shared_ptr<UdpTransport> udp_;
  std::atomic<UdpTransport*> udp_running_{nullptr};
  RetryTimer retry_timer_;  // last: its destructor waits out a pass that uses the rest
};

}  // namespace softverbs
