// The rsocket calls of <rdma/rsocket.h>: stream sockets over our rdma_cm
// (rsocket_stream.cpp), datagram sockets over UD QPs (rsocket_dgram.cpp),
// rpoll/rselect over rsockets and ordinary descriptors alike. An rsocket's
// number is a real descriptor (a stream socket's CM event channel, a
// datagram socket's UDP socket), so it never collides with the process's
// other files. When delegating to the real librdmacm, every call goes there.
#include <rdma/rsocket.h>
#include <sys/time.h>
#include <time.h>

#include <cerrno>
#include <cstdarg>
#include <memory>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "real_librdmacm.h"
#include "rsocket_dgram.h"
#include "rsocket_stream.h"

#define SV_EXPORT extern "C" __attribute__((visibility("default")))

namespace softverbs::rs {
namespace {

std::shared_mutex table_lock;
std::unordered_map<int, std::shared_ptr<StreamSocket>>& table() {
  static auto* sockets = new std::unordered_map<int, std::shared_ptr<StreamSocket>>;  // outlives exit handlers
  return *sockets;
}

std::unordered_map<int, std::shared_ptr<DgramSocket>>& dgram_table() {
  static auto* sockets = new std::unordered_map<int, std::shared_ptr<DgramSocket>>;  // outlives exit handlers
  return *sockets;
}

std::shared_ptr<StreamSocket> lookup(int fd) {
  std::shared_lock guard(table_lock);
  auto it = table().find(fd);
  return it == table().end() ? nullptr : it->second;
}

std::shared_ptr<DgramSocket> lookup_dgram(int fd) {
  std::shared_lock guard(table_lock);
  auto it = dgram_table().find(fd);
  return it == dgram_table().end() ? nullptr : it->second;
}

int insert(std::shared_ptr<StreamSocket> socket) {
  std::unique_lock guard(table_lock);
  int fd = socket->fd();
  table()[fd] = std::move(socket);
  return fd;
}

int insert(std::shared_ptr<DgramSocket> socket) {
  std::unique_lock guard(table_lock);
  int fd = socket->fd();
  dgram_table()[fd] = std::move(socket);
  return fd;
}

int bad_fd() {
  errno = EBADF;
  return -1;
}

// Connection calls on a datagram rsocket, as a UDP socket answers them.
int not_for_datagrams() {
  errno = EOPNOTSUPP;
  return -1;
}

constexpr uint64_t kPollSpinMicroseconds = 10;  // rdma-core's default polling_time

uint64_t now_us() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000 + static_cast<uint64_t>(ts.tv_nsec) / 1000;
}

uint64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000 + static_cast<uint64_t>(ts.tv_nsec) / 1000000;
}

// One pass over every descriptor without waiting; the number with events.
int check_all(pollfd* fds, nfds_t nfds) {
  int count = 0;
  for (nfds_t i = 0; i < nfds; ++i) {
    fds[i].revents = 0;
    if (fds[i].fd < 0) continue;
    if (auto socket = lookup(fds[i].fd))
      fds[i].revents = socket->poll_events(fds[i].events);
    else if (auto dgram = lookup_dgram(fds[i].fd))
      fds[i].revents = dgram->poll_events(fds[i].events);
    else
      ::poll(&fds[i], 1, 0);
    if (fds[i].revents != 0) count++;
  }
  return count;
}

}  // namespace
}  // namespace softverbs::rs

using softverbs::rs::lookup;
using softverbs::rs::lookup_dgram;

SV_EXPORT int rsocket(int domain, int type, int protocol) {
  SOFTVERBS_FORWARD(rsocket, "RDMACM_1.0", domain, type, protocol);
  const int socket_type = type & ~(SOCK_CLOEXEC | SOCK_NONBLOCK);
  if ((domain != AF_INET && domain != AF_INET6) || (socket_type != SOCK_STREAM && socket_type != SOCK_DGRAM) ||
      (socket_type == SOCK_STREAM && protocol != 0 && protocol != IPPROTO_TCP) ||
      (socket_type == SOCK_DGRAM && protocol != 0 && protocol != IPPROTO_UDP)) {
    errno = ENOTSUP;
    return -1;
  }
  if (socket_type == SOCK_DGRAM) {
    auto dgram = softverbs::rs::DgramSocket::create(domain, type & SOCK_NONBLOCK, type & SOCK_CLOEXEC);
    if (dgram == nullptr) return -1;
    return softverbs::rs::insert(std::move(dgram));
  }
  auto socket = softverbs::rs::StreamSocket::create(domain, type & SOCK_NONBLOCK, type & SOCK_CLOEXEC);
  if (socket == nullptr) return -1;
  return softverbs::rs::insert(std::move(socket));
}

SV_EXPORT int rbind(int s, const sockaddr* addr, socklen_t len) {
  SOFTVERBS_FORWARD(rbind, "RDMACM_1.0", s, addr, len);
  if (auto dgram = lookup_dgram(s)) return dgram->bind(addr, len);
  auto socket = lookup(s);
  return socket ? socket->bind(addr, len) : softverbs::rs::bad_fd();
}

SV_EXPORT int rlisten(int s, int backlog) {
  SOFTVERBS_FORWARD(rlisten, "RDMACM_1.0", s, backlog);
  if (lookup_dgram(s)) return softverbs::rs::not_for_datagrams();
  auto socket = lookup(s);
  return socket ? socket->listen(backlog) : softverbs::rs::bad_fd();
}

SV_EXPORT int raccept(int s, sockaddr* addr, socklen_t* len) {
  SOFTVERBS_FORWARD(raccept, "RDMACM_1.0", s, addr, len);
  if (lookup_dgram(s)) return softverbs::rs::not_for_datagrams();
  auto socket = lookup(s);
  if (!socket) return softverbs::rs::bad_fd();
  auto accepted = socket->accept(addr, len);
  return accepted ? softverbs::rs::insert(std::move(accepted)) : -1;
}

SV_EXPORT int rconnect(int s, const sockaddr* addr, socklen_t len) {
  SOFTVERBS_FORWARD(rconnect, "RDMACM_1.0", s, addr, len);
  if (auto dgram = lookup_dgram(s)) return dgram->connect(addr, len);
  auto socket = lookup(s);
  return socket ? socket->connect(addr, len) : softverbs::rs::bad_fd();
}

SV_EXPORT int rshutdown(int s, int how) {
  SOFTVERBS_FORWARD(rshutdown, "RDMACM_1.0", s, how);
  if (lookup_dgram(s)) return softverbs::rs::not_for_datagrams();
  auto socket = lookup(s);
  return socket ? socket->shutdown(how) : softverbs::rs::bad_fd();
}

SV_EXPORT int rclose(int s) {
  SOFTVERBS_FORWARD(rclose, "RDMACM_1.0", s);
  std::shared_ptr<softverbs::rs::DgramSocket> dgram;
  {
    std::unique_lock guard(softverbs::rs::table_lock);
    auto it = softverbs::rs::dgram_table().find(s);
    if (it != softverbs::rs::dgram_table().end()) {
      dgram = std::move(it->second);
      softverbs::rs::dgram_table().erase(it);
    }
  }
  if (dgram) {
    dgram->close();
    return 0;
  }
  std::shared_ptr<softverbs::rs::StreamSocket> socket;
  {
    std::unique_lock guard(softverbs::rs::table_lock);
    auto it = softverbs::rs::table().find(s);
    if (it == softverbs::rs::table().end()) return softverbs::rs::bad_fd();
    socket = std::move(it->second);
    softverbs::rs::table().erase(it);
  }
  socket->close();
  return 0;
}

SV_EXPORT ssize_t rrecv(int s, void* buf, size_t len, int flags) {
  SOFTVERBS_FORWARD(rrecv, "RDMACM_1.0", s, buf, len, flags);
  if (auto dgram = lookup_dgram(s)) return dgram->recvfrom(buf, len, flags, nullptr, nullptr);
  auto socket = lookup(s);
  return socket ? socket->recv(buf, len, flags) : softverbs::rs::bad_fd();
}

SV_EXPORT ssize_t rrecvfrom(int s, void* buf, size_t len, int flags, sockaddr* from, socklen_t* fromlen) {
  SOFTVERBS_FORWARD(rrecvfrom, "RDMACM_1.0", s, buf, len, flags, from, fromlen);
  if (auto dgram = lookup_dgram(s)) return dgram->recvfrom(buf, len, flags, from, fromlen);
  auto socket = lookup(s);
  if (!socket) return softverbs::rs::bad_fd();
  ssize_t n = socket->recv(buf, len, flags);
  if (n > 0 && from != nullptr && fromlen != nullptr) socket->getpeername(from, fromlen);
  return n;
}

SV_EXPORT ssize_t rrecvmsg(int s, msghdr* msg, int flags) {
  SOFTVERBS_FORWARD(rrecvmsg, "RDMACM_1.0", s, msg, flags);
  if (msg->msg_control != nullptr && msg->msg_controllen != 0) {
    errno = ENOTSUP;
    return -1;
  }
  // As rdma-core: into the first buffer only; the source, as recvmsg gives it.
  if (auto dgram = lookup_dgram(s)) {
    auto* from = static_cast<sockaddr*>(msg->msg_name);
    socklen_t* from_len = from != nullptr ? &msg->msg_namelen : nullptr;
    return msg->msg_iovlen == 0
               ? dgram->recvfrom(nullptr, 0, flags, from, from_len)
               : dgram->recvfrom(msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, flags, from, from_len);
  }
  auto socket = lookup(s);
  if (!socket) return softverbs::rs::bad_fd();
  return socket->recvv(msg->msg_iov, static_cast<int>(msg->msg_iovlen), flags);
}

SV_EXPORT ssize_t rread(int s, void* buf, size_t count) {
  SOFTVERBS_FORWARD(rread, "RDMACM_1.0", s, buf, count);
  if (auto dgram = lookup_dgram(s)) return dgram->recvfrom(buf, count, 0, nullptr, nullptr);
  auto socket = lookup(s);
  return socket ? socket->recv(buf, count, 0) : softverbs::rs::bad_fd();
}

SV_EXPORT ssize_t rreadv(int s, const iovec* iov, int iovcnt) {
  SOFTVERBS_FORWARD(rreadv, "RDMACM_1.0", s, iov, iovcnt);
  if (auto dgram = lookup_dgram(s))
    return iovcnt <= 0 ? dgram->recvfrom(nullptr, 0, 0, nullptr, nullptr)
                       : dgram->recvfrom(iov[0].iov_base, iov[0].iov_len, 0, nullptr, nullptr);
  auto socket = lookup(s);
  return socket ? socket->recvv(iov, iovcnt, 0) : softverbs::rs::bad_fd();
}

SV_EXPORT ssize_t rsend(int s, const void* buf, size_t len, int flags) {
  SOFTVERBS_FORWARD(rsend, "RDMACM_1.0", s, buf, len, flags);
  iovec iov{const_cast<void*>(buf), len};
  if (auto dgram = lookup_dgram(s)) return dgram->sendv(&iov, 1, flags, nullptr, 0);
  auto socket = lookup(s);
  return socket ? socket->sendv(&iov, 1, flags) : softverbs::rs::bad_fd();
}

SV_EXPORT ssize_t rsendto(int s, const void* buf, size_t len, int flags, const sockaddr* to, socklen_t tolen) {
  SOFTVERBS_FORWARD(rsendto, "RDMACM_1.0", s, buf, len, flags, to, tolen);
  iovec iov{const_cast<void*>(buf), len};
  if (auto dgram = lookup_dgram(s)) return dgram->sendv(&iov, 1, flags, to, tolen);
  auto socket = lookup(s);
  if (!socket) return softverbs::rs::bad_fd();
  if (to != nullptr || tolen != 0) {
    errno = EISCONN;
    return -1;
  }
  return socket->sendv(&iov, 1, flags);
}

SV_EXPORT ssize_t rsendmsg(int s, const msghdr* msg, int flags) {
  SOFTVERBS_FORWARD(rsendmsg, "RDMACM_1.0", s, msg, flags);
  if (msg->msg_control != nullptr && msg->msg_controllen != 0) {
    errno = ENOTSUP;
    return -1;
  }
  if (auto dgram = lookup_dgram(s))
    return dgram->sendv(msg->msg_iov, static_cast<int>(msg->msg_iovlen), flags,
                        static_cast<const sockaddr*>(msg->msg_name), msg->msg_namelen);
  auto socket = lookup(s);
  if (!socket) return softverbs::rs::bad_fd();
  return socket->sendv(msg->msg_iov, static_cast<int>(msg->msg_iovlen), flags);
}

SV_EXPORT ssize_t rwrite(int s, const void* buf, size_t count) {
  SOFTVERBS_FORWARD(rwrite, "RDMACM_1.0", s, buf, count);
  iovec iov{const_cast<void*>(buf), count};
  if (auto dgram = lookup_dgram(s)) return dgram->sendv(&iov, 1, 0, nullptr, 0);
  auto socket = lookup(s);
  return socket ? socket->sendv(&iov, 1, 0) : softverbs::rs::bad_fd();
}

SV_EXPORT ssize_t rwritev(int s, const iovec* iov, int iovcnt) {
  SOFTVERBS_FORWARD(rwritev, "RDMACM_1.0", s, iov, iovcnt);
  if (auto dgram = lookup_dgram(s)) return dgram->sendv(iov, iovcnt, 0, nullptr, 0);
  auto socket = lookup(s);
  return socket ? socket->sendv(iov, iovcnt, 0) : softverbs::rs::bad_fd();
}

// Checks every descriptor; if none is ready, arms the rsockets' queues and
// waits on their channels and the other descriptors together, then checks
// again (an rsocket's channel also wakes for credit updates and the like,
// which are no event for the caller).
SV_EXPORT int rpoll(pollfd* fds, nfds_t nfds, int timeout) {
  SOFTVERBS_FORWARD(rpoll, "RDMACM_1.0", fds, nfds, timeout);
  const uint64_t start = softverbs::rs::now_ms();
  // As rdma-core: look again for a while (its polling_time) before
  // sleeping, since a wake-up through the CQ's channel costs more than a
  // transfer takes.
  int count = 0;
  const uint64_t spin_start = softverbs::rs::now_us();
  do {
    count = softverbs::rs::check_all(fds, nfds);
    if (count != 0 || timeout == 0) return count;
  } while (softverbs::rs::now_us() - spin_start <= softverbs::rs::kPollSpinMicroseconds);
  std::vector<pollfd> waits;
  std::vector<std::shared_ptr<softverbs::rs::StreamSocket>> armed;
  std::vector<std::shared_ptr<softverbs::rs::DgramSocket>> armed_dgrams;
  for (;;) {
    waits.clear();
    armed.clear();
    armed_dgrams.clear();
    for (nfds_t i = 0; i < nfds; ++i) {
      if (fds[i].fd < 0) continue;
      if (auto socket = lookup(fds[i].fd)) {
        socket->arm_for_poll(waits);
        armed.push_back(std::move(socket));
      } else if (auto dgram = lookup_dgram(fds[i].fd)) {
        dgram->arm_for_poll(waits);
        armed_dgrams.push_back(std::move(dgram));
      } else {
        waits.push_back({fds[i].fd, fds[i].events, 0});
      }
    }
    // What completed before the arm raises no event: look once more.
    if ((count = softverbs::rs::check_all(fds, nfds)) != 0) return count;
    int wait_ms = -1;
    if (timeout > 0) {
      const uint64_t elapsed = softverbs::rs::now_ms() - start;
      if (elapsed >= static_cast<uint64_t>(timeout)) return 0;
      wait_ms = timeout - static_cast<int>(elapsed);
    }
    if (::poll(waits.data(), waits.size(), wait_ms) < 0) return -1;
    for (auto& socket : armed) socket->after_poll_wait();
    for (auto& dgram : armed_dgrams) dgram->after_poll_wait();
    if ((count = softverbs::rs::check_all(fds, nfds)) != 0) return count;
  }
}

SV_EXPORT int rselect(int nfds, fd_set* readfds, fd_set* writefds, fd_set* exceptfds, timeval* timeout) {
  SOFTVERBS_FORWARD(rselect, "RDMACM_1.0", nfds, readfds, writefds, exceptfds, timeout);
  if (nfds < 0 || nfds > FD_SETSIZE) {
    errno = EINVAL;
    return -1;
  }
  std::vector<pollfd> fds;
  for (int fd = 0; fd < nfds; ++fd) {
    short events = 0;
    bool wanted = false;
    if (readfds != nullptr && FD_ISSET(fd, readfds)) events |= POLLIN, wanted = true;
    if (writefds != nullptr && FD_ISSET(fd, writefds)) events |= POLLOUT, wanted = true;
    if (exceptfds != nullptr && FD_ISSET(fd, exceptfds)) wanted = true;
    if (wanted) fds.push_back({fd, events, 0});
  }
  const int timeout_ms = timeout == nullptr ? -1 : static_cast<int>(timeout->tv_sec * 1000 + timeout->tv_usec / 1000);
  int ready = rpoll(fds.data(), fds.size(), timeout_ms);
  if (ready < 0) return ready;
  if (readfds != nullptr) FD_ZERO(readfds);
  if (writefds != nullptr) FD_ZERO(writefds);
  if (exceptfds != nullptr) FD_ZERO(exceptfds);
  int count = 0;
  for (const pollfd& p : fds) {
    if (readfds != nullptr && (p.revents & (POLLIN | POLLHUP))) FD_SET(p.fd, readfds), count++;
    if (writefds != nullptr && (p.revents & POLLOUT)) FD_SET(p.fd, writefds), count++;
    if (exceptfds != nullptr && (p.revents & ~(POLLIN | POLLOUT))) FD_SET(p.fd, exceptfds), count++;
  }
  return count;
}

SV_EXPORT int rgetpeername(int s, sockaddr* addr, socklen_t* len) {
  SOFTVERBS_FORWARD(rgetpeername, "RDMACM_1.0", s, addr, len);
  if (auto dgram = lookup_dgram(s)) return dgram->getpeername(addr, len);
  auto socket = lookup(s);
  return socket ? socket->getpeername(addr, len) : softverbs::rs::bad_fd();
}

SV_EXPORT int rgetsockname(int s, sockaddr* addr, socklen_t* len) {
  SOFTVERBS_FORWARD(rgetsockname, "RDMACM_1.0", s, addr, len);
  if (auto dgram = lookup_dgram(s)) return dgram->getsockname(addr, len);
  auto socket = lookup(s);
  return socket ? socket->getsockname(addr, len) : softverbs::rs::bad_fd();
}

SV_EXPORT int rsetsockopt(int s, int level, int name, const void* value, socklen_t len) {
  SOFTVERBS_FORWARD(rsetsockopt, "RDMACM_1.0", s, level, name, value, len);
  if (auto dgram = lookup_dgram(s)) return dgram->setsockopt(level, name, value, len);
  auto socket = lookup(s);
  return socket ? socket->setsockopt(level, name, value, len) : softverbs::rs::bad_fd();
}

SV_EXPORT int rgetsockopt(int s, int level, int name, void* value, socklen_t* len) {
  SOFTVERBS_FORWARD(rgetsockopt, "RDMACM_1.0", s, level, name, value, len);
  if (auto dgram = lookup_dgram(s)) return dgram->getsockopt(level, name, value, len);
  auto socket = lookup(s);
  return socket ? socket->getsockopt(level, name, value, len) : softverbs::rs::bad_fd();
}

SV_EXPORT off_t riomap(int s, void* buf, size_t len, int prot, int flags, off_t offset) {
  SOFTVERBS_FORWARD(riomap, "RDMACM_1.0", s, buf, len, prot, flags, offset);
  if (lookup_dgram(s)) return softverbs::rs::not_for_datagrams();
  auto socket = lookup(s);
  return socket ? socket->iomap(buf, len, prot, flags, offset) : softverbs::rs::bad_fd();
}

SV_EXPORT int riounmap(int s, void* buf, size_t len) {
  SOFTVERBS_FORWARD(riounmap, "RDMACM_1.0", s, buf, len);
  if (lookup_dgram(s)) return softverbs::rs::not_for_datagrams();
  auto socket = lookup(s);
  return socket ? socket->iounmap(buf, len) : softverbs::rs::bad_fd();
}

SV_EXPORT size_t riowrite(int s, const void* buf, size_t count, off_t offset, int flags) {
  SOFTVERBS_FORWARD(riowrite, "RDMACM_1.0", s, buf, count, offset, flags);
  if (lookup_dgram(s)) return static_cast<size_t>(softverbs::rs::not_for_datagrams());
  auto socket = lookup(s);
  return static_cast<size_t>(socket ? socket->iowrite(buf, count, offset, flags) : softverbs::rs::bad_fd());
}

// rfcntl is variadic: one optional int argument.
SV_EXPORT int rfcntl(int s, int cmd, ...) {
  va_list args;
  va_start(args, cmd);
  long argument = va_arg(args, long);
  va_end(args);
  if (::softverbs::cm::real_librdmacm() != nullptr) {
    static auto forwarded =
        reinterpret_cast<int (*)(int, int, ...)>(::softverbs::cm::real_symbol("rfcntl", "RDMACM_1.0"));
    return forwarded(s, cmd, argument);
  }
  if (auto dgram = lookup_dgram(s)) return dgram->fcntl(cmd, argument);
  auto socket = lookup(s);
  return socket ? socket->fcntl(cmd, argument) : softverbs::rs::bad_fd();
}
