// The verbs of the `softverbs` command. Each returns the process exit code:
// 0 success, 1 the operation failed, 2 bad usage.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "host/device_config.h"
#include "host/device_registry.h"
#include "udp/fault_injection.h"

namespace softverbs::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// What each command was given, parsed and checked by the command line
// (main.cpp, CLI11).
struct UpOptions {
  std::string name = "softverbs0";
  std::string netdev = "lo";
  std::optional<TransportChoice> transport;  // none: keep the device's
  std::optional<std::string> faults;         // a checked SPEC; none: keep
};
struct DownOptions {
  std::string name = "softverbs0";
  bool all = false;
};
// --check: the verbs checker (docs/checking.md); Error also makes the exit
// status non-zero if anything was reported.
enum class CheckMode { Off, Report, Error };
struct RunOptions {
  bool use_namespace = true;
  std::optional<std::string> trace_file;     // --trace: as `softverbs trace -o FILE`
  std::optional<uint64_t> adversarial_seed;  // --adversarial[=SEED]: SOFTVERBS_ADVERSARIAL for CMD
  std::vector<std::string> command;
  CheckMode check = CheckMode::Off;
  std::string check_report;  // --check-report FILE; empty: none
  bool rsockets = false;     // --rsockets: librspreload.so first in LD_PRELOAD
};
struct TraceOptions {
  std::string file;
  std::vector<std::string> command;
};
struct DiffOptions {
  std::string a, b;
};
struct StatOptions {
  std::string name;  // empty: every device
  bool reset = false;
};
struct FaultsOptions {
  std::string name = "softverbs0";
  std::optional<std::string> spec;  // none: show the current settings
};
struct CaptureOptions {
  std::string name = "softverbs0";
  std::string file;
  double seconds = 0;  // 0: until interrupted
};

int command_up(const UpOptions& options);
int command_down(const DownOptions& options);
int command_status(const std::string& name);  // empty: every device
int command_env();
int command_run(const RunOptions& options);
int command_trace(const TraceOptions& options);
int command_diff(const DiffOptions& options);  // 0 equal, 1 different, 2 trouble (as diff(1))
int command_stat(const StatOptions& options);

// Sets this process's environment so that the program it execs is traced
// into `file` (LD_PRELOAD and the trace variables); false and a message if
// the trace library is missing or `file` cannot be written.
bool prepare_trace(const std::string& file, const std::filesystem::path& library, std::string* error);
int command_faults(const FaultsOptions& options);
int command_capture(const CaptureOptions& options);

// The device's CM watcher (cm_watcher.cpp), started detached where the
// device carries UDP and none lives; and the watcher itself.
void start_cm_watcher(const DeviceConfig& config);
int command_cm_watcher(const std::string& name);
// The watcher's process, if one lives.
std::optional<pid_t> cm_watcher_pid(const DeviceConfig& config);
// Whether the device's traffic goes over UDP (its transport, or Auto on a
// netdev that is not loopback, as the provider decides).
bool carries_udp(const DeviceConfig& config);

// Creates or refreshes a device: registry record, sysfs tree and, for root,
// the /dev/infiniband entry. nullopt and a message on failure.
// A transport or fault setting not given keeps the device's current one
// (auto and none for a new device).
std::optional<DeviceConfig> bring_up(const DeviceRegistry& registry, const std::string& name, const std::string& netdev,
                                     std::optional<TransportChoice> transport, std::string* error,
                                     const std::optional<std::string>& faults = std::nullopt);

// Stores fault settings in the device's record and in its device memory,
// where running processes see them at once. False and a message on failure.
bool apply_faults(const DeviceRegistry& registry, DeviceConfig& config, const FaultSettings& settings,
                  std::string* error);

// The devices that are up; brings up the default device first if none is.
std::optional<std::vector<DeviceConfig>> devices_or_default(const DeviceRegistry& registry, std::string* error);

// Why `name` cannot name a device, or why there is no network device
// `netdev` here (naming those there are); empty if it can, or there is.
std::string device_name_problem(const std::string& name);
std::string netdev_problem(const std::string& netdev);

// Prints "softverbs: <message>" to stderr.
void report_error(const std::string& message);

}  // namespace softverbs::cli
