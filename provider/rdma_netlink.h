// RDMA netlink for the tools that ask it about devices: iproute2's `rdma dev`
// and `rdma link` (which rdma-core 56's pyverbs tests run to find a port's
// network device), `rdma resource` and `rdma statistic`. Where the kernel has
// no RDMA netlink (no ib_core), the preload gives such a program a netlink
// socket of the user-socket family and answers its device and port queries
// itself, from the sysfs tree the program sees, and a softverbs device's
// resources and counters from its memory (device_snapshot.h). libibverbs' own queries, which go through libnl, are still refused,
// so that it scans that tree (see preload.cpp).
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <span>

namespace softverbs::preload {

// A socket standing for socket(AF_NETLINK, type, NETLINK_RDMA); -1 with errno.
int open_emulated_rdma_netlink(int type);

// If `fd` is such a socket, answers the requests in `request` (the buffers
// of one send, in order) on it, puts what the send returns in *sent, and
// returns true.
bool answer_if_emulated(int fd, std::span<const iovec> request, ssize_t* sent);

// Whether the code at `caller` belongs to libnl or libibverbs.
bool called_from_verbs_library(const void* caller);

}  // namespace softverbs::preload
