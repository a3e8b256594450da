#include "shm/shared_regions.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "support/debug_log.h"
#include "support/internal_mappings.h"
#include "support/random_bits.h"

namespace softverbs {

namespace {

constexpr size_t kMaxPeerViews = 256;

uint64_t page_size() {
  static const uint64_t size = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return size;
}

std::string memfd_name(uint64_t id) {
  char name[64];
  std::snprintf(name, sizeof name, "softverbs-mr-%016llx", static_cast<unsigned long long>(id));
  return name;
}

// One line of /proc/self/maps, the fields that matter here.
struct Mapping {
  uint64_t low = 0, high = 0;  // [low, high)
  std::string permissions;     // "rw-p", "rw-s", ...
  uint64_t offset = 0;         // into the file or segment
  std::string inode;
  std::string path;  // empty for anonymous memory
};

// This process's mappings, in address order.
std::vector<Mapping> read_mappings() {
  std::vector<Mapping> mappings;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string range, offset, device;
    Mapping& mapping = mappings.emplace_back();
    fields >> range >> mapping.permissions >> offset >> device >> mapping.inode;
    std::getline(fields >> std::ws, mapping.path);
    mapping.low = std::stoull(range.substr(0, range.find('-')), nullptr, 16);
    mapping.high = std::stoull(range.substr(range.find('-') + 1), nullptr, 16);
    mapping.offset = std::stoull(offset, nullptr, 16);
  }
  return mappings;
}

// Whether every byte of [start, end) is mapped (no hole) and every mapping
// that covers part of it passes `accept`.
template <typename Accept>
bool every_mapping_of(const std::vector<Mapping>& mappings, uint64_t start, uint64_t end, Accept accept) {
  uint64_t covered = start;
  for (const Mapping& mapping : mappings) {
    if (covered >= end) break;
    if (mapping.high <= covered) continue;
    if (mapping.low > covered || !accept(mapping)) return false;
    covered = mapping.high;
  }
  return covered >= end;
}

}  // namespace

int check_registrable(uint64_t address, uint64_t length, bool writable) {
  if (length == 0) return 0;
  if (address + length < address) return EINVAL;
  const bool accessible = every_mapping_of(read_mappings(), address, address + length, [&](const Mapping& m) {
    return m.permissions.size() >= 2 && m.permissions[0] == 'r' && (!writable || m.permissions[1] == 'w');
  });
  return accessible ? 0 : EFAULT;
}

namespace {

// Writes `bytes` at `offset` of `fd` from `from`; false on an error.
bool write_all(int fd, const uint8_t* from, uint64_t bytes, uint64_t offset) {
  while (bytes > 0) {
    const ssize_t written = pwrite(fd, from, bytes, static_cast<off_t>(offset));
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return false;
    from += written;
    bytes -= static_cast<uint64_t>(written);
    offset += static_cast<uint64_t>(written);
  }
  return true;
}

// Writes the pages of [from, from + length) that the process has touched
// (present, or swapped out) into `fd`, which is zero there. An untouched
// page of anonymous memory reads as zero: copying it would only fault it in,
// and buffers are often registered before they are written (UCX's pools).
// The kernel's copy (pwrite) allocates the memfd's pages as it goes, where a
// copy through a mapping of it would take a page fault per page. Without
// /proc/self/pagemap every page is written.
bool write_touched_pages(int fd, const uint8_t* from, uint64_t length) {
  const uint64_t page = page_size();
  const int pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (pagemap < 0) return write_all(fd, from, length, 0);
  constexpr uint64_t kPresent = 1ull << 63, kSwapped = 1ull << 62;
  constexpr size_t kEntriesPerRead = 4096;
  std::vector<uint64_t> entries(kEntriesPerRead);
  const uint64_t pages = length / page;
  const uint64_t first_page = reinterpret_cast<uint64_t>(from) / page;
  uint64_t run_start = 0, run_pages = 0;  // a run of touched pages, written at once
  bool ok = true;
  auto write_run = [&] {
    if (run_pages != 0) ok = ok && write_all(fd, from + run_start * page, run_pages * page, run_start * page);
    run_pages = 0;
  };
  for (uint64_t done = 0; done < pages && ok;) {
    const size_t count = static_cast<size_t>(std::min<uint64_t>(kEntriesPerRead, pages - done));
    const auto bytes = static_cast<ssize_t>(count * sizeof(uint64_t));
    if (pread(pagemap, entries.data(), static_cast<size_t>(bytes),
              static_cast<off_t>((first_page + done) * sizeof(uint64_t))) != bytes) {
      write_run();
      ok = ok && write_all(fd, from + done * page, (pages - done) * page, done * page);  // the rest, whole
      break;
    }
    for (size_t i = 0; i < count; ++i) {
      if (entries[i] & (kPresent | kSwapped)) {
        if (run_pages == 0) run_start = done + i;
        ++run_pages;
      } else {
        write_run();
      }
    }
    done += count;
  }
  write_run();
  close(pagemap);
  return ok;
}

// Is every byte of [start, end) private, anonymous, readable and writable
// memory (and nothing else: no file, no hugetlb, no special mapping)?
bool private_anonymous(uint64_t start, uint64_t end) {
  return every_mapping_of(read_mappings(), start, end, [](const Mapping& m) {
    return m.permissions == "rw-p" && m.inode == "0" && (m.path.empty() || m.path == "[heap]");
  });
}

// The System V shared memory segment attached read-write at exactly the
// mapping that holds all of [start, end), if one is: -1 otherwise. The
// kernel names such a mapping "/SYSV<key>" with the segment's id as inode
// (UCX allocates its buffers this way where huge pages are reserved).
int sysv_segment(uint64_t start, uint64_t end, uint64_t& base, uint64_t& length) {
  for (const Mapping& m : read_mappings()) {
    if (m.high <= start) continue;
    if (m.low > start || m.high < end || m.permissions != "rw-s" || m.path.rfind("/SYSV", 0) != 0 || m.offset != 0)
      return -1;
    base = m.low;
    length = m.high - m.low;
    const unsigned long id = std::strtoul(m.inode.c_str(), nullptr, 10);
    return id <= static_cast<unsigned long>(INT32_MAX) ? static_cast<int>(id) : -1;
  }
  return -1;
}

// Is the backing's range still mapped, read-write, from its memfd and
// nothing else (the application may have unmapped, remapped or protected it
// since it registered)?
bool mapped_from_backing(const std::vector<Mapping>& mappings, const SharedBacking& backing) {
  const std::string name = "/memfd:" + memfd_name(backing.id);
  return every_mapping_of(mappings, backing.base, backing.base + backing.length,
                          [&](const Mapping& m) { return m.permissions == "rw-s" && m.path.rfind(name, 0) == 0; });
}

// Maps the backing's memfd privately over its own shared mapping: the same
// bytes, now copy-on-write pages without MADV_DONTFORK, so that memory the
// allocator hands out again behaves as any other (a forked child gets its
// own copy; nothing written reaches the memfd). Nothing is copied now; the
// first write to each page copies that page.
void make_pages_private(const SharedBacking& backing) {
  auto* base = reinterpret_cast<void*>(backing.base);
  if (!mapped_from_backing(read_mappings(), backing)) {
    debug_log("MR pages at %p are no longer the registered mapping: left as they are", base);
    return;
  }
  if (mmap(base, backing.length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, backing.fd, 0) == MAP_FAILED)
    debug_log("cannot make the pages at %p private: %s", base, std::strerror(errno));
}

struct OwnedBacking {
  SharedBacking backing;
  int holds = 0;
};

std::mutex owned_mutex;
std::map<uint64_t, OwnedBacking> owned;  // by base address

// fork(): kernels since 5.13 copy an HCA's pinned pages into a child, so
// with rdma-core on such a kernel a child reads its own copy of registered
// memory. The memfd pages are MADV_DONTFORK (a shared mapping would carry
// the child's writes into the parent), so before fork each backing is copied
// into anonymous pages, which the child inherits and moves into place.
struct ForkCopy {
  uint64_t base;
  uint64_t length;
  void* copy;
};
std::vector<ForkCopy> fork_copies;  // from the prepare handler to the others

void copy_registered_pages_before_fork() {
  owned_mutex.lock();  // held across fork(): no registration changes meanwhile
  if (owned.empty()) return;
  const std::vector<Mapping> mappings = read_mappings();
  for (const auto& [base, backing] : owned) {
    // Pages the application unmapped or protected since are not copied.
    if (!mapped_from_backing(mappings, backing.backing)) continue;
    const uint64_t length = backing.backing.length;
    void* copy = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (copy == MAP_FAILED) continue;  // the child lacks these pages, as under ibv_fork_init()
    std::memcpy(copy, reinterpret_cast<const void*>(base), length);
    fork_copies.push_back({base, length, copy});
  }
}

void drop_fork_copies_in_parent() {
  for (const ForkCopy& c : fork_copies) munmap(c.copy, c.length);
  fork_copies.clear();
  owned_mutex.unlock();
}

void place_fork_copies_in_child() {
  for (const ForkCopy& c : fork_copies)
    if (mremap(c.copy, c.length, c.length, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(c.base)) ==
        MAP_FAILED)
      munmap(c.copy, c.length);
  fork_copies.clear();
  // The parent's registrations are not the child's.
  for (const auto& [base, backing] : owned) close(backing.backing.fd);
  owned.clear();
  owned_mutex.unlock();
}

struct PeerView {
  uint8_t* mapping = nullptr;  // nullptr: could not be mapped (not retried)
  uint64_t length = 0;
  bool attached = false;  // a System V segment (shmdt), not a mapping (munmap)
  uint64_t last_use = 0;
};

std::mutex peer_mutex;
std::unordered_map<uint64_t, PeerView> peer_views;  // by backing id (random, unique per backing)
uint64_t peer_clock = 0;

long pidfd_open(pid_t pid) { return syscall(SYS_pidfd_open, pid, 0); }
long pidfd_getfd(int pidfd, int fd) { return syscall(SYS_pidfd_getfd, pidfd, fd, 0); }

// Maps the owner's memfd, after checking that the descriptor it names is
// the backing the MR table says (descriptor numbers can be reused).
uint8_t* map_peer(pid_t owner, const SharedBacking& backing) {
  int pidfd = static_cast<int>(pidfd_open(owner));
  if (pidfd < 0) return nullptr;
  int fd = static_cast<int>(pidfd_getfd(pidfd, backing.fd));
  int error = errno;
  close(pidfd);
  if (fd < 0) {
    debug_log("cannot take the memory of process %d (%s): copies into it take the system-call path", owner,
              std::strerror(error));
    return nullptr;
  }
  char link[128] = {};
  std::string self = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(self.c_str(), link, sizeof link - 1);
  struct stat info {};
  bool ours = n > 0 && std::strstr(link, memfd_name(backing.id).c_str()) != nullptr && fstat(fd, &info) == 0 &&
              static_cast<uint64_t>(info.st_size) == backing.length;
  void* mapping = MAP_FAILED;
  // Populated now: the owner's pages all exist (registration copied them
  // in), and a first touch of each later cost a page fault in the data path
  // (UCX cycling through thousands of receive buffers ran at 13 us a
  // message until every page had been touched once).
  if (ours) mapping = mmap(nullptr, backing.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  return mapping == MAP_FAILED ? nullptr : static_cast<uint8_t*>(mapping);
}

// Attaches the owner's System V segment, after checking that the id still
// names one at least as large as the backing (an id is reused only after
// its index has cycled through a new sequence number). Permission is the
// segment's own: another user's stays on the system-call path.
uint8_t* attach_segment(pid_t owner, const SharedBacking& backing) {
  shmid_ds status{};
  if (shmctl(backing.sysv_shm_id, IPC_STAT, &status) != 0 || status.shm_segsz < backing.length) {
    debug_log("cannot attach the memory of process %d (segment %d: %s): copies into it take the system-call path",
              owner, backing.sysv_shm_id, std::strerror(errno));
    return nullptr;
  }
  void* mapping = shmat(backing.sysv_shm_id, nullptr, 0);
  return mapping == reinterpret_cast<void*>(-1) ? nullptr : static_cast<uint8_t*>(mapping);
}

}  // namespace

bool region_sharing_enabled() {
  static const bool enabled = [] {
    const char* text = std::getenv("SOFTVERBS_SHARE_MR");
    return text == nullptr || std::strcmp(text, "0") != 0;
  }();
  return enabled;
}

std::optional<SharedBacking> share_pages(uint64_t address, uint64_t length, const char** why) {
  auto refuse = [&](const char* reason) -> std::optional<SharedBacking> {
    if (why) *why = reason;
    return std::nullopt;
  };
  if (!region_sharing_enabled()) return refuse("SOFTVERBS_SHARE_MR=0");
  // Shared by nature: peers attach the segment itself, and nothing moves.
  if (SharedBacking segment;
      length != 0 && address + length > address &&
      (segment.sysv_shm_id = sysv_segment(address, address + length, segment.base, segment.length)) >= 0) {
    segment.id = random_u64();
    return segment;
  }
  const uint64_t page = page_size();
  if (length == 0 || address % page != 0 || length % page != 0)
    return refuse("not whole pages: pages shared with other data are never moved");
  static const bool fork_handled = [] {
    return pthread_atfork(copy_registered_pages_before_fork, drop_fork_copies_in_parent, place_fork_copies_in_child) ==
           0;
  }();
  if (!fork_handled) return refuse("pthread_atfork failed");
  std::lock_guard guard(owned_mutex);
  // Inside a backing made before (a second registration of the same buffer)?
  auto it = owned.upper_bound(address);
  if (it != owned.begin()) {
    --it;
    OwnedBacking& existing = it->second;
    if (address >= existing.backing.base && address + length <= existing.backing.base + existing.backing.length) {
      ++existing.holds;
      return existing.backing;
    }
  }
  if (!private_anonymous(address, address + length)) return refuse("not private anonymous writable memory");
  SharedBacking backing;
  backing.id = random_u64();
  backing.base = address;
  backing.length = length;
  int fd = memfd_create(memfd_name(backing.id).c_str(), MFD_CLOEXEC);
  if (fd < 0) return refuse("memfd_create failed");
  if (ftruncate(fd, static_cast<off_t>(length)) != 0) {
    close(fd);
    return refuse("ftruncate failed");
  }
  // The contents move to the memfd, which then takes the pages' place.
  if (!write_touched_pages(fd, reinterpret_cast<const uint8_t*>(address), length)) {
    close(fd);
    return refuse("copying the region into its memfd failed");
  }
  // Populated, as the peers' views are: the pages exist already.
  void* placed = mmap(reinterpret_cast<void*>(address), length, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0);
  if (placed == MAP_FAILED) {
    // MAP_FIXED failed before replacing anything: the original pages stay.
    close(fd);
    return refuse("mmap over the region failed");
  }
  madvise(reinterpret_cast<void*>(address), length, MADV_DONTFORK);
  backing.fd = fd;
  owned[address] = OwnedBacking{backing, 1};
  return backing;
}

void release_pages(const SharedBacking& backing) {
  if (backing.fd < 0) return;
  std::lock_guard guard(owned_mutex);
  auto it = owned.find(backing.base);
  if (it == owned.end() || it->second.backing.id != backing.id) return;
  if (--it->second.holds > 0) return;
  // The buffer is the application's again, and must fork like ordinary
  // memory. (A later registration of it takes the system-call path.)
  make_pages_private(it->second.backing);
  close(it->second.backing.fd);
  owned.erase(it);
}

uint8_t* peer_view(pid_t owner, const SharedBacking& backing, uint64_t address, uint64_t length) {
  if ((backing.fd < 0 && backing.sysv_shm_id < 0) || address < backing.base || length > backing.length ||
      address - backing.base > backing.length - length)
    return nullptr;
  std::lock_guard guard(peer_mutex);
  auto it = peer_views.find(backing.id);
  if (it == peer_views.end()) {
    if (peer_views.size() >= kMaxPeerViews) {
      // Forget the least recently used mapping.
      auto oldest = peer_views.begin();
      for (auto at = peer_views.begin(); at != peer_views.end(); ++at)
        if (at->second.last_use < oldest->second.last_use) oldest = at;
      if (oldest->second.mapping) {
        forget_internal_mapping(oldest->second.mapping);
        if (oldest->second.attached)
          shmdt(oldest->second.mapping);
        else
          munmap(oldest->second.mapping, oldest->second.length);
      }
      peer_views.erase(oldest);
    }
    PeerView view;
    view.mapping = backing.sysv_shm_id >= 0 ? attach_segment(owner, backing) : map_peer(owner, backing);
    view.length = backing.length;
    view.attached = backing.sysv_shm_id >= 0;
    if (view.mapping) note_internal_mapping(view.mapping, view.length);
    it = peer_views.emplace(backing.id, view).first;
  }
  it->second.last_use = ++peer_clock;
  if (it->second.mapping == nullptr) return nullptr;
  return it->second.mapping + (address - backing.base);
}

std::optional<SharedBacking> map_device_memory(uint64_t length) {
  SharedBacking backing;
  backing.id = random_u64();
  backing.length = (length + page_size() - 1) / page_size() * page_size();
  int fd = memfd_create(memfd_name(backing.id).c_str(), MFD_CLOEXEC);
  if (fd < 0) return std::nullopt;
  void* mapping = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(backing.length)) == 0)
    mapping = mmap(nullptr, backing.length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapping == MAP_FAILED) {
    const int error = errno;
    close(fd);
    errno = error;
    return std::nullopt;
  }
  // A forked child does not inherit a device's memory.
  madvise(mapping, backing.length, MADV_DONTFORK);
  backing.fd = fd;
  backing.base = reinterpret_cast<uint64_t>(mapping);
  return backing;
}

void unmap_device_memory(const SharedBacking& backing) {
  if (backing.fd < 0) return;
  munmap(reinterpret_cast<void*>(backing.base), backing.length);
  close(backing.fd);
}

size_t peer_view_count() {
  std::lock_guard guard(peer_mutex);
  size_t count = 0;
  for (const auto& [id, view] : peer_views) count += view.mapping != nullptr;
  return count;
}

}  // namespace softverbs
