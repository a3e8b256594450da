// The provider's per-device and per-context state: the thin layer between
// libibverbs' verbs_context and the emulator's device model.
#pragma once

#include <memory>

#include "abi/verbs_private34.h"
#include "device/device_attributes.h"
#include "device/device_memory.h"
#include "device/event_socket.h"
#include "host/device_config.h"
#include "verbs/device_context.h"

namespace softverbs::provider {

struct ProviderDevice {
  abi::verbs_device verbs;  // must be first: libibverbs owns this part
};

// A context: the emulator's view of the device in this process, plus the
// attributes libibverbs asks for and the socket its async events come to.
struct ContextState : DeviceContext {
  DeviceAttributes device;
  PortAttributes port;
  SocketAddress async_address;  // of context.async_fd, where events are sent
};

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
// The device clock (device/device_clock.h) as IBV_VALUES_MASK_RAW_CLOCK.
int query_rt_values(ibv_context* context, ibv_values_ex* values);

}  // namespace softverbs::provider
