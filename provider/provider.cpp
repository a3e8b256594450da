// Driver registration and device/context lifetime: what libibverbs calls to
// find, open and close a softverbs device.
#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checker/unacknowledged_events.h"
#include "checker/work_checks.h"
#include "device/device_limits.h"
#include "event_kinds.h"
#include "handle_registry.h"
#include "host/device_registry.h"
#include "host/netdev.h"
#include "host/sysfs_tree.h"
#include "provider_context.h"
#include "shm/memory_copy.h"
#include "support/file_util.h"
#include "udp/transport.h"
#include "verbs_objects.h"

namespace softverbs::provider {
namespace {

namespace fs = std::filesystem;

// Per-process count of open contexts per device, so that the registry lists
// this process as a user while any context is open.
// The record lists each open context's async socket, so that `softverbs`
// can deliver port events (GID change, port error) to every user.
class UserRecords {
 public:
  void opened(const DeviceConfig& config, const std::string& async_socket) {
    std::lock_guard lock(mutex_);
    auto& sockets = open_contexts_[config.name];
    sockets.push_back(async_socket);
    DeviceRegistry(config.runtime_dir).register_user(config.name, getpid(), sockets);
  }
  void closed(const DeviceConfig& config, const std::string& async_socket) {
    std::lock_guard lock(mutex_);
    auto& sockets = open_contexts_[config.name];
    std::erase(sockets, async_socket);
    DeviceRegistry registry(config.runtime_dir);
    if (sockets.empty())
      registry.unregister_user(config.name, getpid());
    else
      registry.register_user(config.name, getpid(), sockets);
  }

 private:
  std::mutex mutex_;
  std::map<std::string, std::vector<std::string>> open_contexts_;
};

UserRecords& user_records() {
  static UserRecords records;
  return records;
}

abi::verbs_device* alloc_device(abi::verbs_sysfs_dev*) {
  auto device = std::make_unique<ProviderDevice>();
  return &device.release()->verbs;
}

void uninit_device(abi::verbs_device* device) {
  std::unique_ptr<ProviderDevice> owner(reinterpret_cast<ProviderDevice*>(device));
}

void free_context(ibv_context* context);

// libibverbs built `event` from 16 bytes it read from async_fd. Without the
// preload (which reads them itself and drops forged ones) a datagram from
// another local user could name any pointer: such an event is turned into
// one that names none, rather than left for the application to follow.
void sanitize_async_event(ibv_context* context, ibv_async_event* event) {
  uint64_t element = 0;
  switch (event_element(event->event_type)) {
    case EventElement::Cq:
      element = reinterpret_cast<uint64_t>(event->element.cq);
      break;
    case EventElement::Srq:
      element = reinterpret_cast<uint64_t>(event->element.srq);
      break;
    case EventElement::Qp:
      element = reinterpret_cast<uint64_t>(event->element.qp);
      break;
    case EventElement::Wq:
      element = reinterpret_cast<uint64_t>(event->element.wq);
      break;
    case EventElement::Port:
    case EventElement::Unknown:
      element = static_cast<uint64_t>(event->element.port_num);
      break;
  }
  if (is_valid_event(context, event->event_type, element)) return;
  event->event_type = IBV_EVENT_SM_CHANGE;  // never raised on a RoCE port otherwise
  event->element.port_num = 1;
}

const abi::verbs_context_ops kContextOps = [] {
  abi::verbs_context_ops ops{};
  ops.free_context = free_context;
  ops.async_event = sanitize_async_event;
  ops.query_device_ex = query_device_ex;
  ops.query_port = query_port;
  ops.query_rt_values = query_rt_values;
  add_memory_ops(ops);
  add_memory_window_ops(ops);
  add_completion_queue_ops(ops);
  add_address_handle_ops(ops);
  add_shared_receive_queue_ops(ops);
  add_queue_pair_ops(ops);
  add_xrc_ops(ops);
  add_on_demand_paging_ops(ops);
  add_device_memory_ops(ops);
  add_domain_ops(ops);
  return ops;
}();

std::unique_ptr<ContextState> load_context_state(const ibv_device* device) {
  auto text = read_text_file(fs::path(device->ibdev_path) / kDeviceConfigFile);
  if (!text) return nullptr;
  std::string error;
  auto config = DeviceConfig::parse(*text, &error);
  if (!config) {
    errno = EINVAL;
    return nullptr;
  }
  auto state = std::make_unique<ContextState>();
  std::string memory_error;
  state->memory = DeviceMemory::open_shared(config->runtime_dir / (config->name + ".mem"), &memory_error);
  if (!state->memory) {
    std::fprintf(stderr, "softverbs: %s\n", memory_error.c_str());
    errno = EIO;
    return nullptr;
  }
  state->memory->reclaim_dead_owners();
  if (state->memory->process_slot() < 0) {
    std::fprintf(stderr, "softverbs: %s: too many processes use the device\n", config->name.c_str());
    errno = ENOMEM;
    return nullptr;
  }
  state->gids = read_gid_table(device->ibdev_path, config->netdev);
  auto netdev = query_netdev(config->netdev);
  state->netdev_is_loopback = !netdev || netdev->is_loopback;
  state->device = device_attributes(*config);
  state->port = port_attributes(*config);
  state->active_mtu = static_cast<uint8_t>(state->port.active_mtu);
  state->config = std::move(*config);
  return state;
}

verbs_context* alloc_context(ibv_device* device, int cmd_fd, void*) {
  // cmd_fd is the uverbs character device, which for softverbs is /dev/null
  // opened read-write: libibverbs' kernel commands would "succeed" there.
  // Replace it with a read-only /dev/null so that any kernel-only path fails
  // cleanly with EBADF instead.
  close(cmd_fd);
  int inert_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (inert_fd < 0) return nullptr;

  std::unique_ptr<ContextState> state = load_context_state(device);
  if (!state) {
    close(inert_fd);
    return nullptr;
  }
  // async_fd is a datagram socket with an abstract address, so that events
  // raised by other processes (an SRQ limit reached by a peer's SEND) reach it.
  int async_fd = open_event_socket(&state->async_address);
  if (async_fd < 0) {
    close(inert_fd);
    return nullptr;
  }

  auto* context = static_cast<ProviderContext*>(_verbs_init_and_alloc_context(
      device, inert_fd, sizeof(ProviderContext), reinterpret_cast<verbs_context*>(offsetof(ProviderContext, verbs)),
      0 /* RDMA_DRIVER_UNKNOWN */));
  if (context == nullptr) {
    close(async_fd);
    return nullptr;
  }
  // libibverbs calloc'ed the object; construct our member in place.
  std::construct_at(&context->state, std::move(state));
  context->verbs.context.async_fd = async_fd;
  context->verbs.context.num_comp_vectors = 1;
  verbs_set_ops(&context->verbs, &kContextOps);
  // Peers copy into this process with process_vm_writev; under Yama's
  // ptrace_scope=1 (Ubuntu's default) that needs the target's consent. The
  // kernel still requires the same user (see docs/shared-memory.md).
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  user_records().opened(context->state->config, address_to_text(context->state->async_address));
  register_handle(HandleKind::Context, &context->verbs.context);
  offer_validator_to_preload(wait_for_cq_event, &UdpTransport::send_what_is_owed_before_exit);
  return &context->verbs;
}

void free_context(ibv_context* ibv_context) {
  ProviderContext* context = to_provider(ibv_context);
  check::unacknowledged_at_close(ibv_context);
  unregister_handle(HandleKind::Context, ibv_context);
  if (check::enabled()) check::release_quarantine(ibv_context);
  user_records().closed(context->state->config, address_to_text(context->state->async_address));
  std::destroy_at(&context->state);
  verbs_uninit_context(&context->verbs);  // closes cmd_fd and async_fd
  std::free(context);
}

const abi::verbs_match_ent kMatchTable[] = {
    {nullptr, {.modalias = "softverbs:*"}, 0, 0, abi::kMatchModalias},
    {nullptr, {.modalias = nullptr}, 0, 0, abi::kMatchSentinel},
};

const abi::verbs_device_ops kDeviceOps = {
    .name = "softverbs",
    .match_min_abi_version = limits::kUverbsAbiVersion,
    .match_max_abi_version = limits::kUverbsAbiVersion,
    .match_table = kMatchTable,
    .static_providers = nullptr,
    // None: libibverbs calls a provider's match function for every device
    // the table did not match, so one that said yes claimed real HCAs.
    .match_device = nullptr,
    .alloc_context = alloc_context,
    .import_context = nullptr,
    .alloc_device = alloc_device,
    .uninit_device = uninit_device,
};

}  // namespace

}  // namespace softverbs::provider

__attribute__((constructor)) static void register_softverbs_driver() {
  verbs_register_driver_34(&softverbs::provider::kDeviceOps);
}
