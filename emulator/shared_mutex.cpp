#include "shared_mutex.h"

#include <cerrno>

namespace softverbs {

void SharedMutex::initialize() {
  pthread_mutexattr_t attributes;
  pthread_mutexattr_init(&attributes);
  pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&mutex_, &attributes);
  pthread_mutexattr_destroy(&attributes);
}

void SharedMutex::lock() {
  // A process died holding the lock: what it protected is a queue or table
  // whose updates are single stores at the end, so taking it over is safe.
  if (pthread_mutex_lock(&mutex_) == EOWNERDEAD) pthread_mutex_consistent(&mutex_);
}

}  // namespace softverbs
