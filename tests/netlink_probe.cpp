// Tries the sockets the preload must refuse or pass through, and prints the
// outcome of each.
#include <linux/netlink.h>
#include <netinet/in.h>
#include <netlink/netlink.h>
#include <netlink/socket.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

static void probe(const char* label, int domain, int type, int protocol) {
  int fd = socket(domain, type, protocol);
  if (fd < 0) {
    std::printf("%s: %s\n", label, std::strerror(errno));
  } else {
    std::printf("%s: ok\n", label);
    close(fd);
  }
}

// As libibverbs opens its RDMA netlink socket: through libnl.
static void probe_through_libnl() {
  nl_sock* sock = nl_socket_alloc();
  if (sock == nullptr) return;
  const int error = nl_connect(sock, NETLINK_RDMA);
  std::printf("libnl NETLINK_RDMA: %s\n", error == 0 ? "ok" : "refused");
  nl_socket_free(sock);
}

int main() {
  probe_through_libnl();
  probe("NETLINK_RDMA", AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_RDMA);
  probe("NETLINK_ROUTE", AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  probe("AF_INET", AF_INET, SOCK_DGRAM, IPPROTO_UDP);
  return 0;
}
