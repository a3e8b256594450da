// The rdma_cm ports in use on this host: a directory (in the softverbs
// runtime directory) with an entry per listening address and port, naming
// the listening process, so that a second listener gets EADDRINUSE and a
// bind to port 0 gets a port nobody listens on. (Connection requests find
// their listener through the device: cm_routing.h.)
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace softverbs::cm {

class ListenerDirectory {
 public:
  explicit ListenerDirectory(std::filesystem::path runtime_dir);

  // Registers a listener on `address` (port in network order inside it).
  // 0 or EADDRINUSE (a live listener holds the port on the same address,
  // or one of them is the wildcard). Entries of exited processes are
  // removed on the way.
  int claim(const sockaddr_storage& address);
  void release(const sockaddr_storage& address);

  // A port no live listener uses, for binds to port 0 (host order).
  uint16_t free_port();

 private:
  std::filesystem::path entry_path(const sockaddr_storage& address) const;
  std::filesystem::path dir_;
};

// Text form used in entry names: "4-7f000001-7174", "6-<32 hex>-7174";
// a wildcard address is all zeros.
std::string address_key(const sockaddr_storage& address);
uint16_t port_of(const sockaddr_storage& address);  // host order
bool is_wildcard(const sockaddr_storage& address);

}  // namespace softverbs::cm
