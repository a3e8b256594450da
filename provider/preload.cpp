// libsoftverbs-preload.so, put in LD_PRELOAD by `softverbs run`.
//
// Where the RDMA netlink socket works (ib_core loaded: every host with a real
// HCA), libibverbs never scans sysfs and so never sees softverbs devices.
// Refusing libibverbs' NETLINK_RDMA sockets (it opens them through libnl), as
// a kernel without ib_core does, makes it take the sysfs path, where the
// generated tree lists softverbs devices next to links to the real ones.
// Other programs (iproute2's `rdma`) get the kernel's RDMA netlink where it
// exists, and otherwise one that answers from that tree (rdma_netlink.h).
#include <dlfcn.h>
#include <linux/netlink.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "rdma_netlink.h"

extern "C" __attribute__((visibility("default"))) int socket(int domain, int type, int protocol) {
  if (domain == AF_NETLINK && protocol == NETLINK_RDMA) {
    if (softverbs::preload::called_from_verbs_library(__builtin_return_address(0))) {
      errno = EPROTONOSUPPORT;
      return -1;
    }
    const int kernels = static_cast<int>(syscall(SYS_socket, domain, type, protocol));
    if (kernels >= 0 || errno != EPROTONOSUPPORT) return kernels;
    return softverbs::preload::open_emulated_rdma_netlink(type);
  }
  return static_cast<int>(syscall(SYS_socket, domain, type, protocol));
}

// Requests on an emulated RDMA netlink socket are answered here; everything
// else passes on.
extern "C" __attribute__((visibility("default"))) ssize_t sendto(int fd, const void* buffer, size_t length, int flags,
                                                                 const sockaddr* address, socklen_t address_length) {
  ssize_t sent = 0;
  const iovec request{const_cast<void*>(buffer), length};
  if (softverbs::preload::answer_if_emulated(fd, {&request, 1}, &sent)) return sent;
  using SendTo = ssize_t (*)(int, const void*, size_t, int, const sockaddr*, socklen_t);
  static const SendTo next = reinterpret_cast<SendTo>(dlsym(RTLD_NEXT, "sendto"));
  return next(fd, buffer, length, flags, address, address_length);
}

extern "C" __attribute__((visibility("default"))) ssize_t send(int fd, const void* buffer, size_t length, int flags) {
  ssize_t sent = 0;
  const iovec request{const_cast<void*>(buffer), length};
  if (softverbs::preload::answer_if_emulated(fd, {&request, 1}, &sent)) return sent;
  using Send = ssize_t (*)(int, const void*, size_t, int);
  static const Send next = reinterpret_cast<Send>(dlsym(RTLD_NEXT, "send"));
  return next(fd, buffer, length, flags);
}

extern "C" __attribute__((visibility("default"))) ssize_t sendmsg(int fd, const msghdr* message, int flags) {
  ssize_t sent = 0;
  if (softverbs::preload::answer_if_emulated(fd, {message->msg_iov, message->msg_iovlen}, &sent)) return sent;
  using SendMsg = ssize_t (*)(int, const msghdr*, int);
  static const SendMsg next = reinterpret_cast<SendMsg>(dlsym(RTLD_NEXT, "sendmsg"));
  return next(fd, message, flags);
}

// ---- completion channels and asynchronous events ----------------------------
//
// libibverbs creates a completion channel with a kernel command and no
// provider hook. For a softverbs context we make the channel ourselves: a
// datagram socket with an abstract address, to which whichever process
// completes work on an armed CQ sends the 8-byte CQ handle that
// ibv_get_cq_event reads. ibv_destroy_comp_channel's close()+free() suit it.
//
// Any local user can send to an abstract address, and libibverbs follows
// the pointer it reads. So for softverbs contexts this library reads the
// channel and the async fd itself: a datagram counts only if its sender is
// of this user (the kernel attaches the sender's credentials) and the
// provider says the pointer in it names a live object of the context (see
// preload_interface.h). Anything else is dropped unread by libibverbs.
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <sys/un.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>

#include "device/event_socket.h"
#include "event_datagram.h"
#include "preload_interface.h"
#include "support/leaving.h"

namespace {

std::atomic<const SoftverbsHandleValidator*> validator{nullptr};

bool is_softverbs_context(const ibv_context* context) {
  if (context == nullptr || context->device == nullptr) return false;
  if (const SoftverbsHandleValidator* check = validator.load(std::memory_order_acquire))
    return check->is_context(context);
  std::string marker = std::string(context->device->ibdev_path) + "/softverbs.conf";
  return access(marker.c_str(), F_OK) == 0;
}

ibv_comp_channel* create_softverbs_channel(ibv_context* context) {
  int fd = static_cast<int>(syscall(SYS_socket, AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd < 0) return nullptr;
  const int on = 1;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  // Autobind: the kernel picks a unique abstract name.
  if (setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0 ||
      bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(sa_family_t)) != 0) {
    int saved = errno;
    close(fd);
    errno = saved;
    return nullptr;
  }
  auto* channel = static_cast<ibv_comp_channel*>(std::malloc(sizeof(ibv_comp_channel)));
  if (channel == nullptr) {
    close(fd);
    errno = ENOMEM;
    return nullptr;
  }
  channel->context = context;
  channel->fd = fd;
  channel->refcnt = 0;
  return channel;
}

// Reads datagrams until `decode` takes one (given its bytes and whether its
// sender is trusted: see event_socket.h), skipping others; -1 with errno
// when a read fails (EAGAIN on a non-blocking fd with nothing acceptable
// left).
template <typename Decode>
int read_until_accepted(int fd, Decode decode) {
  for (;;) {
    alignas(8) unsigned char bytes[32];
    const ssize_t length = softverbs::receive_from_trusted(fd, bytes, sizeof bytes);
    if (length == -1) return -1;
    const bool trusted = length >= 0;
    const size_t taken = trusted ? static_cast<size_t>(length) : 0;
    if (decode(std::span<const unsigned char>(bytes, taken), trusted)) return 0;
  }
}

template <typename Function>
Function real_function(const char* name, const char* version) {
  return reinterpret_cast<Function>(dlvsym(RTLD_NEXT, name, version));
}

}  // namespace

// The provider calls this (found with dlsym) when it loads.
extern "C" __attribute__((visibility("default"))) void softverbs_preload_register_validator(
    const SoftverbsHandleValidator* offered) {
  if (offered != nullptr && offered->version == softverbs::kValidatorVersion)
    validator.store(offered, std::memory_order_release);
}

extern "C" __attribute__((visibility("default"))) ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  if (is_softverbs_context(context)) return create_softverbs_channel(context);
  using Create = ibv_comp_channel* (*)(ibv_context*);
  static Create real = real_function<Create>("ibv_create_comp_channel", "IBVERBS_1.0");
  if (real == nullptr) {
    errno = ENOSYS;
    return nullptr;
  }
  return real(context);
}

extern "C" __attribute__((visibility("default"))) int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq,
                                                                       void** cq_context) {
  const SoftverbsHandleValidator* check = validator.load(std::memory_order_acquire);
  if (check == nullptr || channel == nullptr || !check->is_context(channel->context)) {
    using Get = int (*)(ibv_comp_channel*, ibv_cq**, void**);
    static Get real = real_function<Get>("ibv_get_cq_event", "IBVERBS_1.1");
    if (real == nullptr) {
      errno = ENOSYS;
      return -1;
    }
    return real(channel, cq, cq_context);
  }
  const uint64_t waited = check->wait_for_cq_event(channel);
  if (waited == softverbs::kCqEventWaitInterrupted) return -1;  // errno EINTR, as the kernel's read
  ibv_cq* taken = reinterpret_cast<ibv_cq*>(waited);
  if (taken == nullptr &&
      read_until_accepted(channel->fd, [&](std::span<const unsigned char> bytes, bool trusted_sender) {
        auto named = softverbs::decode_channel_datagram(bytes, trusted_sender, channel, *check);
        if (named) taken = *named;
        return named.has_value();
      }) != 0)
    return -1;
  *cq = taken;
  *cq_context = taken->cq_context;
  check->cq_event_delivered(reinterpret_cast<uint64_t>(taken));
  return 0;
}

extern "C" __attribute__((visibility("default"))) int ibv_get_async_event(ibv_context* context,
                                                                          ibv_async_event* event) {
  const SoftverbsHandleValidator* check = validator.load(std::memory_order_acquire);
  if (check == nullptr || !check->is_context(context)) {
    using Get = int (*)(ibv_context*, ibv_async_event*);
    static Get real = real_function<Get>("ibv_get_async_event", "IBVERBS_1.1");
    if (real == nullptr) {
      errno = ENOSYS;
      return -1;
    }
    return real(context, event);
  }
  if (read_until_accepted(context->async_fd, [&](std::span<const unsigned char> bytes, bool trusted_sender) {
        auto decoded = softverbs::decode_async_datagram(bytes, trusted_sender, context, *check);
        if (decoded) *event = *decoded;
        return decoded.has_value();
      }) != 0)
    return -1;
  // Every element pointer shares the union's first bytes.
  check->async_event_delivered(event->event_type, reinterpret_cast<uint64_t>(event->element.cq));
  return 0;
}

// ---- leaving ----------------------------------------------------------------
//
// _exit() and _Exit() run no atexit handler. A process that leaves through
// them right after its last completion (fio's job processes do) would take
// with it the ACKs the provider holds for its next request, and its peers
// would time out on messages that landed: an HCA sent those ACKs when the
// messages arrived. The provider sends them first.
namespace {

// The next _exit: another preload's (the tracer's) or glibc's.
softverbs::leaving::ExitFunction next_exit = nullptr;
__attribute__((constructor)) void find_next_exit() { next_exit = softverbs::leaving::find_next_exit(); }

[[noreturn]] void leave(int status) {
  const SoftverbsHandleValidator* check = validator.load(std::memory_order_acquire);
  if (check != nullptr && check->before_exit != nullptr) check->before_exit();
  softverbs::leaving::pass_on(next_exit, status);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void _exit(int status) { leave(status); }
extern "C" __attribute__((visibility("default"))) void _Exit(int status) noexcept { leave(status); }
