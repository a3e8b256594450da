#include "device/process_table.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace softverbs {

namespace {

// The kernel's robust-futex encoding of the mutex word (linux/futex.h).
constexpr uint32_t kFutexOwnerDied = 0x40000000;
constexpr uint32_t kFutexTidMask = 0x3fffffff;

bool initialize_life_mutex(pthread_mutex_t& mutex) {
  pthread_mutexattr_t attributes;
  if (pthread_mutexattr_init(&attributes) != 0) return false;
  const bool ok = pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED) == 0 &&
                  pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST) == 0 &&
                  pthread_mutex_init(&mutex, &attributes) == 0;
  pthread_mutexattr_destroy(&attributes);
  return ok;
}

}  // namespace

void ProcessTable::initialize() {
  for (ProcessRecord& record : records_) std::construct_at(&record);
}

int ProcessTable::claim(pid_t pid) {
  for (int slot = 0; slot < kCapacity; ++slot) {
    ProcessRecord& record = records_[slot];
    if (std::atomic_ref<int32_t>(record.pid).load(std::memory_order_relaxed) != 0) continue;
    if (!initialize_life_mutex(record.life)) return -1;
    record.start_time = process_start_time(pid);
    std::atomic_ref<int32_t>(record.pid).store(pid, std::memory_order_release);
    return slot;
  }
  return -1;
}

bool ProcessTable::hold(int slot) {
  if (slot < 0 || slot >= kCapacity) return false;
  return pthread_mutex_lock(&records_[slot].life) == 0;
}

bool ProcessTable::alive(int slot) const {
  if (slot < 0 || slot >= kCapacity) return false;
  // glibc keeps a robust mutex's futex word in __lock: the holder's thread
  // id, or the kernel's "owner died" mark once that thread has gone.
  const uint32_t word = static_cast<uint32_t>(
      std::atomic_ref<int>(const_cast<int&>(records_[slot].life.__data.__lock)).load(std::memory_order_acquire));
  return (word & kFutexTidMask) != 0 && (word & kFutexOwnerDied) == 0;
}

pid_t ProcessTable::pid_of(int slot) const {
  if (slot < 0 || slot >= kCapacity) return 0;
  return std::atomic_ref<int32_t>(const_cast<int32_t&>(records_[slot].pid)).load(std::memory_order_acquire);
}

void ProcessTable::release_if_dead(int slot) {
  if (slot < 0 || slot >= kCapacity || pid_of(slot) == 0 || alive(slot)) return;
  ProcessRecord& record = records_[slot];
  record.start_time = 0;
  std::atomic_ref<int32_t>(record.pid).store(0, std::memory_order_release);
}

uint64_t process_start_time(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[1024];
  const ssize_t length = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  if (length <= 0) return 0;
  text[length] = '\0';
  // Fields are counted from the ')' that ends field 2 (comm may hold spaces).
  const char* field = std::strrchr(text, ')');
  if (field == nullptr) return 0;
  for (int number = 3; number <= 22; ++number) {
    field = std::strchr(field, ' ');
    if (field == nullptr) return 0;
    ++field;
  }
  return std::strtoull(field, nullptr, 10);
}

}  // namespace softverbs
