// Where rdma_cm listeners can be found: a directory per host (in the
// softverbs runtime directory) mapping an RDMA address and port to the TCP
// port on which the listening process's shim takes connection requests. The
// applications' own TCP ports are never touched: CM traffic uses ephemeral
// ports that only this directory names.
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

  // Registers a listener on `address` (port in network order inside it)
  // reachable at `tcp_port`. 0 or EADDRINUSE (a live listener holds the port
  // on the same address, or one of them is the wildcard).
  int claim(const sockaddr_storage& address, uint16_t tcp_port);
  void release(const sockaddr_storage& address);

  // The TCP port of the listener for `destination`: an exact match first,
  // then a wildcard listener on that port. Entries of exited processes are
  // removed on the way.
  std::optional<uint16_t> find(const sockaddr_storage& destination);

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
