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

bool is_help(const char* arg) { return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0; }

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

// Parses "--flag VALUE" and "--flag=VALUE". Returns false (after reporting) on
// a missing value.
bool take_value(std::span<char*> args, size_t& i, const char* flag, std::string& value, bool& matched) {
  matched = false;
  size_t flag_length = std::strlen(flag);
  const char* arg = args[i];
  if (std::strcmp(arg, flag) == 0) {
    matched = true;
    if (i + 1 >= args.size()) {
      report_error(std::string("option ") + flag + " needs a value");
      return false;
    }
    value = args[++i];
    return true;
  }
  if (std::strncmp(arg, flag, flag_length) == 0 && arg[flag_length] == '=') {
    matched = true;
    value = arg + flag_length + 1;
    return true;
  }
  return true;
}

constexpr const char* kUpHelp =
    "usage: softverbs up [--name NAME] [--netdev IF] [--transport auto|shm|udp] [--faults SPEC]\n"
    "\n"
    "Creates the emulated RDMA device NAME (default softverbs0) on network device IF\n"
    "(default lo), or refreshes it if it exists (GIDs follow IF's current addresses).\n"
    "Run as root it also creates /dev/infiniband/uverbsN, which lets programs use the\n"
    "device without `softverbs run` (see `softverbs env`).\n"
    "\n"
    "  --transport auto  shared memory for peers on this device, UDP (RoCEv2) for GIDs\n"
    "                    elsewhere when IF is not a loopback device (the default)\n"
    "  --transport shm   shared memory only (same host)\n"
    "  --transport udp   RoCEv2 over UDP port 4791 for every connection, even on this host\n"
    "  --faults SPEC     fault injection on the UDP transport, see `softverbs faults --help`\n"
    "A refresh without --transport or --faults keeps the device's current settings.\n";

constexpr const char* kDownHelp =
    "usage: softverbs down [NAME | --all]\n"
    "\n"
    "Removes the emulated device NAME (default softverbs0), or every device.\n"
    "Programs that have it open see what an HCA's removal gives them: the event\n"
    "IBV_EVENT_DEVICE_FATAL, their QPs in the error state with their work flushed,\n"
    "and EIO from verbs that create objects.\n";

constexpr const char* kStatusHelp =
    "usage: softverbs status [NAME]\n"
    "\n"
    "Shows the emulated devices: port state, MTU, GID table and the processes using them.\n";

constexpr const char* kEnvHelp =
    "usage: softverbs env\n"
    "\n"
    "Prints `export` lines that make libibverbs in this shell find softverbs devices:\n"
    "    eval \"$(softverbs env)\"\n"
    "Programs started this way need /dev/infiniband/uverbsN to exist: `sudo softverbs up`\n"
    "creates it. `softverbs run` needs neither.\n";

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
    for (QpRecord& qp : memory->shared().qps) {
      const uint32_t qpn = qp.qpn;
      if (qp.live && move_to_error(qp, qpn)) flush_receive_queue(*memory, qp);
    }
  }
  fs::remove(path, ec);
}

std::string gid_type_label(GidType type) { return type == GidType::RoceV2 ? "RoCE v2" : "RoCE v1"; }

fs::path dev_entry(const DeviceConfig& config) { return fs::path("/dev/infiniband") / config.uverbs_name(); }

}  // namespace

std::optional<DeviceConfig> bring_up(const DeviceRegistry& registry, const std::string& name,
                                     const std::string& netdev_name, std::optional<TransportChoice> transport,
                                     std::string* error, const std::optional<std::string>& faults) {
  if (!is_valid_device_name(name)) {
    *error = "invalid device name '" + name +
             "': use 1 to 63 of the characters A-Z a-z 0-9 _ . -, starting with a letter or digit";
    return std::nullopt;
  }
  auto netdev = query_netdev(netdev_name);
  if (!netdev) {
    *error = "no network device '" + netdev_name + "' (this namespace has: " + join(list_netdevs()) + ")";
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
  const auto carries_udp = [&](TransportChoice choice) {
    return choice == TransportChoice::Udp || (choice == TransportChoice::Auto && !netdev->is_loopback);
  };
  for (const DeviceConfig& other : registry.list()) {
    if (other.name == name || other.netdev != netdev_name) continue;
    if (carries_udp(wanted) && carries_udp(other.transport)) {
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

int command_up(std::span<char*> args) {
  std::string name = "softverbs0", netdev = "lo", transport_text, faults_text;
  for (size_t i = 0; i < args.size(); ++i) {
    if (is_help(args[i])) {
      std::cout << kUpHelp;
      return kExitOk;
    }
    bool matched = false;
    for (auto [flag, target] : {std::pair{"--name", &name},
                                {"--netdev", &netdev},
                                {"--transport", &transport_text},
                                {"--faults", &faults_text}}) {
      if (!take_value(args, i, flag, *target, matched)) return kExitUsage;
      if (matched) break;
    }
    if (!matched) {
      report_error(std::string("up: unexpected argument '") + args[i] + "'\n" + kUpHelp);
      return kExitUsage;
    }
  }
  std::optional<TransportChoice> transport;
  if (!transport_text.empty()) {
    transport = parse_transport(transport_text);
    if (!transport) {
      report_error("up: invalid transport '" + transport_text + "': use auto, shm or udp");
      return kExitUsage;
    }
  }
  std::optional<std::string> faults;
  if (!faults_text.empty()) {
    std::string why;
    auto settings = FaultSettings::parse(faults_text, &why);
    if (!settings) {
      report_error("up: --faults: " + why);
      return kExitUsage;
    }
    faults = settings->any() ? settings->to_string() : "none";
  }
  if (!is_valid_device_name(name)) {
    report_error("up: invalid device name '" + name +
                 "': use 1 to 63 of the characters A-Z a-z 0-9 _ . -, starting with a letter or digit");
    return kExitUsage;
  }
  if (!query_netdev(netdev)) {
    report_error("up: no network device '" + netdev + "' (this namespace has: " + join(list_netdevs()) + ")");
    return kExitUsage;
  }
  DeviceRegistry registry(default_runtime_dir());
  std::string error;
  auto config = bring_up(registry, name, netdev, transport, &error, faults);
  if (!config) {
    report_error("up: " + error);
    return kExitFailure;
  }
  std::cout << config->name << " is up on " << config->netdev << " (" << config->uverbs_name() << ", node GUID "
            << format_guid(config->node_guid) << ", transport " << transport_name(config->transport) << ")\n";
  return kExitOk;
}

int command_down(std::span<char*> args) {
  std::string name = "softverbs0";
  bool all = false;
  bool named = false;
  for (char* arg : args) {
    if (is_help(arg)) {
      std::cout << kDownHelp;
      return kExitOk;
    }
    if (std::strcmp(arg, "--all") == 0) {
      all = true;
    } else if (arg[0] != '-' && !named) {
      name = arg;
      named = true;
    } else {
      report_error(std::string("down: unexpected argument '") + arg + "'\n" + kDownHelp);
      return kExitUsage;
    }
  }
  if (all && named) {
    report_error("down: give a device name or --all, not both");
    return kExitUsage;
  }
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
    remove_device_memory(config);
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

int command_status(std::span<char*> args) {
  std::string only;
  for (char* arg : args) {
    if (is_help(arg)) {
      std::cout << kStatusHelp;
      return kExitOk;
    }
    if (arg[0] == '-' || !only.empty()) {
      report_error(std::string("status: unexpected argument '") + arg + "'\n" + kStatusHelp);
      return kExitUsage;
    }
    only = arg;
  }
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
  }
  return kExitOk;
}

int command_env(std::span<char*> args) {
  for (char* arg : args) {
    if (is_help(arg)) {
      std::cout << kEnvHelp;
      return kExitOk;
    }
    report_error(std::string("env: unexpected argument '") + arg + "'\n" + kEnvHelp);
    return kExitUsage;
  }
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
