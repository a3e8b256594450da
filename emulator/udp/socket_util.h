// Socket plumbing of the UDP transport: descriptors that close themselves,
// IP addresses to and from sockaddr, the RoCEv2 socket's options, and the
// abstract-socket claims that keep two devices off one address.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "wire/roce_packet.h"

namespace softverbs::udp {

// A file descriptor that closes itself.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = other.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct SocketAddressStorage {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

inline SocketAddressStorage to_sockaddr(const wire::IpAddress& address, uint16_t port, uint32_t scope_id) {
  SocketAddressStorage out;
  if (wire::is_ipv4_mapped(address)) {
    auto* in = reinterpret_cast<sockaddr_in*>(&out.storage);
    in->sin_family = AF_INET;
    in->sin_port = htons(port);
    std::memcpy(&in->sin_addr, address.data() + 12, 4);
    out.length = sizeof(sockaddr_in);
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&out.storage);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    std::memcpy(&in6->sin6_addr, address.data(), 16);
    in6->sin6_scope_id = scope_id;
    out.length = sizeof(sockaddr_in6);
  }
  return out;
}

// Inline: the receive path converts the source of every datagram read from
// an unconnected socket.
inline bool from_sockaddr(const sockaddr_storage& storage, wire::IpAddress& address, uint16_t& port) {
  if (storage.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&storage);
    address = {};
    address[10] = address[11] = 0xff;
    std::memcpy(address.data() + 12, &in->sin_addr, 4);
    port = ntohs(in->sin_port);
    return true;
  }
  if (storage.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&storage);
    std::memcpy(address.data(), &in6->sin6_addr, 16);
    port = ntohs(in6->sin6_port);
    return true;
  }
  return false;
}

inline bool is_link_local(const wire::IpAddress& address) { return address[0] == 0xfe && (address[1] & 0xc0) == 0x80; }

// A UDP socket bound to (address, port) with SO_REUSEPORT, UDP GRO, DF set
// and large buffers; -1 and errno set on failure.
int bind_udp(const wire::IpAddress& address, uint16_t port, uint32_t scope_id);

// One device per address and network namespace, as with rxe: a device's
// process announces each address it uses with an abstract socket name.
// The name of another device's claim on `address` (instance id other than
// `instance`), or "" if there is none.
std::string claim_of_another_device(const wire::IpAddress& address, uint64_t instance);
// This process's claim on `address` for device `instance` (an invalid Fd
// if the name could not be bound).
Fd claim_address(const wire::IpAddress& address, uint64_t instance);

}  // namespace softverbs::udp
