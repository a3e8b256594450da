// The provider's per-device and per-context state: the thin layer between
// libibverbs' verbs_context and the emulator's device model.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "abi/verbs_private34.h"
#include "device/device_attributes.h"
#include "device/device_memory.h"
#include "device/event_socket.h"
#include "host/device_config.h"
#include "udp/transport.h"

namespace softverbs::provider {

struct ProviderDevice {
  abi::verbs_device verbs;  // must be first: libibverbs owns this part
};

// Everything a context knows that is not libibverbs' business.
struct ProviderQp;

struct ContextState {
  DeviceConfig config;
  DeviceAttributes device;
  PortAttributes port;
  SocketAddress async_address;           // of context.async_fd, where events are sent
  std::shared_ptr<DeviceMemory> memory;  // one mapping per process
  // QPs of this context, swept for deferred sends (RNR, peer not ready).
  std::mutex qps_mutex;
  std::vector<ProviderQp*> qps;
  std::atomic<int> deferred_sends{0};
  std::atomic<bool> removal_handled{false};  // the device's removal was acted on
  // The GID table (as the sysfs tree shows it) and whether the device's
  // netdev is a loopback one, for the transport choice.
  std::vector<GidEntry> gids;
  bool netdev_is_loopback = true;
  // The UDP transport, started by the first QP that needs it.
  std::mutex udp_mutex;
  std::shared_ptr<UdpTransport> udp;
  std::atomic<UdpTransport*> udp_running{nullptr};  // for the polling fast path
};

// The context's UDP transport, started if need be; nullptr and a message
// on stderr if it cannot start.
UdpTransport* udp_transport(ContextState& state);

struct ProviderContext {
  verbs_context verbs;
  std::unique_ptr<ContextState> state;  // constructed in place after libibverbs' calloc
};

inline ProviderContext* to_provider(ibv_context* context) {
  auto* verbs = reinterpret_cast<verbs_context*>(reinterpret_cast<char*>(context) - offsetof(verbs_context, context));
  return reinterpret_cast<ProviderContext*>(reinterpret_cast<char*>(verbs) - offsetof(ProviderContext, verbs));
}

// ibv_device_attr_ex / ibv_port_attr from the emulator's attributes.
void fill_device_attr(const DeviceAttributes& attributes, ibv_device_attr_ex& out);
void fill_port_attr(const PortAttributes& attributes, ibv_port_attr& out);

int query_device_ex(ibv_context* context, const ibv_query_device_ex_input* input, ibv_device_attr_ex* attr,
                    size_t attr_size);
int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr);

// Fills the PD/MR/CQ/QP/AH entries of the ops table.
void add_verbs_object_ops(abi::verbs_context_ops& ops);

}  // namespace softverbs::provider
