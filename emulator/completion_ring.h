// A completion queue's ring of entries. The ring is a header plus an array
// of entries in storage the caller provides (process memory today, memory
// shared between processes for the shared-memory transport), one producer at
// a time under the CQ's lock and one consumer (the owner's poll).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>

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
  Receive = 128,
  ReceiveRdmaWithImm = 129,
};

namespace wc_flag {
inline constexpr uint32_t kGrh = 1u << 0;
inline constexpr uint32_t kWithImm = 1u << 1;
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
};

struct CompletionRingHeader {
  uint32_t capacity = 0;
  uint32_t reserved = 0;
  uint64_t produced = 0;  // entries ever pushed
  uint64_t consumed = 0;  // entries ever popped
  bool overflowed = false;
};

class CompletionRing {
 public:
  CompletionRing(CompletionRingHeader& header, std::span<Completion> entries);

  // Sets up an empty ring over `entries`.
  static void initialize(CompletionRingHeader& header, std::span<Completion> entries);

  // False (and the ring marked overflowed, as an HCA raises a CQ error) when
  // full: a completion is never silently overwritten.
  bool push(const Completion& completion);
  // Without the lock, for the consumer's polling: true if nothing was
  // pushed since it last popped (a push in flight may be missed, never a
  // push that completed: push() publishes with release order).
  static bool looks_empty(CompletionRingHeader& header);

  // Copies up to out.size() oldest entries; returns how many.
  size_t pop(std::span<Completion> out);

  // Drops every entry for which `matches` is true, keeping the others in
  // order; returns how many were dropped.
  template <typename Predicate>
  size_t remove_if(Predicate matches) {
    uint64_t kept = header_.consumed;
    for (uint64_t at = header_.consumed; at != header_.produced; ++at) {
      const Completion& entry = entries_[at % entries_.size()];
      if (!matches(entry)) entries_[kept++ % entries_.size()] = entry;
    }
    size_t dropped = static_cast<size_t>(header_.produced - kept);
    std::atomic_ref<uint64_t>(header_.produced).store(kept, std::memory_order_release);
    return dropped;
  }

  size_t size() const { return static_cast<size_t>(header_.produced - header_.consumed); }
  size_t capacity() const { return header_.capacity; }
  bool overflowed() const { return header_.overflowed; }

 private:
  CompletionRingHeader& header_;
  std::span<Completion> entries_;
};

}  // namespace softverbs
