// Registered memory that peers can map: the shared-memory transport's way to
// move bytes between processes with a plain memcpy instead of a system call
// per operation.
//
// At registration the owner turns the region's pages into pages of a memfd,
// in place: the contents are copied into the memfd and the memfd is mapped
// over the same addresses (MAP_FIXED), so the application keeps its pointers
// and sees no difference. The region must be whole pages of private,
// anonymous, writable memory (what posix_memalign, mmap and the heap give for
// page-aligned buffers); anything else keeps the system-call path. The pages
// are marked MADV_DONTFORK (a fork handler gives a child its own copy instead)
// until deregistration makes them private pages again. A peer
// takes the memfd from the owner with pidfd_getfd (the same permission
// process_vm_writev needs) and maps it once; afterwards a WRITE, READ or SEND
// into that region is a memcpy. A region inside one attachment of a System V
// shared memory segment (huge pages included) is shared as it is: peers
// attach the segment (shmat, with the segment's own permission).
//
// SOFTVERBS_SHARE_MR=0 turns it off (every copy takes the system-call path).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>

#include "device/memory_region_table.h"

namespace softverbs {

// Whether regions are shared at all (SOFTVERBS_SHARE_MR, default on).
bool region_sharing_enabled();

// Whether [address, address + length) may be registered: 0; EINVAL if the
// range wraps past 2^64; EFAULT if part of it is not mapped, or not
// readable, or not writable where `writable` (what an HCA's driver finds
// when it pins the pages with the access asked for).
int check_registrable(uint64_t address, uint64_t length, bool writable);

// In the owner, at registration: the backing of [address, address + length),
// made now or found among the ones made before (a region inside one shares
// it). nullopt if the memory does not qualify; `why` says why.
std::optional<SharedBacking> share_pages(uint64_t address, uint64_t length, const char** why = nullptr);

// In the owner, at deregistration: drops the region's hold on the backing.
// With the last hold the pages become private (copy-on-write) pages of the
// same bytes, inherited by fork() again, and the descriptor closes.
void release_pages(const SharedBacking& backing);

// In a peer: this process's address of owner address `address` in the
// region (checked by the caller against the MR table, under the device's
// memory_lock), through a cached mapping of the owner's memfd; nullptr if
// the owner's backing cannot be mapped here (then copy another way).
uint8_t* peer_view(pid_t owner, const SharedBacking& backing, uint64_t address, uint64_t length);

// Mappings of other processes' regions this process holds (for tests).
size_t peer_view_count();

// Device memory (device_memory_allocation.h) of `length` bytes: a memfd
// mapping in this process, zero-filled, whole pages, which peers map as a
// region's backing (peer_view). nullopt if it cannot be made (errno says).
std::optional<SharedBacking> map_device_memory(uint64_t length);
// Unmaps it and closes its descriptor.
void unmap_device_memory(const SharedBacking& backing);

}  // namespace softverbs
