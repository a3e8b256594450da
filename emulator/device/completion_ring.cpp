#include "device/completion_ring.h"

#include <algorithm>
#include <atomic>

namespace softverbs {

CompletionRing::CompletionRing(CompletionRingHeader& header, std::span<CompletionSlot> slots)
    : header_(header), slots_(slots) {}

void CompletionRing::initialize(CompletionRingHeader& header, std::span<CompletionSlot> slots) {
  header.producer = {};
  header.producer.capacity = static_cast<uint32_t>(slots.size());
  header.consumer.capacity = static_cast<uint32_t>(slots.size());
  header.consumer.consumed = 0;
  // Only slots that are not zero already are written: a ring of fresh or
  // released heap pages stays uncommitted until completions reach it.
  for (CompletionSlot& slot : slots)
    if (slot.sequence != 0) slot.sequence = 0;
}

bool CompletionRing::push(const Completion& completion) {
  CompletionRingHeader::ProducerSide& producer = header_.producer;
  const uint64_t capacity = slots_.size();
  if (producer.produced - producer.consumed_seen >= capacity) {
    // Acquire: the consumer has copied out every entry it counted.
    producer.consumed_seen = std::atomic_ref<uint64_t>(header_.consumer.consumed).load(std::memory_order_acquire);
    if (capacity == 0 || producer.produced - producer.consumed_seen >= capacity) {
      producer.overflowed = true;
      return false;
    }
  }
  slot(producer.produced).completion = completion;
  publish(producer.produced);
  ++producer.produced;
  return true;
}

size_t CompletionRing::pop(std::span<Completion> out) {
  if (slots_.empty()) return 0;
  uint64_t consumed = header_.consumer.consumed;
  size_t count = 0;
  while (count < out.size()) {
    CompletionSlot& next = slot(consumed);
    if (std::atomic_ref<uint64_t>(next.sequence).load(std::memory_order_acquire) != consumed + 1) break;
    out[count++] = next.completion;
    ++consumed;
  }
  // Release: a producer that sees the count overwrites only copied slots.
  if (count != 0) std::atomic_ref<uint64_t>(header_.consumer.consumed).store(consumed, std::memory_order_release);
  return count;
}

}  // namespace softverbs
