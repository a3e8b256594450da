#include "verbs/device_context.h"

#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "device/shared_mutex.h"
#include "verbs/adversary.h"
#include "verbs/device_qp.h"

namespace softverbs {

namespace {

// This process's contexts, for the fork handler: a child that goes on
// using a context it inherited starts a UDP transport of its own.
struct ContextList {
  std::mutex mutex;
  std::vector<DeviceContext*> contexts;
};

ContextList& context_list() {
  static ContextList* list = [] {
    auto* made = new ContextList;  // NOLINT: lives as long as the process (its fork handlers use it)
    pthread_atfork([] { context_list().mutex.lock(); }, [] { context_list().mutex.unlock(); },
                   [] {
                     for (DeviceContext* context : context_list().contexts) context->forget_udp_transport();
                     context_list().mutex.unlock();
                   });
    return made;
  }();
  return *list;
}

}  // namespace

DeviceContext::DeviceContext() : retry_timer_([this] { return retry_due_sends(); }) {
  if (adversary::enabled()) [[unlikely]]
    adversary::announce();
  ContextList& list = context_list();
  std::lock_guard guard(list.mutex);
  list.contexts.push_back(this);
}

DeviceContext::~DeviceContext() {
  ContextList& list = context_list();
  std::lock_guard guard(list.mutex);
  std::erase(list.contexts, this);
}

void DeviceContext::forget_udp_transport() { udp_running_.store(nullptr, std::memory_order_release); }

UdpTransport* DeviceContext::udp_transport() {
  // Set once and kept for the context's life (in a forked child, made
  // again): every post over UDP asks.
  if (UdpTransport* running = udp_if_running()) return running;
  std::lock_guard guard(udp_mutex_);
  if (!udp_ || !udp_->started_here()) {
    std::string error;
    udp_ = UdpTransport::acquire(memory, config, gids, &error);
    if (!udp_) {
      std::fprintf(stderr, "softverbs: %s: the UDP transport cannot start: %s\n", config.name.c_str(), error.c_str());
      return nullptr;
    }
    udp_running_.store(udp_.get(), std::memory_order_release);
  }
  return udp_.get();
}

bool DeviceContext::ud_over_udp() const { return carries_udp(config.transport, netdev_is_loopback); }

void DeviceContext::handle_removal() {
  if (!memory->removed() || removal_handled_.exchange(true)) return;
  std::lock_guard guard(qps_mutex);
  for (DeviceQp* qp : qps_) {
    std::lock_guard qp_guard(qp->mutex_);
    qp->fail_after_removal();
  }
}

DeviceContext::Clock::time_point DeviceContext::retry_due_sends() {
  handle_removal();
  if (waiting_sends_.load(std::memory_order_acquire) == 0) return Clock::time_point::max();
  // Holding qps_mutex keeps every QP alive (~DeviceQp takes it too).
  std::lock_guard guard(qps_mutex);
  if (waiting_sends_.load(std::memory_order_acquire) == 0) return Clock::time_point::max();
  std::vector<DeviceQp*> waiting;  // retrying takes QPs off the list
  {
    std::lock_guard listing(waiting_qps_mutex_);
    waiting = waiting_qps_;
  }
  Clock::time_point earliest = Clock::time_point::max();
  for (DeviceQp* qp : waiting) earliest = std::min(earliest, qp->retry_due());
  return earliest;
}

void DeviceContext::progress() {
  retry_due_sends();
  if (UdpTransport* udp = udp_if_running()) udp->drive();
}

void DeviceContext::application_waits() {
  if (UdpTransport* udp = udp_if_running()) udp->application_waits();
}

int DeviceContext::attach_multicast(const Gid& group, uint32_t qpn) {
  MulticastTable::Gid raw = group.raw;
  {
    ExclusiveLock lock(memory->shared().memory_lock);
    if (int error = memory->shared().multicast.attach(raw, qpn)) return error;
  }
  if (UdpTransport* udp = ud_over_udp() ? udp_transport() : nullptr) {
    if (int error = udp->join_group(group, qpn)) {
      ExclusiveLock lock(memory->shared().memory_lock);
      memory->shared().multicast.detach(raw, qpn);
      return error;
    }
  }
  return 0;
}

int DeviceContext::detach_multicast(const Gid& group, uint32_t qpn) {
  {
    ExclusiveLock lock(memory->shared().memory_lock);
    if (int error = memory->shared().multicast.detach(group.raw, qpn)) return error;
  }
  if (UdpTransport* udp = ud_over_udp() ? udp_transport() : nullptr) udp->leave_group(group, qpn);
  return 0;
}

}  // namespace softverbs
