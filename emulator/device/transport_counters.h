// What the UDP transport counts, per device, in device memory: every process
// adds to the same counters, and `softverbs stat` reads them. Named by a
// table so that the CLI, the docs and the tests agree on the names.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace softverbs {

enum class Counter : uint8_t {
  TxPackets,
  TxBytes,
  RxPackets,
  RxBytes,
  Retransmissions,  // packets sent again (timeout, NAK or RNR)
  Timeouts,         // ACK timer expiries
  SequenceNaksSent,
  SequenceNaksReceived,
  RnrNaksSent,
  RnrNaksReceived,
  ErrorNaksSent,  // invalid request, remote access, remote operation
  ErrorNaksReceived,
  DuplicatesReceived,
  OutOfSequenceDropped,
  IcrcErrors,
  MalformedPackets,
  UnknownQp,         // no such QP, or one that does not take UDP traffic
  ForwardedPackets,  // received by another process of the device and passed on
  SendErrors,        // sendmsg failures (no route, ...)
  FaultsDropped,
  FaultsDuplicated,
  FaultsReordered,
  FaultsDelayed,
  FaultsCorrupted,
  ReceiveWaits,        // SENDs that found no receive posted and waited for one (kReceiveGrace)
  WrongSourceDropped,  // RC/UC packets from an address that is not the QP's peer
  UdNoReceiveDropped,  // UD datagrams that found no receive posted (mlx5's out_of_buffer)
  Count
};

inline constexpr size_t kCounterCount = static_cast<size_t>(Counter::Count);

inline constexpr std::array<const char*, kCounterCount> kCounterNames = {
    "tx_packets",
    "tx_bytes",
    "rx_packets",
    "rx_bytes",
    "retransmissions",
    "ack_timeouts",
    "seq_naks_sent",
    "seq_naks_received",
    "rnr_naks_sent",
    "rnr_naks_received",
    "error_naks_sent",
    "error_naks_received",
    "duplicates_received",
    "out_of_sequence_dropped",
    "icrc_errors",
    "malformed_packets",
    "unknown_qp_dropped",
    "forwarded_packets",
    "send_errors",
    "faults_dropped",
    "faults_duplicated",
    "faults_reordered",
    "faults_delayed",
    "faults_corrupted",
    "receive_waits",
    "wrong_source_dropped",
    "ud_no_receive_dropped",
};

// One process's counts. A process adds only to its own slot: counters on a
// line that both ends of a connection write cost every received packet a
// cache-line transfer between their cores, ~160 TSC cycles on the receive
// path of udp ib_write_lat on the 2-core CI VM.
struct alignas(64) CounterSlot {
  std::atomic<int32_t> owner_pid{0};  // 0: never claimed
  std::array<std::atomic<uint64_t>, kCounterCount> values{};

  void add(Counter counter, uint64_t amount = 1) {
    values[static_cast<size_t>(counter)].fetch_add(amount, std::memory_order_relaxed);
  }
};

// A device's counters: the sum of every slot, those of processes that have
// exited included.
struct TransportCounters {
  static constexpr size_t kSlots = 64;
  std::array<CounterSlot, kSlots> slots{};

  // The slot of process `pid`: its own, else one never claimed or one whose
  // owner has exited (its counts stay and go on adding up), else the last,
  // which processes past kSlots share.
  CounterSlot& claim(int32_t pid);
  uint64_t get(Counter counter) const {
    uint64_t sum = 0;
    for (const CounterSlot& slot : slots)
      sum += slot.values[static_cast<size_t>(counter)].load(std::memory_order_relaxed);
    return sum;
  }
  void reset() {
    for (CounterSlot& slot : slots)
      for (auto& value : slot.values) value.store(0, std::memory_order_relaxed);
  }
};

// `softverbs capture` sets this up; every process of the device appends the
// packets it sends and receives to `path` while `active` is set.
struct CaptureControl {
  std::atomic<uint32_t> generation{0};  // changes at every start and stop
  std::atomic<uint32_t> active{0};
  std::atomic<int32_t> owner_pid{0};  // the capturing command; a dead owner ends the capture
  char path[512] = {};
};

}  // namespace softverbs
