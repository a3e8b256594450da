// The rsocket calls exist so that every binary linked against librdmacm
// loads; softverbs does not emulate rsockets yet, so each fails with ENOSYS
// (or is handed to the real librdmacm when delegating). docs/limits.md says so.
#include <rdma/rsocket.h>

#include <cerrno>
#include <cstdarg>

#include "real_librdmacm.h"

#define SV_EXPORT extern "C" __attribute__((visibility("default")))
#define SV_UNSUPPORTED(type, name, params, ...)         \
  SV_EXPORT type name params {                          \
    SOFTVERBS_FORWARD(name, "RDMACM_1.0", __VA_ARGS__); \
    errno = ENOSYS;                                     \
    return static_cast<type>(-1);                       \
  }

SV_UNSUPPORTED(int, rsocket, (int domain, int type, int protocol), domain, type, protocol)
SV_UNSUPPORTED(int, rbind, (int s, const sockaddr* addr, socklen_t len), s, addr, len)
SV_UNSUPPORTED(int, rlisten, (int s, int backlog), s, backlog)
SV_UNSUPPORTED(int, raccept, (int s, sockaddr* addr, socklen_t* len), s, addr, len)
SV_UNSUPPORTED(int, rconnect, (int s, const sockaddr* addr, socklen_t len), s, addr, len)
SV_UNSUPPORTED(int, rshutdown, (int s, int how), s, how)
SV_UNSUPPORTED(int, rclose, (int s), s)
SV_UNSUPPORTED(ssize_t, rrecv, (int s, void* buf, size_t len, int flags), s, buf, len, flags)
SV_UNSUPPORTED(ssize_t, rrecvfrom, (int s, void* buf, size_t len, int flags, sockaddr* from, socklen_t* fromlen), s,
               buf, len, flags, from, fromlen)
SV_UNSUPPORTED(ssize_t, rrecvmsg, (int s, msghdr* msg, int flags), s, msg, flags)
SV_UNSUPPORTED(ssize_t, rsend, (int s, const void* buf, size_t len, int flags), s, buf, len, flags)
SV_UNSUPPORTED(ssize_t, rsendto, (int s, const void* buf, size_t len, int flags, const sockaddr* to, socklen_t tolen),
               s, buf, len, flags, to, tolen)
SV_UNSUPPORTED(ssize_t, rsendmsg, (int s, const msghdr* msg, int flags), s, msg, flags)
SV_UNSUPPORTED(ssize_t, rread, (int s, void* buf, size_t count), s, buf, count)
SV_UNSUPPORTED(ssize_t, rreadv, (int s, const iovec* iov, int iovcnt), s, iov, iovcnt)
SV_UNSUPPORTED(ssize_t, rwrite, (int s, const void* buf, size_t count), s, buf, count)
SV_UNSUPPORTED(ssize_t, rwritev, (int s, const iovec* iov, int iovcnt), s, iov, iovcnt)
SV_UNSUPPORTED(int, rpoll, (pollfd * fds, nfds_t nfds, int timeout), fds, nfds, timeout)
SV_UNSUPPORTED(int, rselect, (int nfds, fd_set* r, fd_set* w, fd_set* e, timeval* timeout), nfds, r, w, e, timeout)
SV_UNSUPPORTED(int, rgetpeername, (int s, sockaddr* addr, socklen_t* len), s, addr, len)
SV_UNSUPPORTED(int, rgetsockname, (int s, sockaddr* addr, socklen_t* len), s, addr, len)
SV_UNSUPPORTED(int, rsetsockopt, (int s, int level, int name, const void* value, socklen_t len), s, level, name, value,
               len)
SV_UNSUPPORTED(int, rgetsockopt, (int s, int level, int name, void* value, socklen_t* len), s, level, name, value, len)
SV_UNSUPPORTED(off_t, riomap, (int s, void* buf, size_t len, int prot, int flags, off_t offset), s, buf, len, prot,
               flags, offset)
SV_UNSUPPORTED(int, riounmap, (int s, void* buf, size_t len), s, buf, len)
SV_UNSUPPORTED(size_t, riowrite, (int s, const void* buf, size_t count, off_t offset, int flags), s, buf, count, offset,
               flags)

// rfcntl is variadic: the real one takes one optional int or pointer argument.
SV_EXPORT int rfcntl(int s, int cmd, ...) {
  if (::softverbs::cm::real_librdmacm() != nullptr) {
    va_list args;
    va_start(args, cmd);
    void* argument = va_arg(args, void*);
    va_end(args);
    static auto forwarded =
        reinterpret_cast<int (*)(int, int, ...)>(::softverbs::cm::real_symbol("rfcntl", "RDMACM_1.0"));
    return forwarded(s, cmd, argument);
  }
  errno = ENOSYS;
  return -1;
}
