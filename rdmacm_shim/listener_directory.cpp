#include "listener_directory.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <random>
#include <string>
#include <system_error>

#include "support/file_util.h"

namespace softverbs::cm {

namespace fs = std::filesystem;

namespace {

bool alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

struct Entry {
  pid_t pid = 0;
};

std::optional<Entry> read_entry(const fs::path& path) {
  auto text = read_first_line(path);
  if (!text) return std::nullopt;
  int pid = 0;
  if (std::sscanf(text->c_str(), "%d", &pid) != 1 || pid <= 0) return std::nullopt;
  return Entry{pid};
}

// A live entry at `path`; stale (and unreadable) ones are removed.
std::optional<Entry> live_entry(const fs::path& path) {
  auto entry = read_entry(path);
  if (entry && alive(entry->pid)) return entry;
  unlink(path.c_str());
  return std::nullopt;
}

sockaddr_storage wildcard_like(const sockaddr_storage& address) {
  sockaddr_storage wildcard{};
  wildcard.ss_family = address.ss_family;
  if (address.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in&>(wildcard).sin_port = reinterpret_cast<const sockaddr_in&>(address).sin_port;
  else
    reinterpret_cast<sockaddr_in6&>(wildcard).sin6_port = reinterpret_cast<const sockaddr_in6&>(address).sin6_port;
  return wildcard;
}

std::string hex(const uint8_t* bytes, size_t length) {
  std::string text;
  char pair[3];
  for (size_t i = 0; i < length; ++i) {
    std::snprintf(pair, sizeof pair, "%02x", bytes[i]);
    text += pair;
  }
  return text;
}

}  // namespace

std::string address_key(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    return "4-" + hex(reinterpret_cast<const uint8_t*>(&in.sin_addr), 4) + "-" + std::to_string(ntohs(in.sin_port));
  }
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
  return "6-" + hex(in6.sin6_addr.s6_addr, 16) + "-" + std::to_string(ntohs(in6.sin6_port));
}

uint16_t port_of(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
}

bool is_wildcard(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) return reinterpret_cast<const sockaddr_in&>(address).sin_addr.s_addr == INADDR_ANY;
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
  return IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr);
}

ListenerDirectory::ListenerDirectory(fs::path runtime_dir) : dir_(std::move(runtime_dir) / "cm") {
  mkdir(dir_.parent_path().c_str(), 0700);
  mkdir(dir_.c_str(), 0700);
}

fs::path ListenerDirectory::entry_path(const sockaddr_storage& address) const { return dir_ / address_key(address); }

int ListenerDirectory::claim(const sockaddr_storage& address) {
  // A wildcard listener conflicts with every listener on its port, and the
  // other way round.
  std::string suffix = "-" + std::to_string(port_of(address));
  std::string family = address.ss_family == AF_INET ? "4-" : "6-";
  std::string mine = address_key(address);
  std::string wildcard = address_key(wildcard_like(address));
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    std::string name = entry.path().filename();
    if (name.rfind(family, 0) != 0 || name.size() < suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    bool conflicts = name == mine || name == wildcard || is_wildcard(address);
    if (conflicts && live_entry(entry.path())) return EADDRINUSE;
  }
  fs::path path = entry_path(address);
  fs::path temporary = path;
  temporary += ".tmp-" + std::to_string(getpid());
  if (!write_text_file(temporary, std::to_string(getpid()) + "\n")) return errno;
  // link() fails if a listener got there first: the claim is atomic.
  int result = link(temporary.c_str(), path.c_str()) == 0 ? 0 : EADDRINUSE;
  unlink(temporary.c_str());
  return result;
}

void ListenerDirectory::release(const sockaddr_storage& address) {
  fs::path path = entry_path(address);
  if (auto entry = read_entry(path); entry && entry->pid == getpid()) unlink(path.c_str());
}

uint16_t ListenerDirectory::free_port() {
  std::random_device random;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    uint16_t port = static_cast<uint16_t>(49152 + random() % 16384);
    std::string suffix = "-" + std::to_string(port);
    bool used = false;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
      std::string name = entry.path().filename();
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        used = used || live_entry(entry.path()).has_value();
    }
    if (!used) return port;
  }
  return 0;
}

}  // namespace softverbs::cm
