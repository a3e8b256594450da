// libFuzzer entry point (scripts/fuzz): a copy agent's request, as any local
// process could send one to its socket (a stranger's is dropped before
// this; this is what a request of the device's user may do). The input
// becomes the request's fields; the process has two registered regions
// with guard bytes around them, one writable and one remote-read only,
// and a bounce buffer in device memory. Whatever the request says, the
// agent may touch only the ranges its keys grant for the right it names.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "device/device_memory.h"
#include "shm/memory_copy.h"

namespace {

using namespace softverbs;

constexpr size_t kRegion = 4096;
constexpr size_t kGuard = 4096;
constexpr uint8_t kGuardByte = 0x5c;
constexpr uint8_t kReadOnlyByte = 0x3a;

struct Setup {
  std::shared_ptr<DeviceMemory> memory;
  std::vector<uint8_t> writable = std::vector<uint8_t>(kGuard + kRegion + kGuard, kGuardByte);
  std::vector<uint8_t> read_only = std::vector<uint8_t>(kGuard + kRegion + kGuard, kGuardByte);
  uint32_t writable_key = 0, read_only_key = 0;
  uint64_t bounce = 0;

  Setup() {
    const std::string path =
        std::filesystem::temp_directory_path() / ("softverbs-agent-fuzz-" + std::to_string(getpid()));
    std::string error;
    memory = DeviceMemory::open(path, &error);
    unlink(path.c_str());
    if (!memory) std::abort();
    std::memset(read_only.data() + kGuard, kReadOnlyByte, kRegion);
    ExclusiveLock lock(memory->shared().memory_lock);
    const auto address = [](std::vector<uint8_t>& buffer) {
      return reinterpret_cast<uint64_t>(buffer.data() + kGuard);
    };
    writable_key = *memory->shared().mrs.register_region(
        1, getpid(), address(writable), address(writable), kRegion,
        access::kLocalWrite | access::kRemoteWrite | access::kRemoteRead | access::kRemoteAtomic);
    read_only_key = *memory->shared().mrs.register_region(1, getpid(), address(read_only), address(read_only), kRegion,
                                                          access::kRemoteRead);
  }
};

Setup& setup() {
  static Setup instance;
  return instance;
}

bool guards_intact(const std::vector<uint8_t>& buffer) {
  for (size_t i = 0; i < kGuard; ++i)
    if (buffer[i] != kGuardByte || buffer[kGuard + kRegion + i] != kGuardByte) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Setup& s = setup();
  copy_agent::Request request{};
  std::memcpy(&request, data, std::min(size, sizeof request));
  // Steer most inputs towards what the agent looks at: the magic, keys that
  // exist, bounce offsets inside device memory.
  if (size > 0 && data[0] & 1) request.magic = copy_agent::kMagic;
  if (size > 1 && data[1] & 1) request.bounce_offset = s.memory->shared().heap_start + (request.bounce_offset % 65536);
  // Segments near the regions' edges, with one right or a few.
  const auto base = [](std::vector<uint8_t>& buffer) { return reinterpret_cast<uint64_t>(buffer.data() + kGuard); };
  for (copy_agent::Segment& segment : request.segments) {
    const uint32_t pick = segment.key % 3;
    if (pick == 2) continue;
    segment.key = pick == 0 ? s.writable_key : s.read_only_key;
    segment.address = base(pick == 0 ? s.writable : s.read_only) + segment.address % (kRegion + 64) - 32;
    segment.length %= kRegion + 64;
    if (segment.access & 0x80000000u) segment.access = 1u << (segment.access % 5);
  }
  request.count %= copy_agent::kMaxSegments + 2;
  request.write &= (size > 2 && data[2] & 1) ? 1 : ~0u;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&request);
  const int status = serve_copy_request(*s.memory, std::span(bytes, sizeof request));
  if (!guards_intact(s.writable) || !guards_intact(s.read_only)) std::abort();
  for (size_t i = 0; i < kRegion; ++i)
    if (s.read_only[kGuard + i] != kReadOnlyByte) std::abort();  // remote read only: never written
  if (status == 0 && (request.magic != copy_agent::kMagic || request.count > copy_agent::kMaxSegments)) std::abort();
  // A request that is not exactly one datagram of the format is refused.
  if (serve_copy_request(*s.memory, std::span(bytes, size % sizeof request)) == 0 && size % sizeof request != 0)
    std::abort();
  return 0;
}
