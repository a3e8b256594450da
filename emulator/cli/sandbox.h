// Presenting softverbs devices to an unmodified program: the environment it
// needs, and a mount namespace in which the generated sysfs tree appears at
// /sys/class/infiniband{,_verbs} and /dev/infiniband/<uverbs> exists.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "host/device_config.h"
#include "host/device_registry.h"
#include "library_paths.h"

namespace softverbs::cli {

using Environment = std::vector<std::pair<std::string, std::string>>;

// `first` put at the front of the list in $variable (once: a list that has
// it already is kept as it is).
std::string prepend_path_list(const char* variable, const std::string& first, char separator);

// Variables a program needs. `namespaced`: the tree is mounted at /sys, so
// SYSFS_PATH is not needed.
Environment sandbox_environment(const DeviceRegistry& registry, const LibraryPaths& libraries, bool namespaced);

// As root: /dev/infiniband/<uverbs> as a link to /dev/null (libibverbs only
// needs a character device it can open).
bool ensure_dev_entry(const DeviceConfig& config, std::string* error);
bool dev_entries_exist(const std::vector<DeviceConfig>& devices);

enum class NamespaceOutcome {
  Entered,      // this process now runs in the namespace
  Unavailable,  // the kernel refused a namespace; nothing changed
  Failed,       // set up half-way: the process must not go on
};

// Moves the calling process into a new mount namespace (and, when not root,
// a user namespace that maps the caller's uid and gid to themselves) and
// mounts the tree. `error` explains Unavailable and Failed.
NamespaceOutcome enter_device_namespace(const DeviceRegistry& registry, const std::vector<DeviceConfig>& devices,
                                        std::string* error);

}  // namespace softverbs::cli
