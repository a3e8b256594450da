#include "support/internal_mappings.h"

#include <array>
#include <mutex>

namespace softverbs {

namespace {

struct Mapping {
  uint64_t start = 0;
  uint64_t length = 0;  // 0: a free entry
};

// Fixed and trivially destructible: threads may still ask during exit. More
// than the peer views (256) and device memories a process holds at once.
constexpr size_t kCapacity = 1024;
std::mutex mappings_mutex;
std::array<Mapping, kCapacity> mappings;
// Set if one could not be noted: then every on-demand access is refused
// rather than one into an unnoted mapping allowed.
bool overflowed = false;

}  // namespace

void note_internal_mapping(const void* start, size_t length) {
  std::lock_guard guard(mappings_mutex);
  for (Mapping& m : mappings)
    if (m.length == 0) {
      m = {reinterpret_cast<uint64_t>(start), length};
      return;
    }
  overflowed = true;
}

void forget_internal_mapping(const void* start) {
  std::lock_guard guard(mappings_mutex);
  for (Mapping& m : mappings)
    if (m.length != 0 && m.start == reinterpret_cast<uint64_t>(start)) m = Mapping{};
}

bool overlaps_internal_mapping(uint64_t address, uint64_t length) {
  if (length == 0) return false;
  const uint64_t end = address + length < address ? UINT64_MAX : address + length;
  std::lock_guard guard(mappings_mutex);
  if (overflowed) return true;
  for (const Mapping& m : mappings)
    if (m.length != 0 && address < m.start + m.length && m.start < end) return true;
  return false;
}

}  // namespace softverbs
