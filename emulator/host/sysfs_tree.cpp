#include "host/sysfs_tree.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>

#include "device/device_limits.h"
#include "support/file_util.h"

namespace softverbs {

namespace fs = std::filesystem;

namespace {

// The numbers of the device's uverbs node, which is /dev/null (see the
// CLI's sandbox): libibverbs opens it as the device's, and
// ibv_import_device finds the device behind a context's descriptor (and
// answers that importing is not supported). 0:0 where it cannot be read:
// any character device is then accepted.
std::string null_device_numbers() {
  struct stat info {};
  if (stat("/dev/null", &info) != 0 || !S_ISCHR(info.st_mode)) return "0:0";
  return std::to_string(major(info.st_rdev)) + ":" + std::to_string(minor(info.st_rdev));
}

class TreeWriter {
 public:
  explicit TreeWriter(std::string* error) : error_(error) {}

  bool ok() const { return ok_; }

  void directory(const fs::path& path) {
    if (!ok_) return;
    std::error_code ec;
    fs::create_directories(path, ec);
    if (ec) fail(path, ec.message());
  }

  void file(const fs::path& path, std::string_view contents) {
    if (ok_ && !write_text_file(path, contents)) fail(path, std::strerror(errno));
  }

  // For a tree that programs may be reading: a file that already says
  // `contents` is left alone, another is replaced whole (written aside and
  // renamed), so a reader never sees it empty or half written.
  void replace_file(const fs::path& path, std::string_view contents) {
    if (!ok_ || read_text_file(path) == std::optional<std::string>(contents)) return;
    fs::path aside = path;
    aside += ".new-" + std::to_string(getpid());
    std::error_code ec;
    if (!write_text_file(aside, contents)) return fail(aside, std::strerror(errno));
    fs::rename(aside, path, ec);
    if (ec) {
      fs::remove(aside, ec);
      fail(path, ec.message());
    }
  }

  void symlink(const fs::path& target, const fs::path& link) {
    if (!ok_) return;
    std::error_code ec;
    fs::remove(link, ec);
    fs::create_symlink(target, link, ec);
    if (ec) fail(link, ec.message());
  }

 private:
  void fail(const fs::path& path, const std::string& why) {
    ok_ = false;
    if (error_) *error_ = "cannot write " + path.string() + ": " + why;
  }

  std::string* error_;
  bool ok_ = true;
};

const char* port_state_text(PortState state) {
  switch (state) {
    case PortState::Down:
      return "1: DOWN";
    case PortState::Init:
      return "2: INIT";
    case PortState::Armed:
      return "3: ARMED";
    case PortState::Active:
      break;
  }
  return "4: ACTIVE";
}

void write_port(TreeWriter& tree, const fs::path& port_dir, const DeviceConfig& config,
                const std::vector<GidEntry>& gids) {
  PortAttributes port = port_attributes(config);
  tree.directory(port_dir / "gids");
  tree.directory(port_dir / "pkeys");
  tree.directory(port_dir / "gid_attrs/types");
  tree.directory(port_dir / "gid_attrs/ndevs");
  tree.file(port_dir / "state", std::string(port_state_text(port.state)) + "\n");
  tree.file(port_dir / "phys_state", port.physical_state == PortPhysicalState::LinkUp ? "5: LinkUp\n" : "2: Polling\n");
  tree.file(port_dir / "link_layer", port.link_layer_ethernet ? "Ethernet\n" : "InfiniBand\n");
  tree.file(port_dir / "lid", "0x0\n");
  tree.file(port_dir / "sm_lid", "0x0\n");
  tree.file(port_dir / "lid_mask_count", "0\n");
  tree.file(port_dir / "sm_sl", "0\n");
  tree.file(port_dir / "rate", "100 Gb/sec (4X EDR)\n");
  tree.file(port_dir / "cap_mask", "0x04010000\n");  // CM supported, IP-based GIDs
  tree.file(port_dir / "pkeys/0", "0xffff\n");
  // libibverbs reads every index below gid_tbl_len: all entries exist, the
  // unused ones zero, as the kernel presents them.
  for (int index = 0; index < port.gid_table_length; ++index) {
    std::string name = std::to_string(index);
    bool used = static_cast<size_t>(index) < gids.size();
    tree.file(port_dir / "gids" / name, (used ? gids[index].gid : Gid{}).to_sysfs_string() + "\n");
    tree.file(port_dir / "gid_attrs/types" / name,
              std::string(gid_type_sysfs_name(used ? gids[index].type : GidType::RoceV1)) + "\n");
    tree.file(port_dir / "gid_attrs/ndevs" / name, used ? gids[index].netdev + "\n" : "");
  }
}

}  // namespace

std::vector<GidEntry> read_gid_table(const fs::path& device_dir, const std::string& netdev) {
  std::vector<GidEntry> table;
  fs::path port_dir = device_dir / "ports/1";
  for (int index = 0; index < limits::kGidTableLength; ++index) {
    std::string name = std::to_string(index);
    std::ifstream gid_file(port_dir / "gids" / name), type_file(port_dir / "gid_attrs/types" / name);
    std::string gid_text, type_text;
    if (!std::getline(gid_file, gid_text)) break;
    std::getline(type_file, type_text);
    GidEntry entry;
    if (auto gid = Gid::from_sysfs_string(gid_text)) entry.gid = *gid;
    entry.type = type_text == gid_type_sysfs_name(GidType::RoceV2) ? GidType::RoceV2 : GidType::RoceV1;
    entry.netdev = netdev;
    table.push_back(entry);
  }
  return table;
}

bool write_device_tree(const fs::path& sysfs_root, const DeviceConfig& config, const std::vector<GidEntry>& gids,
                       std::string* error) {
  TreeWriter tree(error);
  fs::path verbs_class = sysfs_root / "class/infiniband_verbs";
  fs::path ib_class = sysfs_root / "class/infiniband";
  tree.directory(verbs_class);
  tree.directory(ib_class);
  tree.file(verbs_class / "abi_version", "6\n");

  fs::path staging = ib_class / ("." + config.name + ".new-" + std::to_string(getpid()));
  std::error_code ec;
  fs::remove_all(staging, ec);
  tree.directory(staging);
  tree.file(staging / "node_type", "1: CA\n");
  tree.file(staging / "node_guid", format_guid(config.node_guid) + "\n");
  tree.file(staging / "sys_image_guid", format_guid(config.node_guid) + "\n");
  tree.file(staging / "board_id", std::string(limits::kBoardId) + "\n");
  tree.file(staging / "fw_ver", std::string(limits::kFirmwareVersion) + "\n");
  tree.file(staging / "hca_type", "softverbs\n");
  tree.file(staging / "node_desc", "softverbs " + config.name + "\n");
  tree.file(staging / kDeviceConfigFile, config.serialize());
  tree.directory(staging / "device/net");
  tree.file(staging / "device/modalias", std::string(kModaliasPrefix) + config.name + "\n");
  tree.symlink(fs::path("/sys/class/net") / config.netdev, staging / "device/net" / config.netdev);
  write_port(tree, staging / "ports/1", config, gids);
  if (!tree.ok()) {
    fs::remove_all(staging, ec);
    return false;
  }
  // Swap the new directory in. Its mtime becomes the device's identity for
  // libibverbs, so a refreshed device is seen as a new one.
  fs::path final_dir = ib_class / config.name;
  fs::path old_dir = ib_class / ("." + config.name + ".old-" + std::to_string(getpid()));
  if (fs::exists(final_dir, ec)) fs::rename(final_dir, old_dir, ec);
  fs::rename(staging, final_dir, ec);
  if (ec) {
    if (error) *error = "cannot install " + final_dir.string() + ": " + ec.message();
    return false;
  }
  fs::remove_all(old_dir, ec);
  return write_uverbs_entry(sysfs_root, config, error);
}

bool write_uverbs_entry(const fs::path& sysfs_root, const DeviceConfig& config, std::string* error) {
  TreeWriter tree(error);
  fs::path uverbs_dir = sysfs_root / "class/infiniband_verbs" / config.uverbs_name();
  tree.directory(uverbs_dir);
  tree.replace_file(uverbs_dir / "ibdev", config.name + "\n");
  tree.replace_file(uverbs_dir / "dev", null_device_numbers() + "\n");
  tree.replace_file(uverbs_dir / "abi_version", std::to_string(limits::kUverbsAbiVersion) + "\n");
  return tree.ok();
}

void remove_device_tree(const fs::path& sysfs_root, const DeviceConfig& config) {
  std::error_code ec;
  fs::remove_all(sysfs_root / "class/infiniband" / config.name, ec);
  fs::remove_all(sysfs_root / "class/infiniband_verbs" / config.uverbs_name(), ec);
}

void link_real_devices(const fs::path& sysfs_root, const fs::path& real_sysfs) {
  for (const char* class_name : {"infiniband", "infiniband_verbs"}) {
    fs::path ours = sysfs_root / "class" / class_name;
    fs::path theirs = real_sysfs / "class" / class_name;
    std::error_code ec;
    fs::create_directories(ours, ec);
    // Drop links to devices that have gone.
    for (const auto& entry : fs::directory_iterator(ours, ec)) {
      if (entry.is_symlink(ec) && !fs::exists(entry.path(), ec)) fs::remove(entry.path(), ec);
    }
    for (const auto& entry : fs::directory_iterator(theirs, ec)) {
      std::string name = entry.path().filename();
      if (name == "abi_version") continue;
      fs::path link = ours / name;
      std::error_code exists_ec;
      if (fs::exists(fs::symlink_status(link, exists_ec))) continue;  // never shadow one of ours
      fs::path target = fs::canonical(entry.path(), exists_ec);
      if (exists_ec) continue;
      fs::create_symlink(target, link, exists_ec);
    }
  }
}

}  // namespace softverbs
