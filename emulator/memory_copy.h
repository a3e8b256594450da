// Moving bytes between the address spaces of the processes that share a
// device: the one copy of the shared-memory transport. Within one process it
// is memcpy; across processes, process_vm_readv/writev (the kernel checks
// that the caller may access the target, as it would for ptrace).
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <span>

namespace softverbs {

// Copies the bytes of `local` (this process) into `remote` (process `pid`).
// Returns 0 or an errno (EFAULT: a range was not mapped; EPERM: the kernel
// refused cross-process access).
int copy_to_process(pid_t pid, std::span<const iovec> local, std::span<const iovec> remote);
// Copies from `remote` (process `pid`) into `local` (this process).
int copy_from_process(pid_t pid, std::span<const iovec> local, std::span<const iovec> remote);

}  // namespace softverbs
