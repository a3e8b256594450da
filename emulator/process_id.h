// This process's id, without a system call per use: the data path asks for
// it on every work request, and glibc's getpid() always enters the kernel.
#pragma once

#include <sys/types.h>

namespace softverbs {

// Correct across fork(): a child re-reads it.
pid_t current_pid();

// True while process `pid` exists (one of another user counts: kill() says
// EPERM); false for pid <= 0.
bool process_alive(pid_t pid);

}  // namespace softverbs
