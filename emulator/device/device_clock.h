// The device's clock, which completion timestamps and ibv_query_rt_values_ex
// read: CLOCK_MONOTONIC in nanoseconds. Every process of the host reads the
// same clock, so a completion stamped by a peer's process (shared memory) or
// by the UDP engine's thread compares with this process's readings; it is
// what hca_core_clock (1 GHz: one tick a nanosecond) describes.
#pragma once

#include <time.h>

#include <cstdint>

namespace softverbs {

inline constexpr uint64_t kDeviceClockKhz = 1'000'000;
// The timestamps are 64-bit nanosecond counts: they never wrap in practice.
inline constexpr uint64_t kCompletionTimestampMask = ~uint64_t{0};

inline uint64_t clock_ns(clockid_t clock) {
  timespec now{};
  clock_gettime(clock, &now);
  return static_cast<uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(now.tv_nsec);
}

inline uint64_t device_clock_ns() { return clock_ns(CLOCK_MONOTONIC); }

// A device clock reading as wall-clock nanoseconds since the epoch, with the
// offset between the two clocks now.
inline uint64_t device_clock_to_wallclock_ns(uint64_t device_ns) {
  return device_ns + (clock_ns(CLOCK_REALTIME) - device_clock_ns());
}

}  // namespace softverbs
