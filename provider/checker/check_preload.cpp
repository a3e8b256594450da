// libsoftverbs-check.so, put in LD_PRELOAD by `softverbs run` in check mode.
//
// Registered memory given back to the system while a region covers it: on
// an HCA the region keeps the old pages pinned, the device goes on reading
// and writing them, and whatever the application maps there next never sees
// that data. glibc's free() unmaps large (mmap-backed) chunks with an
// internal munmap this library cannot interpose, so free() is interposed
// too and looks at the chunk's IS_MMAPPED bit. Both are on hot paths: with
// no region registered they cost one atomic load.
//
// Not linked to the emulator; reports go through the provider
// (check_preload_interface.h).
#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include "checker/check_preload_interface.h"

extern "C" void __libc_free(void* pointer);

namespace {

struct Region {
  uint64_t identity;
  uint64_t start;
  uint64_t end;
};

std::atomic<int> live_regions{0};
std::atomic<const SoftverbsCheckReporter*> reporter{nullptr};
std::mutex regions_mutex;
std::vector<Region>& regions() {
  static auto* table = new std::vector<Region>;  // never destroyed: free() may run after exit's destructors
  return *table;
}

using FreeFunction = void (*)(void*);
using MunmapFunction = int (*)(void*, size_t);
FreeFunction real_free = nullptr;
MunmapFunction real_munmap = nullptr;
// Whether free() is glibc's, whose chunk header this library reads.
bool glibc_chunks = false;

// A report's own allocations and frees are not checked.
thread_local bool reporting __attribute__((tls_model("initial-exec"))) = false;

// Marks this thread as in the library: the table's own reallocations (whose
// old buffers go through free() here) must not come back for the lock held.
class InLibrary {
 public:
  InLibrary() : outer_(reporting) { reporting = true; }
  ~InLibrary() { reporting = outer_; }
  InLibrary(const InLibrary&) = delete;
  InLibrary& operator=(const InLibrary&) = delete;

 private:
  bool outer_;
};

__attribute__((constructor)) void resolve_real_functions() {
  real_free = reinterpret_cast<FreeFunction>(dlsym(RTLD_NEXT, "free"));
  real_munmap = reinterpret_cast<MunmapFunction>(dlsym(RTLD_NEXT, "munmap"));
  Dl_info info{};
  glibc_chunks = real_free != nullptr && dladdr(reinterpret_cast<void*>(real_free), &info) != 0 &&
                 info.dli_fname != nullptr && std::strstr(info.dli_fname, "libc.so") != nullptr;
}

void report_if_covered(uint64_t start, uint64_t length, const char* verb, const void* call_site) {
  if (reporting || length == 0) return;
  const uint64_t end = start + length;
  std::vector<Region> hit;
  {
    InLibrary inside;
    std::lock_guard guard(regions_mutex);
    for (const Region& region : regions())
      if (region.start < end && start < region.end) hit.push_back(region);
  }
  const SoftverbsCheckReporter* to = reporter.load(std::memory_order_acquire);
  if (hit.empty() || to == nullptr) return;
  reporting = true;
  for (const Region& region : hit) {
    char what[200];
    std::snprintf(what, sizeof what, "%s of [0x%" PRIx64 ", 0x%" PRIx64 ")", verb, start, end);
    to->freed(region.identity, what, call_site);
  }
  reporting = false;
}

// glibc's chunk header, before the pointer malloc returned: the size word
// (flag bit 1: IS_MMAPPED) and, for an mmapped chunk, the distance from the
// mapping's start to the chunk.
void check_freed_chunk(void* pointer, const void* call_site) {
  const auto* header = static_cast<const size_t*>(pointer);
  const size_t size_word = header[-1];
  if ((size_word & 2) == 0) return;
  const uint64_t chunk = reinterpret_cast<uint64_t>(pointer) - 2 * sizeof(size_t);
  const uint64_t offset = header[-2];
  report_if_covered(chunk - offset, offset + (size_word & ~size_t{7}), "free() of an mmap-backed chunk", call_site);
}

void registered(uint64_t identity, uint64_t start, uint64_t length) {
  InLibrary inside;
  std::lock_guard guard(regions_mutex);
  regions().push_back(Region{identity, start, start + length});
  live_regions.fetch_add(1, std::memory_order_release);
}

void deregistered(uint64_t identity) {
  InLibrary inside;
  std::lock_guard guard(regions_mutex);
  auto& table = regions();
  auto found = std::find_if(table.begin(), table.end(), [&](const Region& r) { return r.identity == identity; });
  if (found == table.end()) return;
  table.erase(found);
  live_regions.fetch_sub(1, std::memory_order_release);
}

const SoftverbsCheckedRegions kCheckedRegions{softverbs::kCheckPreloadVersion, registered, deregistered};

}  // namespace

extern "C" __attribute__((visibility("default"))) const SoftverbsCheckedRegions* softverbs_check_preload_attach(
    const SoftverbsCheckReporter* offered) {
  if (offered == nullptr || offered->version != softverbs::kCheckPreloadVersion) return nullptr;
  reporter.store(offered, std::memory_order_release);
  return &kCheckedRegions;
}

extern "C" __attribute__((visibility("default"))) void free(void* pointer) {
  if (pointer != nullptr && live_regions.load(std::memory_order_relaxed) != 0 && glibc_chunks)
    check_freed_chunk(pointer, __builtin_return_address(0));
  if (real_free != nullptr)
    real_free(pointer);
  else
    __libc_free(pointer);  // before the constructor: glibc's allocator is the only one yet
}

extern "C" __attribute__((visibility("default"))) int munmap(void* address, size_t length) {
  if (live_regions.load(std::memory_order_relaxed) != 0)
    report_if_covered(reinterpret_cast<uint64_t>(address), length, "munmap()", __builtin_return_address(0));
  if (real_munmap != nullptr) return real_munmap(address, length);
  return static_cast<int>(syscall(SYS_munmap, address, length));
}
