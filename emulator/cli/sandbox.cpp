#include "sandbox.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "support/file_util.h"

namespace softverbs::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kHostDevDir = ".softverbs-host";

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

bool bind(const fs::path& source, const fs::path& target, std::string* error) {
  if (mount(source.c_str(), target.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) {
    *error = errno_text("cannot bind " + source.string() + " on " + target.string());
    return false;
  }
  return true;
}

bool make_dir(const fs::path& path, std::string* error) {
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    *error = errno_text("cannot create " + path.string());
    return false;
  }
  return true;
}

bool mount_tmpfs(const fs::path& target, std::string* error) {
  if (mount("softverbs", target.c_str(), "tmpfs", MS_NOSUID, "mode=0755") != 0) {
    *error = errno_text("cannot mount a tmpfs on " + target.string());
    return false;
  }
  return true;
}

bool move_mount(const fs::path& source, const fs::path& target, std::string* error) {
  if (mount(source.c_str(), target.c_str(), nullptr, MS_MOVE, nullptr) != 0) {
    *error = errno_text("cannot move " + source.string() + " to " + target.string());
    return false;
  }
  return true;
}

bool write_proc(const char* path, const std::string& contents, std::string* error) {
  if (!write_text_file(path, contents)) {
    *error = errno_text(std::string("cannot write ") + path);
    return false;
  }
  return true;
}

// /sys/class with the real classes bound back in and our two classes in front.
bool overlay_sys_class(const DeviceRegistry& registry, const fs::path& staging, std::string* error) {
  fs::path layer = staging / "class";
  if (!make_dir(layer, error) || !mount_tmpfs(layer, error)) return false;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/sys/class", ec)) {
    std::string name = entry.path().filename();
    if (name == "infiniband" || name == "infiniband_verbs") continue;
    if (!make_dir(layer / name, error) || !bind(entry.path(), layer / name, error)) return false;
  }
  for (const char* name : {"infiniband", "infiniband_verbs"}) {
    if (!make_dir(layer / name, error) || !bind(registry.sysfs_root() / "class" / name, layer / name, error))
      return false;
  }
  if (!move_mount(layer, "/sys/class", error)) return false;
  rmdir(layer.c_str());
  return true;
}

// A /dev in which every host entry is a link into a bind of the real /dev,
// plus infiniband/<uverbs>. Only needed where /dev cannot be written.
bool overlay_dev(const std::vector<DeviceConfig>& devices, const fs::path& staging, std::string* error) {
  fs::path layer = staging / "dev";
  if (!make_dir(layer, error) || !mount_tmpfs(layer, error)) return false;
  fs::path host = layer / kHostDevDir;
  if (!make_dir(host, error) || !bind("/dev", host, error)) return false;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/dev", ec)) {
    std::string name = entry.path().filename();
    if (name == "infiniband") continue;
    fs::path link = layer / name;
    std::error_code link_ec;
    if (entry.is_symlink(link_ec)) {
      fs::create_symlink(fs::read_symlink(entry.path(), link_ec), link, link_ec);
    } else {
      fs::create_symlink(fs::path(kHostDevDir) / name, link, link_ec);
    }
  }
  if (!make_dir(layer / "infiniband", error)) return false;
  for (const auto& real : fs::directory_iterator("/dev/infiniband", ec)) {
    std::error_code link_ec;
    fs::create_symlink(fs::path("..") / kHostDevDir / "infiniband" / real.path().filename(),
                       layer / "infiniband" / real.path().filename(), link_ec);
  }
  for (const auto& config : devices) {
    std::error_code link_ec;
    fs::create_symlink(fs::path("..") / kHostDevDir / "null", layer / "infiniband" / config.uverbs_name(), link_ec);
  }
  if (!move_mount(layer, "/dev", error)) return false;
  rmdir(layer.c_str());
  return true;
}

}  // namespace

std::string prepend_path_list(const char* variable, const std::string& first, char separator) {
  const char* existing = std::getenv(variable);
  if (existing == nullptr || *existing == '\0') return first;
  std::string list = existing;
  // Keep it idempotent: nested `softverbs run` calls add nothing new.
  std::string padded = std::string(1, separator) + list + separator;
  if (padded.find(std::string(1, separator) + first + separator) != std::string::npos) return list;
  return first + separator + list;
}

Environment sandbox_environment(const DeviceRegistry& registry, const LibraryPaths& libraries, bool namespaced) {
  Environment environment;
  if (!namespaced) environment.emplace_back("SYSFS_PATH", registry.sysfs_root().string());
  environment.emplace_back("RDMAV_DRIVERS", libraries.provider_stem);
  std::string preloads = libraries.preload.string();
  // Check mode: the check preload (munmap and free of registered memory),
  // which lives next to the preload.
  if (std::getenv("SOFTVERBS_CHECK") != nullptr) preloads += ":" + check_preload_path(libraries).string();
  environment.emplace_back("LD_PRELOAD", prepend_path_list("LD_PRELOAD", preloads, ':'));
  // Our librdmacm.so.1 first: rdma_cm programs get the emulated CM (which
  // hands over to the real library where a kernel rdma_cm exists).
  environment.emplace_back("LD_LIBRARY_PATH", prepend_path_list("LD_LIBRARY_PATH", libraries.rdmacm_dir.string(), ':'));
  environment.emplace_back("SOFTVERBS_RUNTIME_DIR", registry.runtime_dir().string());
  return environment;
}

bool ensure_dev_entry(const DeviceConfig& config, std::string* error) {
  fs::path entry = fs::path("/dev/infiniband") / config.uverbs_name();
  std::error_code ec;
  if (fs::exists(entry, ec)) return true;
  if (mkdir("/dev/infiniband", 0755) != 0 && errno != EEXIST) {
    *error = errno_text("cannot create /dev/infiniband");
    return false;
  }
  fs::create_symlink("/dev/null", entry, ec);
  if (ec) {
    *error = "cannot create " + entry.string() + ": " + ec.message();
    return false;
  }
  return true;
}

bool dev_entries_exist(const std::vector<DeviceConfig>& devices) {
  for (const auto& config : devices) {
    std::error_code ec;
    if (!fs::exists(fs::path("/dev/infiniband") / config.uverbs_name(), ec)) return false;
  }
  return true;
}

NamespaceOutcome enter_device_namespace(const DeviceRegistry& registry, const std::vector<DeviceConfig>& devices,
                                        std::string* error) {
  uid_t uid = geteuid();
  gid_t gid = getegid();
  bool root = uid == 0;
  if (unshare(root ? CLONE_NEWNS : (CLONE_NEWUSER | CLONE_NEWNS)) != 0) {
    *error = errno_text(root ? "unshare(CLONE_NEWNS)" : "unshare(CLONE_NEWUSER|CLONE_NEWNS)");
    return NamespaceOutcome::Unavailable;
  }
  if (!root) {
    // Map the caller to itself: inside, the program runs as the same user.
    if (!write_proc("/proc/self/setgroups", "deny", error) ||
        !write_proc("/proc/self/uid_map", std::to_string(uid) + " " + std::to_string(uid) + " 1", error) ||
        !write_proc("/proc/self/gid_map", std::to_string(gid) + " " + std::to_string(gid) + " 1", error))
      return NamespaceOutcome::Failed;
  }
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    // Seen where a security module confines user namespaces (Ubuntu 24.04's
    // AppArmor policy): the namespace exists but grants no mount rights.
    *error = errno_text("cannot make mounts private in the new namespace");
    return NamespaceOutcome::Failed;
  }
  fs::path staging = registry.runtime_dir() / "ns" / std::to_string(getpid());
  std::error_code ec;
  fs::create_directories(staging, ec);
  if (ec) {
    *error = "cannot create " + staging.string() + ": " + ec.message();
    return NamespaceOutcome::Failed;
  }
  bool ok = overlay_sys_class(registry, staging, error);
  if (ok && !root && !dev_entries_exist(devices)) ok = overlay_dev(devices, staging, error);
  // Never delete recursively here: a half-built layer holds binds of the real
  // /dev and /sys. Detach whatever is left, then remove the empty directories.
  for (const char* layer : {"class", "dev"}) {
    fs::path path = staging / layer;
    umount2(path.c_str(), MNT_DETACH);
    rmdir(path.c_str());
  }
  // Only our own directory: "ns" is shared with concurrent `softverbs run`s.
  rmdir(staging.c_str());
  return ok ? NamespaceOutcome::Entered : NamespaceOutcome::Failed;
}

}  // namespace softverbs::cli
