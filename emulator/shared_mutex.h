// A mutex that lives in memory shared between processes and survives the
// death of a process holding it (robust, process-shared pthread mutex).
#pragma once

#include <pthread.h>

namespace softverbs {

class SharedMutex {
 public:
  // Call once, on zeroed shared memory, before any process uses it.
  void initialize();
  void lock();
  void unlock() { pthread_mutex_unlock(&mutex_); }

 private:
  pthread_mutex_t mutex_;
};

class SharedLock {
 public:
  explicit SharedLock(SharedMutex& mutex) : mutex_(mutex) { mutex_.lock(); }
  ~SharedLock() { mutex_.unlock(); }
  SharedLock(const SharedLock&) = delete;
  SharedLock& operator=(const SharedLock&) = delete;

 private:
  SharedMutex& mutex_;
};

}  // namespace softverbs
