#include "device/event_socket.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

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
  ssize_t length;
  do length = recvmsg(fd, &message, flags | MSG_CMSG_CLOEXEC);
  while (length < 0 && errno == EINTR);
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

bool send_datagram(const SocketAddress& to, const void* bytes, size_t length) {
  if (to.length == 0 || to.length > sizeof to.path) return false;
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, to.path, to.length);
  ssize_t sent = sendto(fd, bytes, length, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&address),
                        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + to.length));
  close(fd);
  return sent == static_cast<ssize_t>(length);
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
