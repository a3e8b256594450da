// A completion queue's ring of entries. The ring is a header plus an array
// of slots in storage the caller provides (process memory, or memory shared
// between processes for the shared-memory transport): producers push one at
// a time under the CQ's lock, and one consumer at a time (the owner's poll,
// under the ring's own poll lock) pops.
//
// The consumer never takes the producers' lock and never writes their cache
// line, nor they its: each slot carries the sequence number of the entry it
// holds, so a poll reads only the slot it waits for. When a producer in one
// process completes work for a consumer polling in another, one cache line
// (the slot) moves between their cores per completion, where the shared
// header and lock took five transfers (the lock taken by each side in turn,
// the header read by the poller), each 0.1-0.25 us between the cores of a
// virtual machine.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>

#include "device/shared_mutex.h"

namespace softverbs {

// Work completion status and opcode; values are the verbs ABI's (IBV_WC_*).
enum class WcStatus : uint32_t {
  Success = 0,
  LocalLengthError = 1,
  LocalQpOperationError = 2,
  LocalProtectionError = 4,
  WrFlushError = 5,
  MemoryWindowBindError = 6,
  BadResponseError = 7,
  LocalAccessError = 8,
  RemoteInvalidRequestError = 9,
  RemoteAccessError = 10,
  RemoteOperationError = 11,
  RetryExceededError = 12,
  RnrRetryExceededError = 13,
  GeneralError = 21,
};

enum class WcOpcode : uint32_t {
  Send = 0,
  RdmaWrite = 1,
  RdmaRead = 2,
  CompareSwap = 3,
  FetchAdd = 4,
  BindMw = 5,
  LocalInvalidate = 6,
  AtomicWrite = 9,
  Receive = 128,
  ReceiveRdmaWithImm = 129,
};

namespace wc_flag {
inline constexpr uint32_t kGrh = 1u << 0;
inline constexpr uint32_t kWithImm = 1u << 1;
inline constexpr uint32_t kWithInvalidate = 1u << 3;  // imm_data holds the invalidated rkey, in host order
}  // namespace wc_flag

struct Completion {
  uint64_t wr_id = 0;
  WcStatus status = WcStatus::Success;
  WcOpcode opcode = WcOpcode::Send;
  uint32_t byte_len = 0;
  uint32_t imm_data = 0;  // network byte order, as posted
  uint32_t qp_num = 0;
  uint32_t src_qp = 0;
  uint32_t flags = 0;
  uint16_t pkey_index = 0;
  uint8_t sl = 0;
  uint64_t timestamp_ns = 0;  // the device clock at delivery, on CQs that ask for it
};

// An entry and the sequence number it was pushed as, plus one (0: never
// written), on a cache line of its own.
struct alignas(64) CompletionSlot {
  Completion completion;
  uint64_t sequence = 0;
};

struct CompletionRingHeader {
  // Written by producers only, under the CQ's lock.
  struct alignas(64) ProducerSide {
    uint32_t capacity = 0;
    bool overflowed = false;
    uint64_t produced = 0;       // entries ever pushed
    uint64_t consumed_seen = 0;  // the consumer's count when last read
  } producer;
  // Written by the consumer only; producers read `consumed` when the ring
  // looks full to them.
  struct alignas(64) ConsumerSide {
    SharedMutex poll_lock;  // one consumer at a time (several threads may poll)
    uint32_t capacity = 0;
    uint64_t consumed = 0;  // entries ever popped
  } consumer;
};

class CompletionRing {
 public:
  CompletionRing(CompletionRingHeader& header, std::span<CompletionSlot> slots);

  // Sets up an empty ring over `slots` (their sequence numbers cleared).
  static void initialize(CompletionRingHeader& header, std::span<CompletionSlot> slots);

  // Producers, under the CQ's lock. False (and the ring marked overflowed,
  // as an HCA raises a CQ error) when full: a completion is never silently
  // overwritten.
  bool push(const Completion& completion);
  bool overflowed() const { return header_.producer.overflowed; }

  // The consumer, under the poll lock: copies up to out.size() oldest
  // entries; returns how many. A push in flight may be missed, never one
  // that completed (each slot's sequence number is stored last, with
  // release order).
  size_t pop(std::span<Completion> out);

  // Under both locks (the poll lock first): drops every entry for which
  // `matches` is true, keeping the others in order; returns how many were
  // dropped.
  template <typename Predicate>
  size_t remove_if(Predicate matches) {
    const uint64_t consumed = header_.consumer.consumed;
    const uint64_t produced = header_.producer.produced;
    uint64_t kept = consumed;
    for (uint64_t at = consumed; at != produced; ++at) {
      const Completion entry = slot(at).completion;
      if (!matches(entry)) {
        slot(kept).completion = entry;
        publish(kept++);
      }
    }
    for (uint64_t at = kept; at != produced; ++at)
      std::atomic_ref<uint64_t>(slot(at).sequence).store(0, std::memory_order_relaxed);
    header_.producer.produced = kept;
    return static_cast<size_t>(produced - kept);
  }

  // Under both locks.
  size_t size() const { return static_cast<size_t>(header_.producer.produced - header_.consumer.consumed); }
  size_t capacity() const { return slots_.size(); }

 private:
  CompletionSlot& slot(uint64_t sequence) { return slots_[sequence % slots_.size()]; }
  void publish(uint64_t sequence) {
    std::atomic_ref<uint64_t>(slot(sequence).sequence).store(sequence + 1, std::memory_order_release);
  }

  CompletionRingHeader& header_;
  std::span<CompletionSlot> slots_;
};

}  // namespace softverbs
