// Datagram sockets with abstract addresses: how one process wakes another's
// completion channel or delivers an asynchronous event, in the formats
// libibverbs reads from a kernel's channel and async file descriptors.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace softverbs {

struct SocketAddress {
  uint32_t length = 0;  // bytes of `path` in use; 0: none
  char path[108] = {};  // sun_path, starting with NUL (abstract)
};

// A new datagram socket bound to a kernel-chosen abstract address; -1 on
// error. Like every socket here it asks for its senders' credentials
// (SO_PASSCRED), so that receive_from_trusted can tell who sent what.
int open_event_socket(SocketAddress* address);

// A datagram socket bound to the abstract address `address`, asking for its
// senders' credentials; -1 on error.
int open_trusted_socket(const SocketAddress& address);

// Abstract addresses carry no permissions: any local user can send to one.
// So a receiver takes only datagrams from processes of its own user (or
// root): the kernel attaches the sender's credentials, translated into the
// receiver's user namespace. Returns the datagram's length; -1 on error
// (errno set; EINTR too, as the application's reads of its channels must
// see it); -2 for a datagram from someone else, which is dropped.
ssize_t receive_from_trusted(int fd, void* buffer, size_t capacity, int flags = 0);
// Whether a sender with user id `uid` (as the receiver sees it) is trusted.
bool trusted_sender(uid_t uid);

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
