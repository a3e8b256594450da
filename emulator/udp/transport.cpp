// UdpTransport, the transport's public face: one engine per device and
// process (udp/engine.h), found through a directory of this process's
// transports.
#include "udp/transport.h"

#include <pthread.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "support/leaving.h"
#include "udp/engine.h"

namespace softverbs {

UdpTransport::UdpTransport(std::unique_ptr<udp::PortEngine> engine) : engine_(std::move(engine)) {}
UdpTransport::~UdpTransport() {
  // A forked child that closes the device it inherited leaves the engine be:
  // stopping it would take the parent's sockets out of their shared epoll
  // set and join a thread the child does not have.
  if (!engine_->started_here()) (void)engine_.release();  // NOLINT: abandoned, as the parent's
}

namespace {

// This process's transports, one per device memory.
struct TransportDirectory {
  std::mutex mutex;
  std::map<const DeviceMemory*, std::weak_ptr<UdpTransport>> transports;
};

TransportDirectory& transport_directory() {
  static TransportDirectory* directory = [] {
    auto* made = new TransportDirectory;  // NOLINT: lives as long as the process (its fork handlers use it)
    // A forked child starts with none: the parent's are the parent's.
    pthread_atfork([] { transport_directory().mutex.lock(); }, [] { transport_directory().mutex.unlock(); },
                   [] {
                     TransportDirectory& inherited = transport_directory();
                     inherited.transports.clear();
                     inherited.mutex.unlock();
                   });
    return made;
  }();
  return *directory;
}

}  // namespace

std::shared_ptr<UdpTransport> UdpTransport::acquire(const std::shared_ptr<DeviceMemory>& memory,
                                                    const DeviceConfig& config, const std::vector<GidEntry>& gids,
                                                    std::string* error) {
  TransportDirectory& directory = transport_directory();
  std::lock_guard guard(directory.mutex);
  if (auto existing = directory.transports[memory.get()].lock()) return existing;
  auto engine = std::make_unique<udp::PortEngine>(memory, config, gids);
  if (!engine->start(error)) return nullptr;
  // A program that exits with its device open never destroys the engine.
  static const bool at_exit = std::atexit(send_what_is_owed_before_exit) == 0;
  (void)at_exit;
  std::shared_ptr<UdpTransport> transport(new UdpTransport(std::move(engine)));
  directory.transports[memory.get()] = transport;
  return transport;
}

void UdpTransport::hold_data_paths(const DeviceMemory& memory, const std::function<void()>& change) {
  std::shared_ptr<UdpTransport> transport;
  {
    TransportDirectory& directory = transport_directory();
    std::lock_guard guard(directory.mutex);
    auto it = directory.transports.find(&memory);
    if (it != directory.transports.end()) transport = it->second.lock();
  }
  if (!transport) {
    change();
    return;
  }
  transport->engine_->hold_data_paths(change);
}

void UdpTransport::send_what_is_owed_before_exit() {
  std::vector<std::shared_ptr<UdpTransport>> transports;
  {
    TransportDirectory& directory = transport_directory();
    auto guard = leaving::lock_unless_stuck(directory.mutex);
    if (!guard.owns_lock()) return;
    for (const auto& [memory, weak] : directory.transports)
      if (auto transport = weak.lock()) transports.push_back(std::move(transport));
  }
  for (const auto& transport : transports) transport->engine_->send_what_is_owed_before_exit();
}

bool UdpTransport::started_here() const { return engine_->started_here(); }

bool UdpTransport::is_local_gid(const Gid& gid) const { return engine_->is_local_gid(gid); }

bool UdpTransport::usable_source_gid(int sgid_index, std::string* error) const {
  return engine_->usable_source_gid(sgid_index, error);
}

std::optional<udp::Path> UdpTransport::resolve_path(int sgid_index, const Gid& dgid, uint8_t traffic_class,
                                                    uint8_t hop_limit, uint32_t flow_label, std::string* error) const {
  return engine_->resolve_path(sgid_index, dgid, traffic_class, hop_limit, flow_label, error);
}

int UdpTransport::sync_qp(int qp_index) { return engine_->sync_qp(qp_index); }
void UdpTransport::forget_qp(uint32_t qpn) { engine_->forget_qp(qpn); }
bool UdpTransport::carries(uint32_t qpn) const { return engine_->carries(qpn); }
size_t UdpTransport::outstanding_sends(uint32_t qpn) const { return engine_->outstanding_sends(qpn); }
int UdpTransport::join_group(const Gid& group, uint32_t qpn) { return engine_->join_group(group, qpn); }
void UdpTransport::leave_group(const Gid& group, uint32_t qpn) { engine_->leave_group(group, qpn); }
void UdpTransport::leave_groups(uint32_t qpn) { engine_->leave_groups(qpn); }
int UdpTransport::post_send(uint32_t qpn, const udp::SendWqe& wqe) { return engine_->post_send(qpn, wqe); }
void UdpTransport::drive() { engine_->drive(); }
void UdpTransport::receive_posted() { engine_->receive_posted(); }
void UdpTransport::application_waits() { engine_->application_waits(); }

uint64_t UdpTransport::wait_for_channel(int channel_fd, const SocketAddress& channel) {
  return engine_->wait_for_channel(channel_fd, channel);
}

}  // namespace softverbs
