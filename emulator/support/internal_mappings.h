// The mappings softverbs itself makes in a process (the device's shared
// state, peers' regions mapped here): an on-demand region, which may cover
// any address of its process (implicit ODP: all of them), must never resolve
// into one, or a peer holding its rkey could rewrite the device's key table
// or another process's buffers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace softverbs {

void note_internal_mapping(const void* start, size_t length);
void forget_internal_mapping(const void* start);
// Whether [address, address + length) overlaps one of them.
bool overlaps_internal_mapping(uint64_t address, uint64_t length);

}  // namespace softverbs
