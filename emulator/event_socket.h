// Datagram sockets with abstract addresses: how one process wakes another's
// completion channel or delivers an asynchronous event, in the formats
// libibverbs reads from a kernel's channel and async file descriptors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace softverbs {

struct SocketAddress {
  uint32_t length = 0;  // bytes of `path` in use; 0: none
  char path[108] = {};  // sun_path, starting with NUL (abstract)
};

// A new datagram socket bound to a kernel-chosen abstract address; -1 on error.
int open_event_socket(SocketAddress* address);

// The bound address of `fd`; false if it is not an AF_UNIX socket.
bool socket_address_of(int fd, SocketAddress* address);

// Sends one datagram, never blocking; false if it could not be sent.
bool send_datagram(const SocketAddress& to, const void* bytes, size_t length);

// Printable form of an abstract address (without the leading NUL), and back.
std::string address_to_text(const SocketAddress& address);
bool address_from_text(const std::string& text, SocketAddress* address);

// Event numbers; values are the verbs ABI's (enum ibv_event_type).
enum class AsyncEventType : uint32_t {
  CqError = 0,
  QpFatal = 1,
  QpRequestError = 2,
  QpAccessError = 3,
  CommunicationEstablished = 4,
  SqDrained = 5,
  DeviceFatal = 8,
  PortActive = 9,
  PortError = 10,
  SrqError = 14,
  SrqLimitReached = 15,
  QpLastWqeReached = 16,
  GidChange = 18,
};

// What ibv_get_async_event reads from async_fd: element, type, reserved.
bool send_async_event(const SocketAddress& to, uint64_t element, AsyncEventType type);

}  // namespace softverbs
