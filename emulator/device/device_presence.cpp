// How a process joins a device: a record in the device's ProcessTable whose
// life mutex one thread of the process holds until the process ends. That
// thread is the process's copy agent too: it sleeps in recv() and costs
// nothing while no peer needs it.
#include <unistd.h>

#include <future>
#include <mutex>
#include <thread>

#include "device/device_memory.h"
#include "shm/memory_copy.h"
#include "support/process_id.h"
#include "support/signals.h"

namespace softverbs {

namespace {

// The presence thread: holds the record (so that peers see this process
// alive), says so, then serves copies for as long as the process lives.
// It never returns while the process runs: its end would look like the
// process's death.
void stay_present(std::shared_ptr<DeviceMemory> memory, int slot, int agent_fd, std::promise<bool> joined) {
  block_signals_on_this_thread();
  const bool holding = memory->shared().processes.hold(slot);
  joined.set_value(holding);
  if (!holding) return;
  if (agent_fd >= 0) serve_copy_requests(*memory, agent_fd);
  for (;;) pause();
}

}  // namespace

int DeviceMemory::process_slot() {
  const auto pid = static_cast<uint32_t>(current_pid());
  const uint64_t known = process_slot_.load(std::memory_order_acquire);
  if (known != 0 && known >> 32 == pid) return static_cast<int>(known & 0xffffffffu);
  // The threads of one process join once.
  static std::mutex joining;
  std::lock_guard guard(joining);
  const uint64_t again = process_slot_.load(std::memory_order_acquire);
  if (again != 0 && again >> 32 == pid) return static_cast<int>(again & 0xffffffffu);

  const int agent_fd = open_copy_agent_socket(*this);
  int slot;
  {
    // Held until the presence thread holds the record: no peer may see it
    // taken but not alive (see ProcessTable::claim).
    SharedLock lock(shared().objects_lock);
    slot = shared().processes.claim(static_cast<pid_t>(pid));
    if (slot < 0) {
      if (agent_fd >= 0) close(agent_fd);
      return -1;
    }
    std::promise<bool> joined;
    std::future<bool> held = joined.get_future();
    std::thread(stay_present, shared_from_this(), slot, agent_fd, std::move(joined)).detach();
    if (!held.get()) {
      shared().processes.release_if_dead(slot);
      return -1;
    }
  }
  process_slot_.store(uint64_t{pid} << 32 | static_cast<uint32_t>(slot), std::memory_order_release);
  return slot;
}

}  // namespace softverbs
