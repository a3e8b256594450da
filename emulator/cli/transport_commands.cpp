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

int command_stat(const StatOptions& options) {
  const std::string& only = options.name;
  const bool reset = options.reset;
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

int command_faults(const FaultsOptions& options) {
  const std::string& name = options.name;
  const bool have_spec = options.spec.has_value();
  const std::string spec = options.spec.value_or("");
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

int command_capture(const CaptureOptions& options) {
  const std::string& name = options.name;
  const std::string& file = options.file;
  const double seconds = options.seconds;
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
