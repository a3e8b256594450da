// The checks about registered memory that need the regions this process
// has: given back to the system under a live region and then used (through the check
// preload, check_preload_interface.h), and fork() with regions registered
// but libibverbs' fork support off.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>

namespace softverbs::provider::check {

// A region of the process's memory (not on-demand: its pages are not
// pinned, and unmapping them is legitimate) is registered or goes.
// `mr` is the region's identity (its ibv_mr).
void region_registered(const ibv_mr* mr, const void* address, size_t length);
void region_deregistered(const ibv_mr* mr);

// A region whose memory was given back (munmap, free) while it was live is
// reported when a work request names it: at the post of these chains.
void freed_regions_at_send(ibv_qp* qp, const ibv_send_wr* chain, const void* call_site);
void freed_regions_at_receive(ibv_qp* qp, const ibv_recv_wr* chain, const void* call_site);

}  // namespace softverbs::provider::check
