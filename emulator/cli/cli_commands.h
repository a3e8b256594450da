// The verbs of the `softverbs` command. Each returns the process exit code:
// 0 success, 1 the operation failed, 2 bad usage.
#pragma once

#include <optional>
#include <span>
#include <string>

#include "host/device_config.h"
#include "host/device_registry.h"
#include "udp/fault_injection.h"

namespace softverbs::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

int command_up(std::span<char*> args);
int command_down(std::span<char*> args);
int command_status(std::span<char*> args);
int command_env(std::span<char*> args);
int command_run(std::span<char*> args);
int command_stat(std::span<char*> args);
int command_faults(std::span<char*> args);
int command_capture(std::span<char*> args);

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

// Prints "softverbs: <message>" to stderr.
void report_error(const std::string& message);

}  // namespace softverbs::cli
