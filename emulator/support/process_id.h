// This process's and this thread's ids, without a system call per use: the
// data path asks for them on every work request, and glibc's getpid() and
// gettid() always enter the kernel.
#pragma once

#include <sys/types.h>

namespace softverbs {

// Correct across fork(): a child re-reads it.
pid_t current_pid();

// Whether a device object whose owner is `owner_pid` was made by this
// process. A forked child holds its parent's verbs objects too and may
// destroy them (Python's collector does, in multiprocessing's children):
// that drops the child's handle, while the object stays its maker's.
inline bool made_by_this_process(pid_t owner_pid) { return owner_pid == current_pid(); }

// The calling thread's id (correct across fork() as well).
pid_t current_thread_id();

// True if thread `tid` of this process is ready to run but waits for the
// CPU that the caller runs on: another task (the caller, say) preempted it
// there. False if it runs (on another CPU), sleeps, or /proc cannot say.
// Reads /proc: for rare decisions, not for the data path.
bool thread_waits_for_this_cpu(pid_t tid);

// True while process `pid` exists (one of another user counts: kill() says
// EPERM); false for pid <= 0.
bool process_alive(pid_t pid);

}  // namespace softverbs
