// Fault injection on the UDP transport, for users' own tests: each packet a
// device sends may be lost, duplicated, reordered (held back behind the
// next one), delayed or corrupted (one byte flipped after the ICRC was
// computed, so the receiver's ICRC check drops it). Rates are per packet.
// Decisions come from a generator seeded by (seed, QPN), so a run with the
// same seed and the same traffic makes the same decisions.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace softverbs {

struct FaultSettings {
  // Parts per million of packets.
  uint32_t loss_ppm = 0;
  uint32_t duplicate_ppm = 0;
  uint32_t reorder_ppm = 0;
  uint32_t delay_ppm = 0;
  uint32_t corrupt_ppm = 0;
  uint32_t delay_us = 1000;  // how long a delayed packet is held
  uint64_t seed = 1;

  bool any() const { return loss_ppm || duplicate_ppm || reorder_ppm || delay_ppm || corrupt_ppm; }
  bool operator==(const FaultSettings&) const = default;

  // "loss=0.1,duplicate=1%,reorder=0.05,delay=0.01,delay_us=2000,corrupt=0.001,seed=7";
  // rates as fractions or percentages; "none" or "" for no faults. Keys not
  // given keep their defaults. nullopt and a message on a bad key or value.
  static std::optional<FaultSettings> parse(std::string_view text, std::string* error);
  // The form parse() reads, every key given.
  std::string to_string() const;
};

// The settings in device memory, changed by `softverbs faults` while
// processes run; read without locks.
struct SharedFaultSettings {
  std::atomic<uint32_t> loss_ppm{0};
  std::atomic<uint32_t> duplicate_ppm{0};
  std::atomic<uint32_t> reorder_ppm{0};
  std::atomic<uint32_t> delay_ppm{0};
  std::atomic<uint32_t> corrupt_ppm{0};
  std::atomic<uint32_t> delay_us{1000};
  std::atomic<uint64_t> seed{1};

  FaultSettings load() const;
  void store(const FaultSettings& settings);
};

enum class FaultAction : uint8_t { Deliver, Drop, Duplicate, Reorder, Delay };

struct FaultDecision {
  FaultAction action = FaultAction::Deliver;
  bool corrupt = false;
  uint32_t corrupt_offset_seed = 0;  // which byte to flip, reduced by the caller
};

// One generator per sending QP.
class FaultGenerator {
 public:
  FaultGenerator(uint64_t seed, uint32_t qpn);
  FaultDecision decide(const FaultSettings& settings);

 private:
  uint64_t next();
  bool chance(uint32_t ppm);
  uint64_t state_;
};

}  // namespace softverbs
