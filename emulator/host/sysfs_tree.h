// Generation of the sysfs tree through which stock libibverbs discovers
// softverbs devices (see docs/how-it-works.md): class/infiniband_verbs/<uverbs>
// and class/infiniband/<device> with its port, GID and P_Key tables.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "device/device_attributes.h"
#include "host/device_config.h"

namespace softverbs {

// Name of the file in a device's sysfs directory that holds its DeviceConfig;
// the provider reads it to learn everything about the device it opens.
inline constexpr const char* kDeviceConfigFile = "softverbs.conf";
// What device/modalias holds; the provider's match table matches this prefix.
inline constexpr const char* kModaliasPrefix = "softverbs:";

// (Re)writes the device's entries under `sysfs_root`. The device directory is
// built aside and renamed into place, so a reader sees the old or the new tree.
bool write_device_tree(const std::filesystem::path& sysfs_root, const DeviceConfig& config,
                       const std::vector<GidEntry>& gids, std::string* error);

// The GID table as a device directory of the tree (class/infiniband/<name>)
// holds it, which is what ibv_query_gid reports: one entry per index,
// unused entries with a zero GID. Empty if unreadable.
std::vector<GidEntry> read_gid_table(const std::filesystem::path& device_dir, const std::string& netdev);

// The device's uverbs entry (class/infiniband_verbs/uverbsN); `run` rewrites
// it as well, so that a device brought up by an older softverbs gets today's.
bool write_uverbs_entry(const std::filesystem::path& sysfs_root, const DeviceConfig& config, std::string* error);

void remove_device_tree(const std::filesystem::path& sysfs_root, const DeviceConfig& config);

// Mirrors the real RDMA devices of `real_sysfs` into the tree as symlinks, so
// that programs which see the generated tree instead of the real one still
// find the host's HCAs next to the softverbs devices. Removes links whose
// device has gone.
void link_real_devices(const std::filesystem::path& sysfs_root, const std::filesystem::path& real_sysfs);

}  // namespace softverbs
