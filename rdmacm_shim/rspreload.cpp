// librspreload.so: runs an unmodified TCP program over rsockets, as
// rdma-core's preload does. In LD_PRELOAD (`softverbs run --rsockets`),
// it takes the socket calls: a TCP socket (AF_INET/AF_INET6, SOCK_STREAM)
// becomes an rsocket (a real descriptor, so the program's other calls on
// it still make sense), and every call on such a descriptor goes to its r*
// counterpart. Everything else reaches the next definition (libc, or
// softverbs' own preload).
//
// The rsocket code itself reads, polls and closes descriptors, some of
// them the very descriptors that name rsockets; while a thread is inside an
// r* call, its calls pass straight through.
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <rdma/rsocket.h>
#include <sys/select.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdarg>

#define SV_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxFds = 1 << 16;
std::array<std::atomic<bool>, kMaxFds> is_rsocket{};
thread_local bool inside_rsockets = false;

bool routed(int fd) {
  return !inside_rsockets && fd >= 0 && fd < kMaxFds && is_rsocket[static_cast<size_t>(fd)].load();
}

void mark(int fd, bool value) {
  if (fd >= 0 && fd < kMaxFds) is_rsocket[static_cast<size_t>(fd)].store(value);
}

// Marks the thread as inside rsockets for the scope.
struct Inside {
  bool saved = inside_rsockets;
  Inside() { inside_rsockets = true; }
  ~Inside() { inside_rsockets = saved; }
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;
};

template <typename Function>
Function next(const char* name) {
  return reinterpret_cast<Function>(dlsym(RTLD_NEXT, name));
}

#define REAL(name) static const auto real_##name = next<decltype(&::name)>(#name)

}  // namespace

SV_EXPORT int socket(int domain, int type, int protocol) {
  REAL(socket);
  const int base = type & ~(SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (!inside_rsockets && (domain == AF_INET || domain == AF_INET6) && base == SOCK_STREAM &&
      (protocol == 0 || protocol == IPPROTO_TCP)) {
    Inside inside;
    int fd = rsocket(domain, type, protocol);
    if (fd >= 0) {
      mark(fd, true);
      return fd;
    }
  }
  return real_socket(domain, type, protocol);
}

SV_EXPORT int bind(int fd, const sockaddr* addr, socklen_t len) {
  REAL(bind);
  if (!routed(fd)) return real_bind(fd, addr, len);
  Inside inside;
  return rbind(fd, addr, len);
}

SV_EXPORT int listen(int fd, int backlog) {
  REAL(listen);
  if (!routed(fd)) return real_listen(fd, backlog);
  Inside inside;
  return rlisten(fd, backlog);
}

SV_EXPORT int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  REAL(accept4);
  if (!routed(fd)) return real_accept4(fd, addr, len, flags);
  Inside inside;
  int accepted = raccept(fd, addr, len);
  if (accepted < 0) return accepted;
  mark(accepted, true);
  if (flags & SOCK_NONBLOCK) rfcntl(accepted, F_SETFL, O_NONBLOCK);
  if (flags & SOCK_CLOEXEC) rfcntl(accepted, F_SETFD, FD_CLOEXEC);
  return accepted;
}

SV_EXPORT int accept(int fd, sockaddr* addr, socklen_t* len) {
  REAL(accept);
  if (!routed(fd)) return real_accept(fd, addr, len);
  return accept4(fd, addr, len, 0);
}

SV_EXPORT int connect(int fd, const sockaddr* addr, socklen_t len) {
  REAL(connect);
  if (!routed(fd)) return real_connect(fd, addr, len);
  Inside inside;
  return rconnect(fd, addr, len);
}

SV_EXPORT ssize_t recv(int fd, void* buf, size_t len, int flags) {
  REAL(recv);
  if (!routed(fd)) return real_recv(fd, buf, len, flags);
  Inside inside;
  return rrecv(fd, buf, len, flags);
}

SV_EXPORT ssize_t recvfrom(int fd, void* buf, size_t len, int flags, sockaddr* from, socklen_t* fromlen) {
  REAL(recvfrom);
  if (!routed(fd)) return real_recvfrom(fd, buf, len, flags, from, fromlen);
  Inside inside;
  return rrecvfrom(fd, buf, len, flags, from, fromlen);
}

SV_EXPORT ssize_t recvmsg(int fd, msghdr* msg, int flags) {
  REAL(recvmsg);
  if (!routed(fd)) return real_recvmsg(fd, msg, flags);
  Inside inside;
  return rrecvmsg(fd, msg, flags);
}

SV_EXPORT ssize_t read(int fd, void* buf, size_t count) {
  REAL(read);
  if (!routed(fd)) return real_read(fd, buf, count);
  Inside inside;
  return rread(fd, buf, count);
}

SV_EXPORT ssize_t readv(int fd, const iovec* iov, int iovcnt) {
  REAL(readv);
  if (!routed(fd)) return real_readv(fd, iov, iovcnt);
  Inside inside;
  return rreadv(fd, iov, iovcnt);
}

SV_EXPORT ssize_t send(int fd, const void* buf, size_t len, int flags) {
  REAL(send);
  if (!routed(fd)) return real_send(fd, buf, len, flags);
  Inside inside;
  return rsend(fd, buf, len, flags);
}

SV_EXPORT ssize_t sendto(int fd, const void* buf, size_t len, int flags, const sockaddr* to, socklen_t tolen) {
  REAL(sendto);
  if (!routed(fd)) return real_sendto(fd, buf, len, flags, to, tolen);
  Inside inside;
  return rsendto(fd, buf, len, flags, to, tolen);
}

SV_EXPORT ssize_t sendmsg(int fd, const msghdr* msg, int flags) {
  REAL(sendmsg);
  if (!routed(fd)) return real_sendmsg(fd, msg, flags);
  Inside inside;
  return rsendmsg(fd, msg, flags);
}

SV_EXPORT ssize_t write(int fd, const void* buf, size_t count) {
  REAL(write);
  if (!routed(fd)) return real_write(fd, buf, count);
  Inside inside;
  return rwrite(fd, buf, count);
}

SV_EXPORT ssize_t writev(int fd, const iovec* iov, int iovcnt) {
  REAL(writev);
  if (!routed(fd)) return real_writev(fd, iov, iovcnt);
  Inside inside;
  return rwritev(fd, iov, iovcnt);
}

// With _FORTIFY_SOURCE, programs call these instead of read/recv/poll.
SV_EXPORT ssize_t __read_chk(int fd, void* buf, size_t count, size_t) { return read(fd, buf, count); }
SV_EXPORT ssize_t __recv_chk(int fd, void* buf, size_t len, size_t, int flags) { return recv(fd, buf, len, flags); }
SV_EXPORT ssize_t __recvfrom_chk(int fd, void* buf, size_t len, size_t, int flags, sockaddr* from, socklen_t* fromlen) {
  return recvfrom(fd, buf, len, flags, from, fromlen);
}

SV_EXPORT int poll(pollfd* fds, nfds_t nfds, int timeout) {
  REAL(poll);
  bool any = false;
  for (nfds_t i = 0; i < nfds && !any; ++i) any = routed(fds[i].fd);
  if (!any) return real_poll(fds, nfds, timeout);
  Inside inside;
  return rpoll(fds, nfds, timeout);
}

SV_EXPORT int __poll_chk(pollfd* fds, nfds_t nfds, int timeout, size_t) { return poll(fds, nfds, timeout); }

SV_EXPORT int select(int nfds, fd_set* readfds, fd_set* writefds, fd_set* exceptfds, timeval* timeout) {
  REAL(select);
  bool any = false;
  for (int fd = 0; fd < nfds && fd < FD_SETSIZE && !any; ++fd)
    any = routed(fd) && ((readfds && FD_ISSET(fd, readfds)) || (writefds && FD_ISSET(fd, writefds)) ||
                         (exceptfds && FD_ISSET(fd, exceptfds)));
  if (!any) return real_select(nfds, readfds, writefds, exceptfds, timeout);
  Inside inside;
  return rselect(nfds, readfds, writefds, exceptfds, timeout);
}

SV_EXPORT int shutdown(int fd, int how) {
  REAL(shutdown);
  if (!routed(fd)) return real_shutdown(fd, how);
  Inside inside;
  return rshutdown(fd, how);
}

SV_EXPORT int close(int fd) {
  REAL(close);
  if (!routed(fd)) return real_close(fd);
  Inside inside;
  mark(fd, false);
  return rclose(fd);
}

SV_EXPORT int getpeername(int fd, sockaddr* addr, socklen_t* len) {
  REAL(getpeername);
  if (!routed(fd)) return real_getpeername(fd, addr, len);
  Inside inside;
  return rgetpeername(fd, addr, len);
}

SV_EXPORT int getsockname(int fd, sockaddr* addr, socklen_t* len) {
  REAL(getsockname);
  if (!routed(fd)) return real_getsockname(fd, addr, len);
  Inside inside;
  return rgetsockname(fd, addr, len);
}

SV_EXPORT int setsockopt(int fd, int level, int name, const void* value, socklen_t len) {
  REAL(setsockopt);
  if (!routed(fd)) return real_setsockopt(fd, level, name, value, len);
  Inside inside;
  return rsetsockopt(fd, level, name, value, len);
}

SV_EXPORT int getsockopt(int fd, int level, int name, void* value, socklen_t* len) {
  REAL(getsockopt);
  if (!routed(fd)) return real_getsockopt(fd, level, name, value, len);
  Inside inside;
  return rgetsockopt(fd, level, name, value, len);
}

// fcntl: the file status and descriptor flags of an rsocket are its own;
// anything else (F_DUPFD, locks) concerns the descriptor itself.
namespace {
int fcntl_common(bool large_file, int fd, int cmd, long argument) {
  using Fcntl = int (*)(int, int, ...);
  static const auto real_fcntl = next<Fcntl>("fcntl");
  static const auto real_fcntl64 = next<Fcntl>("fcntl64");
  Fcntl real = (large_file && real_fcntl64 != nullptr) ? real_fcntl64 : real_fcntl;
  if (routed(fd) && (cmd == F_GETFL || cmd == F_SETFL || cmd == F_GETFD || cmd == F_SETFD)) {
    Inside inside;
    return rfcntl(fd, cmd, argument);
  }
  return real(fd, cmd, argument);
}
}  // namespace

SV_EXPORT int fcntl(int fd, int cmd, ...) {
  va_list args;
  va_start(args, cmd);
  long argument = va_arg(args, long);
  va_end(args);
  return fcntl_common(false, fd, cmd, argument);
}

SV_EXPORT int fcntl64(int fd, int cmd, ...) {
  va_list args;
  va_start(args, cmd);
  long argument = va_arg(args, long);
  va_end(args);
  return fcntl_common(true, fd, cmd, argument);
}

// An rsocket cannot be duplicated (its number is what names it); one
// overwritten by dup2 is closed first, as the kernel would close it.
SV_EXPORT int dup2(int oldfd, int newfd) {
  REAL(dup2);
  if (routed(oldfd)) {
    errno = ENOTSUP;
    return -1;
  }
  if (routed(newfd) && oldfd != newfd) close(newfd);
  return real_dup2(oldfd, newfd);
}

SV_EXPORT ssize_t sendfile(int out_fd, int in_fd, off_t* offset, size_t count) {
  REAL(sendfile);
  if (!routed(out_fd)) return real_sendfile(out_fd, in_fd, offset, count);
  char buffer[65536];
  size_t want = count < sizeof buffer ? count : sizeof buffer;
  REAL(pread);
  ssize_t got = offset != nullptr ? real_pread(in_fd, buffer, want, *offset) : read(in_fd, buffer, want);
  if (got <= 0) return got;
  ssize_t sent;
  {
    Inside inside;
    sent = rsend(out_fd, buffer, static_cast<size_t>(got), 0);
  }
  if (sent > 0) {
    if (offset != nullptr)
      *offset += sent;
    else if (sent < got)
      lseek(in_fd, sent - got, SEEK_CUR);
  }
  return sent;
}
