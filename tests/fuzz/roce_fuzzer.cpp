// libFuzzer entry point (build with scripts/fuzz): the packet parser's round
// trip, the splitting of a coalesced read (coalesced_read.h) and the UDP
// transport's receive path (see packet_harness.h).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "packet_harness.h"
#include "seed_corpus.h"
#include "udp/coalesced_read.h"
#include "wire/roce_headers.h"

// An empty corpus directory is seeded with a valid packet of every opcode.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  softverbs::fuzz::seed_empty_corpus(*argc, *argv, softverbs::fuzz::seed_inputs());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace softverbs;
  std::span<const uint8_t> input(data, size);
  if (auto packet = wire::parse(input)) {
    auto rebuilt = wire::build(*packet);
    if (rebuilt.size() != size || !wire::parse(rebuilt)) std::abort();
  }
  // The input as one read of a connected flow (to the first BTH's QP, so
  // that the search goes deep): the first packet ends within it.
  static wire::IcrcHeaderCache cache;
  const wire::FlowAddress flow{};
  const uint32_t qpn = size >= 8 ? static_cast<uint32_t>(data[5] << 16 | data[6] << 8 | data[7]) : 0;
  const wire::FirstPacket first = wire::find_first_packet(flow, input, {qpn, 256u << (size % 5)}, cache);
  if (first.bytes > size || (size != 0 && first.bytes == 0)) std::abort();
  static fuzz::PacketHarness harness;
  if (!harness.feed(input)) {
    std::fprintf(stderr, "softverbs fuzz: %s\n", harness.failure().c_str());
    std::abort();
  }
  return 0;
}
