// The verbs about the UDP transport: `stat` (counters), `faults` (fault
// injection) and `capture` (a pcap of the RoCEv2 packets).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <thread>

#include "cli_commands.h"
#include "device/device_memory.h"
#include "device/transport_counters.h"
#include "wire/pcap_file.h"

namespace softverbs::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStatHelp =
    "usage: softverbs stat [NAME] [--reset]\n"
    "\n"
    "Shows the UDP transport's counters of device NAME (default: every device), summed\n"
    "over every process that used it: packets and bytes sent and received,\n"
    "retransmissions, ACK timeouts, NAKs sent and received (PSN sequence, RNR, errors),\n"
    "duplicates, drops (bad ICRC, malformed, unknown QP, wrong source) and injected\n"
    "faults; then what the device holds: live processes, QPs, CQs, SRQs, MRs and the\n"
    "bytes of device memory in use (after reclaiming what exited processes left).\n"
    "--reset sets the counters to zero.\n";

constexpr const char* kFaultsHelp =
    "usage: softverbs faults [NAME] [SPEC]\n"
    "\n"
    "Shows or sets fault injection on the UDP transport of device NAME (default\n"
    "softverbs0). Running processes follow a change at once. SPEC is a comma-separated\n"
    "list of KEY=VALUE, or `none`:\n"
    "  loss=R       drop a packet           duplicate=R  send a packet twice\n"
    "  reorder=R    hold a packet back behind the next one of its QP\n"
    "  delay=R      hold a packet for delay_us microseconds (default 1000)\n"
    "  corrupt=R    flip a byte (the receiver's ICRC check drops it and counts it)\n"
    "  seed=N       the generator's seed: the same seed and traffic, the same faults\n"
    "Rates R are fractions (0.1) or percentages (10%) of the packets each QP sends.\n"
    "SOFTVERBS_FAULTS=SPEC in a program's environment overrides the device's setting\n"
    "for that program alone.\n";

constexpr const char* kCaptureHelp =
    "usage: softverbs capture [NAME] -w FILE [--duration SECONDS]\n"
    "\n"
    "Writes the RoCEv2 packets that device NAME (default softverbs0) sends and receives\n"
    "over UDP, in every process that uses it, to FILE (pcap, raw IP frames) until\n"
    "interrupted (Ctrl-C) or for SECONDS. tshark and Wireshark decode them as\n"
    "InfiniBand over UDP port 4791. The shared-memory transport sends no packets.\n";

bool is_help(const char* arg) { return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0; }

std::shared_ptr<DeviceMemory> open_device_memory(const DeviceConfig& config, std::string* error) {
  return DeviceMemory::open(config.runtime_dir / (config.name + ".mem"), error);
}

std::optional<DeviceConfig> find_device(const DeviceRegistry& registry, const std::string& name, const char* verb) {
  auto config = registry.find(name);
  if (!config) report_error(std::string(verb) + ": no device named '" + name + "'");
  return config;
}

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

size_t count_pcap_records(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(24);
  size_t records = 0;
  uint32_t header[4];
  while (in.read(reinterpret_cast<char*>(header), sizeof header)) {
    ++records;
    in.seekg(header[2], std::ios::cur);
  }
  return records;
}

}  // namespace

bool apply_faults(const DeviceRegistry& registry, DeviceConfig& config, const FaultSettings& settings,
                  std::string* error) {
  config.faults = settings.any() ? settings.to_string() : "none";
  if (!registry.save(config, error)) return false;
  auto memory = open_device_memory(config, error);
  if (!memory) return false;
  memory->shared().faults.store(settings);
  return true;
}

int command_stat(std::span<char*> args) {
  std::string only;
  bool reset = false;
  for (char* arg : args) {
    if (is_help(arg)) {
      std::cout << kStatHelp;
      return kExitOk;
    }
    if (std::strcmp(arg, "--reset") == 0) {
      reset = true;
    } else if (arg[0] != '-' && only.empty()) {
      only = arg;
    } else {
      report_error(std::string("stat: unexpected argument '") + arg + "'\n" + kStatHelp);
      return kExitUsage;
    }
  }
  DeviceRegistry registry(default_runtime_dir());
  std::vector<DeviceConfig> devices;
  if (!only.empty()) {
    auto config = find_device(registry, only, "stat");
    if (!config) return kExitFailure;
    devices.push_back(*config);
  } else {
    devices = registry.list();
  }
  if (devices.empty()) {
    std::cout << "no softverbs device is up; start one with `softverbs up`\n";
    return kExitOk;
  }
  for (const DeviceConfig& config : devices) {
    std::string error;
    auto memory = open_device_memory(config, &error);
    if (!memory) {
      report_error("stat: " + error);
      return kExitFailure;
    }
    TransportCounters& counters = memory->shared().counters;
    if (reset) {
      counters.reset();
      std::cout << config.name << ": counters reset\n";
      continue;
    }
    std::cout << config.name << " (transport " << transport_name(config.transport) << "):\n";
    for (size_t i = 0; i < kCounterCount; ++i)
      std::cout << "  " << std::left << std::setw(26) << kCounterNames[i] << counters.get(static_cast<Counter>(i))
                << '\n';
    // What the device holds, once what exited processes left is reclaimed
    // (their user records too).
    memory->reclaim_dead_owners();
    registry.users(config.name);
    const DeviceUsage usage = memory->usage();
    for (const auto& [name, value] : {std::pair<const char*, uint64_t>{"processes", usage.processes},
                                      {"qps", usage.qps},
                                      {"cqs", usage.cqs},
                                      {"srqs", usage.srqs},
                                      {"mrs", usage.mrs},
                                      {"heap_bytes", usage.heap_bytes}})
      std::cout << "  " << std::left << std::setw(26) << name << value << '\n';
  }
  return kExitOk;
}

int command_faults(std::span<char*> args) {
  std::string name = "softverbs0", spec;
  bool named = false, have_spec = false;
  for (char* arg : args) {
    if (is_help(arg)) {
      std::cout << kFaultsHelp;
      return kExitOk;
    }
    // A SPEC has '=' or is "none"; anything else names the device.
    bool looks_like_spec = std::strchr(arg, '=') != nullptr || std::strcmp(arg, "none") == 0;
    if (looks_like_spec && !have_spec) {
      spec = arg;
      have_spec = true;
    } else if (!looks_like_spec && arg[0] != '-' && !named) {
      name = arg;
      named = true;
    } else {
      report_error(std::string("faults: unexpected argument '") + arg + "'\n" + kFaultsHelp);
      return kExitUsage;
    }
  }
  DeviceRegistry registry(default_runtime_dir());
  auto config = find_device(registry, name, "faults");
  if (!config) return kExitFailure;
  std::string error;
  if (!have_spec) {
    auto memory = open_device_memory(*config, &error);
    if (!memory) {
      report_error("faults: " + error);
      return kExitFailure;
    }
    FaultSettings current = memory->shared().faults.load();
    std::cout << config->name << ": " << (current.any() ? current.to_string() : "none") << '\n';
    return kExitOk;
  }
  auto settings = FaultSettings::parse(spec, &error);
  if (!settings) {
    report_error("faults: " + error);
    return kExitUsage;
  }
  RegistryLock lock(registry);
  if (!apply_faults(registry, *config, *settings, &error)) {
    report_error("faults: " + error);
    return kExitFailure;
  }
  std::cout << config->name << ": " << config->faults << '\n';
  return kExitOk;
}

int command_capture(std::span<char*> args) {
  std::string name = "softverbs0", file, duration_text;
  bool named = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const char* arg = args[i];
    if (is_help(arg)) {
      std::cout << kCaptureHelp;
      return kExitOk;
    }
    if ((std::strcmp(arg, "-w") == 0 || std::strcmp(arg, "--duration") == 0)) {
      if (i + 1 >= args.size()) {
        report_error(std::string("capture: ") + arg + " needs a value");
        return kExitUsage;
      }
      (std::strcmp(arg, "-w") == 0 ? file : duration_text) = args[++i];
    } else if (arg[0] != '-' && !named) {
      name = arg;
      named = true;
    } else {
      report_error(std::string("capture: unexpected argument '") + arg + "'\n" + kCaptureHelp);
      return kExitUsage;
    }
  }
  if (file.empty()) {
    report_error(std::string("capture: say where to write with -w FILE\n") + kCaptureHelp);
    return kExitUsage;
  }
  double seconds = 0;
  if (!duration_text.empty()) {
    char* end = nullptr;
    seconds = std::strtod(duration_text.c_str(), &end);
    if (end == duration_text.c_str() || *end != '\0' || !(seconds > 0)) {
      report_error("capture: --duration '" + duration_text + "' is not a positive number of seconds");
      return kExitUsage;
    }
  }
  DeviceRegistry registry(default_runtime_dir());
  auto config = find_device(registry, name, "capture");
  if (!config) return kExitFailure;
  std::string error;
  auto memory = open_device_memory(*config, &error);
  if (!memory) {
    report_error("capture: " + error);
    return kExitFailure;
  }
  fs::path path = fs::absolute(file);
  if (path.string().size() >= sizeof(CaptureControl::path)) {
    report_error("capture: the path " + path.string() + " is too long");
    return kExitUsage;
  }
  if (!create_pcap_file(path, &error)) {
    report_error("capture: " + error);
    return kExitFailure;
  }
  CaptureControl& control = memory->shared().capture;
  if (control.active.load() && control.owner_pid.load() != 0 && kill(control.owner_pid.load(), 0) == 0) {
    report_error("capture: process " + std::to_string(control.owner_pid.load()) + " is already capturing " +
                 config->name + " (to " + control.path + ")");
    return kExitFailure;
  }
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  std::memset(control.path, 0, sizeof control.path);
  std::memcpy(control.path, path.c_str(), path.string().size());
  control.owner_pid.store(getpid());
  control.active.store(1);
  control.generation.fetch_add(1);
  std::cerr << "capturing " << config->name << " to " << path.string() << (seconds > 0 ? "" : " (Ctrl-C to stop)")
            << '\n';
  auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!g_stop && (seconds == 0 || std::chrono::steady_clock::now() < until))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  control.active.store(0);
  control.owner_pid.store(0);
  control.generation.fetch_add(1);
  // Writers finish the record they are writing before they see the change.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::cerr << count_pcap_records(path) << " packets captured\n";
  return kExitOk;
}

}  // namespace softverbs::cli
