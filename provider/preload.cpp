// libsoftverbs-preload.so, put in LD_PRELOAD by `softverbs run`.
//
// Where the RDMA netlink socket works (ib_core loaded: every host with a real
// HCA), libibverbs never scans sysfs and so never sees softverbs devices.
// Refusing NETLINK_RDMA sockets, as a kernel without ib_core does, makes it
// take the sysfs path, where the generated tree lists softverbs devices next
// to links to the real ones.
#include <linux/netlink.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

extern "C" __attribute__((visibility("default"))) int socket(int domain, int type, int protocol) {
  if (domain == AF_NETLINK && protocol == NETLINK_RDMA) {
    errno = EPROTONOSUPPORT;
    return -1;
  }
  return static_cast<int>(syscall(SYS_socket, domain, type, protocol));
}

// ---- completion channels --------------------------------------------------
//
// libibverbs creates a completion channel with a kernel command and no
// provider hook. For a softverbs context we make the channel ourselves: a
// datagram socket with an abstract address, to which whichever process
// completes work on an armed CQ sends the 8-byte CQ handle that
// ibv_get_cq_event reads. ibv_destroy_comp_channel's close()+free() suit it.
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <sys/un.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

bool is_softverbs_context(const ibv_context* context) {
  if (context == nullptr || context->device == nullptr) return false;
  std::string marker = std::string(context->device->ibdev_path) + "/softverbs.conf";
  return access(marker.c_str(), F_OK) == 0;
}

ibv_comp_channel* create_softverbs_channel(ibv_context* context) {
  int fd = static_cast<int>(syscall(SYS_socket, AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd < 0) return nullptr;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  // Autobind: the kernel picks a unique abstract name.
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(sa_family_t)) != 0) {
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

}  // namespace

extern "C" __attribute__((visibility("default"))) ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  if (is_softverbs_context(context)) return create_softverbs_channel(context);
  using Create = ibv_comp_channel* (*)(ibv_context*);
  static Create real = reinterpret_cast<Create>(dlvsym(RTLD_NEXT, "ibv_create_comp_channel", "IBVERBS_1.0"));
  if (real == nullptr) {
    errno = ENOSYS;
    return nullptr;
  }
  return real(context);
}
