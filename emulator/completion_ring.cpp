#include "completion_ring.h"

#include <algorithm>

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
  ++header_.produced;
  return true;
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
