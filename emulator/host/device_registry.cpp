#include "host/device_registry.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <system_error>

#include "device/device_limits.h"
#include "device/process_table.h"
#include "support/file_util.h"
#include "support/process_id.h"

namespace softverbs {

namespace fs = std::filesystem;

fs::path default_runtime_dir() {
  if (const char* explicit_dir = std::getenv("SOFTVERBS_RUNTIME_DIR"); explicit_dir && *explicit_dir)
    return explicit_dir;
  if (geteuid() == 0) return "/run/softverbs";
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg && *xdg && access(xdg, W_OK) == 0)
    return fs::path(xdg) / "softverbs";
  return fs::path("/tmp") / ("softverbs-" + std::to_string(geteuid()));
}

DeviceRegistry::DeviceRegistry(fs::path runtime_dir) : runtime_dir_(std::move(runtime_dir)) {}

fs::path DeviceRegistry::record_path(const std::string& name) const {
  return runtime_dir_ / "devices" / (name + ".conf");
}

fs::path DeviceRegistry::users_dir(const std::string& device) const { return runtime_dir_ / "users" / device; }

bool DeviceRegistry::ensure_exists(std::string* error) const {
  for (const fs::path& dir : {runtime_dir_, runtime_dir_ / "devices", runtime_dir_ / "users"}) {
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      if (error) *error = "cannot create " + dir.string() + ": " + std::strerror(errno);
      return false;
    }
  }
  // A directory in /tmp could have been planted by another user.
  struct stat info {};
  if (stat(runtime_dir_.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    if (error) *error = runtime_dir_.string() + " is not a directory";
    return false;
  }
  if (info.st_uid != geteuid()) {
    if (error) *error = runtime_dir_.string() + " belongs to another user (uid " + std::to_string(info.st_uid) + ")";
    return false;
  }
  return true;
}

std::vector<DeviceConfig> DeviceRegistry::list() const {
  std::vector<DeviceConfig> devices;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(runtime_dir_ / "devices", ec)) {
    if (entry.path().extension() != ".conf") continue;
    auto text = read_text_file(entry.path());
    if (!text) continue;
    if (auto config = DeviceConfig::parse(*text, nullptr)) devices.push_back(std::move(*config));
  }
  std::sort(devices.begin(), devices.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return devices;
}

std::optional<DeviceConfig> DeviceRegistry::find(const std::string& name) const {
  if (!is_valid_device_name(name)) return std::nullopt;
  auto text = read_text_file(record_path(name));
  if (!text) return std::nullopt;
  return DeviceConfig::parse(*text, nullptr);
}

bool DeviceRegistry::save(const DeviceConfig& config, std::string* error) const {
  if (!ensure_exists(error)) return false;
  fs::path final_path = record_path(config.name);
  fs::path temporary = final_path;
  temporary += ".tmp";
  if (!write_text_file(temporary, config.serialize()) || rename(temporary.c_str(), final_path.c_str()) != 0) {
    if (error) *error = "cannot write " + final_path.string() + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

bool DeviceRegistry::remove(const std::string& name, std::string* error) const {
  if (unlink(record_path(name).c_str()) != 0) {
    if (error) *error = "cannot remove " + record_path(name).string() + ": " + std::strerror(errno);
    return false;
  }
  // Its users' contexts died with it (see `softverbs down`).
  std::error_code ec;
  fs::remove_all(users_dir(name), ec);
  return true;
}

int DeviceRegistry::allocate_uverbs_index(const std::string& for_device, const fs::path& real_sysfs) const {
  std::set<int> taken;
  for (const auto& device : list()) {
    if (device.name == for_device) return device.uverbs_index;  // keep a device's index stable
    taken.insert(device.uverbs_index);
  }
  for (int index = limits::kFirstUverbsIndex; index < limits::kFirstUverbsIndex + limits::kMaxDevices; ++index) {
    if (taken.count(index)) continue;
    std::error_code ec;
    if (fs::exists(real_sysfs / "class/infiniband_verbs" / ("uverbs" + std::to_string(index)), ec)) continue;
    return index;
  }
  return -1;
}

namespace {

// A user record's first line names the process's start time: with the pid
// it names one process for good, where a pid alone may be reused.
constexpr std::string_view kStartTimeKey = "start_time=";

}  // namespace

void DeviceRegistry::register_user(const std::string& device, pid_t pid,
                                   const std::vector<std::string>& async_sockets) const {
  fs::path dir = users_dir(device);
  mkdir((runtime_dir_ / "users").c_str(), 0700);
  mkdir(dir.c_str(), 0700);
  std::string lines = std::string(kStartTimeKey) + std::to_string(process_start_time(pid)) + "\n";
  for (const auto& name : async_sockets) lines += name + "\n";
  write_text_file(dir / std::to_string(pid), lines);
  users(device);  // removes the records of processes that have exited
}

void DeviceRegistry::unregister_user(const std::string& device, pid_t pid) const {
  unlink((users_dir(device) / std::to_string(pid)).c_str());
}

std::vector<DeviceUser> DeviceRegistry::users(const std::string& device) const {
  std::vector<DeviceUser> users;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(users_dir(device), ec)) {
    const std::string name = entry.path().filename();
    char* end = nullptr;
    long pid = std::strtol(name.c_str(), &end, 10);
    if (end == nullptr || *end != '\0' || pid <= 0) continue;
    std::string lines = read_text_file(entry.path()).value_or("");
    DeviceUser user;
    uint64_t start_time = 0;
    for (size_t start = 0; start < lines.size();) {
      size_t end = lines.find('\n', start);
      if (end == std::string::npos) end = lines.size();
      const std::string line = lines.substr(start, end - start);
      if (line.rfind(kStartTimeKey, 0) == 0)
        start_time = std::strtoull(line.c_str() + kStartTimeKey.size(), nullptr, 10);
      else if (!line.empty())
        user.async_sockets.push_back(line);
      start = end + 1;
    }
    // Gone, or its pid now names another process.
    if (!process_alive(static_cast<pid_t>(pid)) ||
        (start_time != 0 && process_start_time(static_cast<pid_t>(pid)) != start_time)) {
      unlink(entry.path().c_str());
      continue;
    }
    user.pid = static_cast<pid_t>(pid);
    user.command = read_first_line(fs::path("/proc") / std::to_string(pid) / "comm").value_or("?");
    users.push_back(std::move(user));
  }
  std::sort(users.begin(), users.end(), [](const auto& a, const auto& b) { return a.pid < b.pid; });
  return users;
}

RegistryLock::RegistryLock(const DeviceRegistry& registry) {
  fd_ = open((registry.runtime_dir() / "lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ >= 0) flock(fd_, LOCK_EX);
}

RegistryLock::~RegistryLock() {
  if (fd_ >= 0) close(fd_);
}

}  // namespace softverbs
