// Feeds arbitrary bytes to the UDP transport's receive path as packets for
// real QPs (RC and UC responders, a UD QP, an RC requester with READ, atomic
// and SEND work outstanding) over a real device memory and MR table. Used by
// the libFuzzer target and by a deterministic test in the normal build.
//
// It checks the promises a malformed packet must not break: nothing outside
// the registered buffer is written (guard zones around it stay intact),
// every payload the transport sends lies inside a registered region, and a
// packet left waiting for a receive changed nothing.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "device/device_memory.h"
#include "udp/qp.h"

namespace softverbs::fuzz {

class PacketHarness : public udp::TransportPort {
 public:
  PacketHarness();
  ~PacketHarness() override;

  // The first input byte picks the QP role, the second steers the PSN near
  // the one expected; the rest is the transport packet (BTH onwards, no
  // ICRC). Returns false if a promise was broken.
  bool feed(std::span<const uint8_t> input);

  size_t packets_sent() const { return packets_sent_; }
  size_t packets_accepted() const { return accepted_; }
  // Request packets that were left waiting for a receive (see feed()).
  size_t packets_awaited() const { return awaited_; }
  const std::string& failure() const { return failure_; }

  // TransportPort
  DeviceMemory& memory() override { return *memory_; }
  udp::Clock::time_point now() const override { return now_; }
  uint64_t application_calls() const override { return 0; }
  void transmit(udp::UdpQp& qp, const udp::Path& path, uint32_t destination_qpn, const wire::TransportPacket& packet,
                std::span<const iovec> payload) override;

 private:
  void reset_qps();
  void fill_receive_queue(size_t role);
  void empty_receive_queue(size_t role);
  int make_qp(QpType type);
  bool guards_intact();
  // What a packet that waits for a receive must leave as it was.
  struct ResponderSnapshot {
    uint32_t expected_psn, msn;
    uint8_t in_message;
    bool have_receive, sequence_nak_sent;
    uint64_t received, written;
    uint32_t unacknowledged;
    size_t outbox, replay;
    bool operator==(const ResponderSnapshot&) const = default;
  };
  static ResponderSnapshot snapshot(const udp::ResponderState& s);

  std::filesystem::path directory_;
  std::shared_ptr<DeviceMemory> memory_;
  std::vector<uint8_t> arena_;  // guard | registered | guard
  uint32_t key_ = 0;
  uint32_t pd_ = 7;
  int cq_ = -1;
  std::vector<udp::UdpQp> qps_;  // RC responder, UC, UD, RC requester
  std::vector<int> qp_indices_;
  udp::Clock::time_point now_{};
  size_t packets_sent_ = 0;
  size_t accepted_ = 0;
  size_t awaited_ = 0;
  std::string failure_;
};

// Inputs for feed(): a valid packet of every opcode, with payloads of
// several sizes, for each QP role and a few PSNs around the expected one.
std::vector<std::vector<uint8_t>> seed_inputs();

// The size of each guard zone and of the registered buffer.
inline constexpr size_t kGuardBytes = 64 * 1024;
inline constexpr size_t kRegisteredBytes = 64 * 1024;
inline constexpr uint8_t kGuardByte = 0xa5;

}  // namespace softverbs::fuzz
