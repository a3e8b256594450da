// The per-host registry of emulated devices: one directory (the runtime
// directory) holding a record per device, the generated sysfs tree that
// libibverbs reads, and the list of processes using each device.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "host/device_config.h"

namespace softverbs {

// $SOFTVERBS_RUNTIME_DIR if set; else /run/softverbs for root; else
// $XDG_RUNTIME_DIR/softverbs; else /tmp/softverbs-<uid>.
std::filesystem::path default_runtime_dir();

struct DeviceUser {
  pid_t pid = 0;
  std::string command;                     // /proc/<pid>/comm
  std::vector<std::string> async_sockets;  // one per open context (abstract names)
};

class DeviceRegistry {
 public:
  explicit DeviceRegistry(std::filesystem::path runtime_dir);

  const std::filesystem::path& runtime_dir() const { return runtime_dir_; }
  std::filesystem::path sysfs_root() const { return runtime_dir_ / "sysfs"; }
  std::filesystem::path record_path(const std::string& name) const;

  // Creates the runtime directory (mode 0700 unless it exists). False and a
  // message on failure.
  bool ensure_exists(std::string* error) const;

  std::vector<DeviceConfig> list() const;
  std::optional<DeviceConfig> find(const std::string& name) const;
  bool save(const DeviceConfig& config, std::string* error) const;
  bool remove(const std::string& name, std::string* error) const;

  // The lowest uverbs index from kFirstUverbsIndex up that neither another
  // softverbs device nor a real device (under `real_sysfs`) uses.
  int allocate_uverbs_index(const std::string& for_device, const std::filesystem::path& real_sysfs) const;

  // Processes that opened the device: a file per pid, written by the
  // provider, listing the async event socket of each of its open contexts.
  void register_user(const std::string& device, pid_t pid, const std::vector<std::string>& async_sockets = {}) const;
  void unregister_user(const std::string& device, pid_t pid) const;
  // Live users only; records of processes that have exited are removed.
  std::vector<DeviceUser> users(const std::string& device) const;

 private:
  std::filesystem::path users_dir(const std::string& device) const;

  std::filesystem::path runtime_dir_;
};

// Holds an exclusive flock on the registry while devices are created or
// removed, so that concurrent `softverbs up` calls do not pick the same index.
class RegistryLock {
 public:
  explicit RegistryLock(const DeviceRegistry& registry);
  ~RegistryLock();
  RegistryLock(const RegistryLock&) = delete;
  RegistryLock& operator=(const RegistryLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace softverbs
