// This process's id, without a system call per use: the data path asks for
// it on every work request, and glibc's getpid() always enters the kernel.
#pragma once

#include <sys/types.h>

namespace softverbs {

// Correct across fork(): a child re-reads it.
pid_t current_pid();

}  // namespace softverbs
