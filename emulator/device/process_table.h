// The processes that use a device, as the device sees them: one record per
// process in device memory, saying whether it still lives without asking
// the kernel.
//
// Each record holds a robust, process-shared mutex that a thread of the
// process locks when it joins and holds until the process ends. However the
// process ends (exit, exec, SIGKILL), the kernel walks the thread's robust
// list and marks the mutex's futex word "owner died", so a peer learns of
// the death from one load of a cache line that never changes while the
// process lives: cheap enough for every work request, and immune to the
// reuse of process ids that kill(pid, 0) is not.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <cstdint>

namespace softverbs {

struct ProcessRecord {
  pthread_mutex_t life;  // held by the process's presence thread while it lives
  int32_t pid = 0;       // 0: a free record
  uint32_t reserved = 0;
  uint64_t start_time = 0;  // the kernel's start time of `pid` (/proc/<pid>/stat), for diagnostics
};

class ProcessTable {
 public:
  static constexpr int kCapacity = 4096;

  // Call once, on zeroed shared memory, before any process uses it.
  void initialize();

  // A free record for process `pid`, its life mutex initialized and
  // unlocked; -1 if none is free. The caller holds the device's
  // objects_lock until its presence thread holds the mutex (hold), so that
  // no one sees the record taken but not alive. Records of dead processes
  // are free only once release_if_dead has run, after the objects they
  // owned were reclaimed: until then those objects stay dead.
  int claim(pid_t pid);
  // Locks the life mutex of `slot` for the calling thread, which must then
  // live as long as the process. False if it cannot.
  bool hold(int slot);

  // Whether the process of `slot` lives: its presence thread holds the
  // life mutex. False for -1 and free records.
  bool alive(int slot) const;
  pid_t pid_of(int slot) const;
  // Frees the record of a dead process (objects_lock held), so that claim
  // can reuse it once nothing refers to it any more.
  void release_if_dead(int slot);

 private:
  ProcessRecord records_[kCapacity];
};

// The kernel's start time of process `pid` (field 22 of /proc/<pid>/stat),
// or 0 if it does not exist. With the pid it names one process for good.
uint64_t process_start_time(pid_t pid);

}  // namespace softverbs
