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
