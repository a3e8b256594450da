// The UDP transport's receive path against malformed and hostile packets, in
// the normal build: every opcode at PSNs around the expected one, then random
// bytes and bit flips of valid packets (the libFuzzer target in tests/fuzz
// explores further). Nothing may be written outside the registered buffer,
// nothing sent from outside it, and nothing may crash.
#include <gtest/gtest.h>

#include <random>

#include "fuzz/packet_harness.h"
#include "wire/roce_headers.h"

namespace softverbs {
namespace {

using namespace wire;

TEST(PacketFuzz, EveryOpcodeAtEveryNearbyPsnOnEveryQp) {
  fuzz::PacketHarness harness;
  for (const auto& input : fuzz::seed_inputs()) ASSERT_TRUE(harness.feed(input)) << harness.failure();
  EXPECT_GT(harness.packets_accepted(), 1000u);
  EXPECT_GT(harness.packets_sent(), 100u) << "the QPs answered (ACKs, NAKs, READ responses)";
}

TEST(PacketFuzz, RandomBytesAndBitFlips) {
  fuzz::PacketHarness harness;
  std::mt19937 random(20261121);
  auto seeds = fuzz::seed_inputs();
  for (int round = 0; round < 60000; ++round) {
    std::vector<uint8_t> input;
    if (round % 2 == 0) {
      input.resize(2 + random() % 128);
      for (auto& b : input) b = static_cast<uint8_t>(random());
      // Mostly valid opcodes, to get past the first check.
      if (input.size() > 2 && round % 4 == 0) input[2] = static_cast<uint8_t>(random() % 0x18);
    } else {
      input = seeds[random() % seeds.size()];
      input[0] = static_cast<uint8_t>(random());
      for (int flips = 1 + random() % 4; flips > 0; --flips) {
        size_t bit = 16 + random() % ((input.size() - 2) * 8);
        input[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      }
    }
    ASSERT_TRUE(harness.feed(input)) << harness.failure() << " (round " << round << ")";
  }
  EXPECT_GT(harness.packets_accepted(), 10000u);
  EXPECT_GT(harness.packets_awaited(), 0u) << "no SEND found the receive queue empty where it could wait";
}

}  // namespace
}  // namespace softverbs
