#include "cli_commands.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <system_error>

#include "device/device_attributes.h"
#include "device/device_memory.h"
#include "device/event_socket.h"
#include "device/queues.h"
#include "host/netdev.h"
#include "host/sysfs_tree.h"
#include "library_paths.h"
#include "sandbox.h"
#include "support/file_util.h"

namespace softverbs::cli {

namespace fs = std::filesystem;

void report_error(const std::string& message) { std::cerr << "softverbs: " << message << '\n'; }

namespace {

std::string host_identity() {
  if (auto machine_id = read_first_line("/etc/machine-id"); machine_id && !machine_id->empty()) return *machine_id;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

std::string join(const std::vector<std::string>& items) {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : ", ") + item;
  return text;
}

// Tells every process with the device open, as the kernel tells the
// contexts of a port whose state or GID table changed.
void announce_port_event(const DeviceRegistry& registry, const std::string& device, AsyncEventType event) {
  constexpr uint64_t kPort = 1;
  for (const auto& user : registry.users(device)) {
    for (const auto& name : user.async_sockets) {
      SocketAddress address;
      if (address_from_text(name, &address)) send_async_event(address, kPort, event);
    }
  }
}

// The device's removal, as an HCA's: its memory says it is gone (every
// post after sees it), each QP goes to ERR with its queued receives
// flushed, and the file goes. Processes that have it mapped keep their
// mapping; a later `up` starts a new device.
void remove_device_memory(const DeviceConfig& config) {
  const fs::path path = config.runtime_dir / (config.name + ".mem");
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  std::string error;
  auto memory = DeviceMemory::open(path, &error);
  if (memory) {
    memory->shared().removed.store(1, std::memory_order_release);
    for (QpRecord& qp : memory->qps_ever_used()) {
      const uint32_t qpn = qp.qpn;
      if (qp.live && move_to_error(qp, qpn)) flush_receive_queue(*memory, qp);
    }
  }
  fs::remove(path, ec);
}

std::string gid_type_label(GidType type) { return type == GidType::RoceV2 ? "RoCE v2" : "RoCE v1"; }

fs::path dev_entry(const DeviceConfig& config) { return fs::path("/dev/infiniband") / config.uverbs_name(); }

}  // namespace

std::string device_name_problem(const std::string& name) {
  if (is_valid_device_name(name)) return {};
  return "invalid device name '" + name +
         "': use 1 to 63 of the characters A-Z a-z 0-9 _ . -, starting with a letter or digit";
}

std::string netdev_problem(const std::string& netdev) {
  if (query_netdev(netdev)) return {};
  return "no network device '" + netdev + "' (this namespace has: " + join(list_netdevs()) + ")";
}

std::optional<DeviceConfig> bring_up(const DeviceRegistry& registry, const std::string& name,
                                     const std::string& netdev_name, std::optional<TransportChoice> transport,
                                     std::string* error, const std::optional<std::string>& faults) {
  if (std::string problem = device_name_problem(name); !problem.empty()) {
    *error = problem;
    return std::nullopt;
  }
  const auto netdev = query_netdev(netdev_name);
  if (!netdev) {
    *error = netdev_problem(netdev_name);
    return std::nullopt;
  }
  if (!registry.ensure_exists(error)) return std::nullopt;
  RegistryLock lock(registry);

  DeviceConfig config;
  auto existing = registry.find(name);
  if (existing) config = *existing;
  // Two devices on one netdev cannot share its RoCEv2 port (4791 on its
  // addresses), as rxe allows one device per netdev: refused here rather
  // than failing later in whichever program opens both (UCX opens all).
  const TransportChoice wanted = transport.value_or(existing ? existing->transport : TransportChoice::Auto);
  for (const DeviceConfig& other : registry.list()) {
    if (other.name == name || other.netdev != netdev_name) continue;
    if (carries_udp(wanted, netdev->is_loopback) && carries_udp(other.transport, netdev->is_loopback)) {
      *error = netdev_name + " already carries " + other.name + " (transport " +
               std::string(transport_name(other.transport)) +
               "), and two devices on one netdev cannot share its RoCEv2 port (one per netdev, as with rxe): use " +
               "another --netdev, or `softverbs down " + other.name + "` first";
      return std::nullopt;
    }
  }
  config.name = name;
  config.netdev = netdev_name;
  if (transport) config.transport = *transport;
  if (faults) config.faults = *faults;
  config.netdev_mtu = netdev->mtu;
  config.runtime_dir = registry.runtime_dir();
  if (config.node_guid == 0) config.node_guid = derive_node_guid(host_identity(), name);
  config.uverbs_index = registry.allocate_uverbs_index(name, "/sys");
  if (config.uverbs_index < 0) {
    *error = "too many devices: remove one with `softverbs down NAME`";
    return std::nullopt;
  }
  if (!write_device_tree(registry.sysfs_root(), config, build_gid_table(*netdev), error)) return std::nullopt;
  link_real_devices(registry.sysfs_root(), "/sys");
  if (!registry.save(config, error)) return std::nullopt;
  if (auto settings = FaultSettings::parse(config.faults, error)) {
    if (!apply_faults(registry, config, *settings, error)) return std::nullopt;
  } else {
    return std::nullopt;
  }
  announce_port_event(registry, name, existing ? AsyncEventType::GidChange : AsyncEventType::PortActive);
  if (geteuid() == 0) {
    std::string dev_error;
    if (!ensure_dev_entry(config, &dev_error)) std::cerr << "softverbs: warning: " << dev_error << '\n';
  }
  return config;
}

std::optional<std::vector<DeviceConfig>> devices_or_default(const DeviceRegistry& registry, std::string* error) {
  auto devices = registry.list();
  if (!devices.empty()) return devices;
  auto config = bring_up(registry, "softverbs0", "lo", std::nullopt, error);
  if (!config) return std::nullopt;
  return std::vector<DeviceConfig>{*config};
}

int command_up(const UpOptions& options) {
  DeviceRegistry registry(default_runtime_dir());
  std::string error;
  auto config = bring_up(registry, options.name, options.netdev, options.transport, &error, options.faults);
  if (!config) {
    report_error("up: " + error);
    return kExitFailure;
  }
  start_cm_watcher(*config);
  std::cout << config->name << " is up on " << config->netdev << " (" << config->uverbs_name() << ", node GUID "
            << format_guid(config->node_guid) << ", transport " << transport_name(config->transport) << ")\n";
  return kExitOk;
}

int command_down(const DownOptions& options) {
  const std::string& name = options.name;
  const bool all = options.all;
  DeviceRegistry registry(default_runtime_dir());
  std::vector<DeviceConfig> targets;
  if (all) {
    targets = registry.list();
  } else if (auto config = registry.find(name)) {
    targets.push_back(*config);
  } else {
    std::vector<std::string> names;
    for (const auto& device : registry.list()) names.push_back(device.name);
    report_error("down: no device named '" + name + "'" +
                 (names.empty() ? std::string(" (no device is up)") : " (devices up: " + join(names) + ")"));
    return kExitFailure;
  }
  RegistryLock lock(registry);
  for (const auto& config : targets) {
    std::string error;
    std::error_code ec;
    remove_device_memory(config);
    fs::remove(config.runtime_dir / (config.name + ".cm-watcher"), ec);  // its watcher exits on its own
    announce_port_event(registry, config.name, AsyncEventType::DeviceFatal);
    remove_device_tree(registry.sysfs_root(), config);
    if (!registry.remove(config.name, &error)) {
      report_error("down: " + error);
      return kExitFailure;
    }
    // /dev/infiniband/uverbsN stays: it is only a link to /dev/null, and
    // devices in other runtime directories may use the same number.
    std::cout << config.name << " is down\n";
  }
  return kExitOk;
}

int command_status(const std::string& only) {
  DeviceRegistry registry(default_runtime_dir());
  auto devices = registry.list();
  if (!only.empty()) {
    std::erase_if(devices, [&](const DeviceConfig& d) { return d.name != only; });
    if (devices.empty()) {
      report_error("status: no device named '" + only + "'");
      return kExitFailure;
    }
  }
  if (devices.empty()) {
    std::cout << "no softverbs device is up (runtime directory " << registry.runtime_dir().string()
              << "); start one with `softverbs up`\n";
    return kExitOk;
  }
  for (const auto& config : devices) {
    PortAttributes port = port_attributes(config);
    std::cout << config.name << ": " << config.uverbs_name() << ", netdev " << config.netdev << ", transport "
              << transport_name(config.transport) << ", node GUID " << format_guid(config.node_guid) << '\n';
    std::cout << "  port 1: " << (port.state == PortState::Active ? "ACTIVE" : "DOWN") << ", active MTU "
              << mtu_bytes(port.active_mtu) << ", link layer Ethernet\n";
    if (config.faults != "none") std::cout << "  fault injection: " << config.faults << '\n';
    fs::path gid_dir = registry.sysfs_root() / "class/infiniband" / config.name / "ports/1";
    for (int index = 0; index < port.gid_table_length; ++index) {
      auto text = read_first_line(gid_dir / "gids" / std::to_string(index));
      if (!text) continue;
      auto gid = Gid::from_sysfs_string(*text);
      if (!gid || gid->is_zero()) continue;
      auto type = read_first_line(gid_dir / "gid_attrs/types" / std::to_string(index)).value_or("?");
      auto ndev = read_first_line(gid_dir / "gid_attrs/ndevs" / std::to_string(index)).value_or("");
      std::cout << "    GID[" << index << "] " << *text << "  "
                << (type == "RoCE v2" ? gid_type_label(GidType::RoceV2) : gid_type_label(GidType::RoceV1)) << "  "
                << ndev << '\n';
    }
    auto users = registry.users(config.name);
    if (users.empty()) {
      std::cout << "  processes: none\n";
    } else {
      std::cout << "  processes:";
      for (const auto& user : users) std::cout << ' ' << user.pid << " (" << user.command << ')';
      std::cout << '\n';
    }
    if (carries_udp(config)) {
      if (auto watcher = cm_watcher_pid(config))
        std::cout << "  CM watcher: " << *watcher << '\n';
      else
        std::cout << "  CM watcher: none (`softverbs up " << config.name << "` starts one)\n";
    }
  }
  return kExitOk;
}

int command_env() {
  LibraryPaths libraries = locate_libraries();
  if (!libraries.found) {
    report_error("env: cannot find libsoftverbs-rdmav34.so and libsoftverbs-preload.so (build or install softverbs)");
    return kExitFailure;
  }
  DeviceRegistry registry(default_runtime_dir());
  std::string error;
  auto devices = devices_or_default(registry, &error);
  if (!devices) {
    report_error("env: " + error);
    return kExitFailure;
  }
  for (const auto& variable : sandbox_environment(registry, libraries, /*namespaced=*/false))
    std::cout << "export " << variable.first << "='" << variable.second << "'\n";
  for (const auto& config : *devices) {
    std::error_code ec;
    if (!fs::exists(dev_entry(config), ec))
      std::cout << "# warning: " << dev_entry(config).string() << " is missing, so libibverbs will skip " << config.name
                << "; run `sudo softverbs up` once, or use `softverbs run -- CMD`\n";
  }
  return kExitOk;
}

}  // namespace softverbs::cli
