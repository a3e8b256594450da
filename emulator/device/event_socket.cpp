#include "device/event_socket.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace softverbs {

namespace {

int credential_socket() {
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int on = 1;
  if (setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

int open_event_socket(SocketAddress* address) {
  int fd = credential_socket();
  if (fd < 0) return -1;
  sockaddr_un bound{};
  bound.sun_family = AF_UNIX;
  // Autobind: binding with only the family makes the kernel pick a unique
  // abstract name; nothing to clean up in the file system.
  if (bind(fd, reinterpret_cast<sockaddr*>(&bound), sizeof(sa_family_t)) != 0 || !socket_address_of(fd, address)) {
    close(fd);
    return -1;
  }
  return fd;
}

int open_trusted_socket(const SocketAddress& address) {
  if (address.length == 0 || address.length > sizeof address.path) return -1;
  int fd = credential_socket();
  if (fd < 0) return -1;
  sockaddr_un bound{};
  bound.sun_family = AF_UNIX;
  std::memcpy(bound.sun_path, address.path, address.length);
  if (bind(fd, reinterpret_cast<sockaddr*>(&bound),
           static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.length)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool trusted_sender(uid_t uid) { return uid == 0 || uid == getuid() || uid == geteuid(); }

ssize_t receive_from_trusted(int fd, void* buffer, size_t capacity, int flags) {
  iovec vector{buffer, capacity};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
  msghdr message{};
  message.msg_iov = &vector;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  const ssize_t length = recvmsg(fd, &message, flags | MSG_CMSG_CLOEXEC);
  if (length < 0) return -1;
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_CREDENTIALS ||
        header->cmsg_len < CMSG_LEN(sizeof(ucred)))
      continue;
    ucred credentials;
    std::memcpy(&credentials, CMSG_DATA(header), sizeof credentials);
    if (trusted_sender(credentials.uid)) return length;
  }
  return -2;  // no credentials (the socket lacks SO_PASSCRED) or a stranger's
}

bool socket_address_of(int fd, SocketAddress* address) {
  sockaddr_un bound{};
  socklen_t length = sizeof bound;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0 || bound.sun_family != AF_UNIX ||
      length <= offsetof(sockaddr_un, sun_path))
    return false;
  address->length = static_cast<uint32_t>(length - offsetof(sockaddr_un, sun_path));
  std::memcpy(address->path, bound.sun_path, address->length);
  return true;
}

namespace {

// The unbound socket this process sends every datagram from (any thread may
// use it at once; the kernel attaches the sending process's credentials at
// each send). A socket made and closed per datagram cost two more system
// calls on every completion event. -1: none yet.
std::atomic<int> sender_fd{-1};

int sender_socket() {
  int fd = sender_fd.load(std::memory_order_acquire);
  if (fd >= 0) return fd;
  fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int expected = -1;
  if (sender_fd.compare_exchange_strong(expected, fd, std::memory_order_acq_rel)) return fd;
  close(fd);  // another thread's came first
  return expected;
}

// The application closed the descriptor under us (a daemon closing all it
// inherited, say): forget it, so that the next send opens another.
void forget_sender_socket(int fd) { sender_fd.compare_exchange_strong(fd, -1, std::memory_order_acq_rel); }

}  // namespace

bool send_datagram(const SocketAddress& to, const void* bytes, size_t length) {
  if (to.length == 0 || to.length > sizeof to.path) return false;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, to.path, to.length);
  const auto address_length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + to.length);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int fd = sender_socket();
    if (fd < 0) return false;
    const ssize_t sent =
        sendto(fd, bytes, length, MSG_DONTWAIT | MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&address), address_length);
    if (sent >= 0) return sent == static_cast<ssize_t>(length);
    // Not our socket any more (closed, or its number reused by another kind).
    if (errno != EBADF && errno != ENOTSOCK && errno != EAFNOSUPPORT && errno != EISCONN && errno != EOPNOTSUPP)
      return false;
    forget_sender_socket(fd);
  }
  return false;
}

std::string address_to_text(const SocketAddress& address) {
  if (address.length < 2 || address.path[0] != '\0') return {};
  return std::string(address.path + 1, address.length - 1);
}

bool address_from_text(const std::string& text, SocketAddress* address) {
  if (text.empty() || text.size() + 1 > sizeof address->path) return false;
  *address = {};
  address->path[0] = '\0';
  std::memcpy(address->path + 1, text.data(), text.size());
  address->length = static_cast<uint32_t>(text.size() + 1);
  return true;
}

bool send_async_event(const SocketAddress& to, uint64_t element, AsyncEventType type) {
  struct {
    uint64_t element;
    uint32_t event_type;
    uint32_t reserved;
  } event{element, static_cast<uint32_t>(type), 0};
  static_assert(sizeof event == 16);
  return send_datagram(to, &event, sizeof event);
}

}  // namespace softverbs
