#include "completion_ring.h"

#include <algorithm>
#include <atomic>

namespace softverbs {

CompletionRing::CompletionRing(CompletionRingHeader& header, std::span<Completion> entries)
    : header_(header), entries_(entries.first(std::min<size_t>(entries.size(), header.capacity))) {}

void CompletionRing::initialize(CompletionRingHeader& header, std::span<Completion> entries) {
  header = CompletionRingHeader{};
  header.capacity = static_cast<uint32_t>(entries.size());
}

bool CompletionRing::push(const Completion& completion) {
  if (entries_.empty() || size() >= entries_.size()) {
    header_.overflowed = true;
    return false;
  }
  entries_[header_.produced % entries_.size()] = completion;
  // Published with release order: a poller may look without the lock.
  std::atomic_ref<uint64_t>(header_.produced).store(header_.produced + 1, std::memory_order_release);
  return true;
}

bool CompletionRing::looks_empty(CompletionRingHeader& header) {
  return std::atomic_ref<uint64_t>(header.produced).load(std::memory_order_acquire) ==
         std::atomic_ref<uint64_t>(header.consumed).load(std::memory_order_relaxed);
}

size_t CompletionRing::pop(std::span<Completion> out) {
  size_t count = std::min(out.size(), size());
  for (size_t i = 0; i < count; ++i) {
    out[i] = entries_[header_.consumed % entries_.size()];
    ++header_.consumed;
  }
  return count;
}

}  // namespace softverbs
