// copy_payload and move_payload: the copies into registered memory that go
// around the string copy's 4 KiB aliasing slow path (payload_copy.h). Each
// must copy exactly the bytes asked for, at every distance between source
// and destination and every length, and touch nothing beside them.
#include "support/payload_copy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <vector>

namespace softverbs {
namespace {

constexpr uint8_t kGuard = 0xa5;

using Copy = std::function<void(uint8_t*, const uint8_t*, size_t)>;

// Copies `length` random bytes from an offset of `from_offset` in one
// 4 KiB-aligned buffer to `to_offset` in another and checks the copy and
// the guard bytes around it.
void expect_exact_copy(const Copy& copy, size_t from_offset, size_t to_offset, size_t length) {
  constexpr size_t kSlack = 8192;
  std::vector<uint8_t> source_storage(length + kSlack + 4096), target_storage(length + kSlack + 4096);
  auto align = [](std::vector<uint8_t>& storage) {
    auto address = reinterpret_cast<uintptr_t>(storage.data());
    return storage.data() + ((4096 - address % 4096) % 4096);
  };
  uint8_t* source = align(source_storage) + from_offset;
  uint8_t* target = align(target_storage) + to_offset;
  std::mt19937 random(static_cast<unsigned>(length * 131 + from_offset * 7 + to_offset));
  for (size_t i = 0; i < length; ++i) source[i] = static_cast<uint8_t>(random());
  std::memset(target - 64, kGuard, length + 128);
  copy(target, source, length);
  ASSERT_EQ(std::memcmp(target, source, length), 0)
      << "length " << length << ", from offset " << from_offset << ", to offset " << to_offset;
  for (size_t i = 1; i <= 64; ++i) {
    ASSERT_EQ(target[-static_cast<std::ptrdiff_t>(i)], kGuard) << "byte " << i << " before, length " << length;
    ASSERT_EQ(target[length + i - 1], kGuard) << "byte " << i - 1 << " after, length " << length;
  }
}

const size_t kLengths[] = {0, 1, 31, 64, 65, 127, 2047, 2048, 2049, 4096, 4096 + 13, 65536 + 7};

TEST(PayloadCopy, NamesTheDistancesThatAliasWithin4KiB) {
  alignas(4096) static uint8_t page[3 * 4096];
  EXPECT_FALSE(copy_aliases(page, page));
  EXPECT_FALSE(copy_aliases(page + 4096, page));
  for (size_t distance = 1; distance < 64; ++distance) {
    EXPECT_TRUE(copy_aliases(page + distance, page)) << distance;
    EXPECT_TRUE(copy_aliases(page + 4096 + 12 + distance, page + 12)) << distance;  // a page apart too
  }
  EXPECT_FALSE(copy_aliases(page + 64, page));
  EXPECT_FALSE(copy_aliases(page, page + 16));  // the destination before the source
  EXPECT_FALSE(copy_aliases(page + 4095, page));
}

TEST(PayloadCopy, CopiesExactlyAtEveryDistanceAndLength) {
  // Source offsets as a payload's in a receive buffer (after a BTH, a BTH
  // and a RETH, or a GRO segment in); every distance from 0 to 70 and a
  // few far ones.
  for (size_t from_offset : {size_t{0}, size_t{12}, size_t{28}, size_t{4124}}) {
    for (size_t distance = 0; distance <= 70; ++distance)
      for (size_t length : kLengths) expect_exact_copy(copy_payload, from_offset, from_offset + distance, length);
    for (size_t distance : {size_t{100}, size_t{2048}, size_t{4080}, size_t{4095}})
      for (size_t length : kLengths) expect_exact_copy(copy_payload, from_offset, from_offset + distance, length);
  }
}

#if defined(__x86_64__)
TEST(PayloadCopy, BothVectorLoopsCopyExactlyAtEveryAlignment) {
  std::vector<std::pair<const char*, Copy>> loops = {{"sse2", detail::copy_sse2}};
  if (__builtin_cpu_supports("avx2")) loops.push_back({"avx2", detail::copy_avx2});
  for (const auto& [name, loop] : loops) {
    SCOPED_TRACE(name);
    for (size_t from_offset = 0; from_offset < 40; ++from_offset)
      for (size_t to_offset = 0; to_offset < 40; to_offset += 3)
        for (size_t length : {size_t{64}, size_t{65}, size_t{95}, size_t{96}, size_t{127}, size_t{128}, size_t{129},
                              size_t{200}, size_t{4096}, size_t{4097}})
          expect_exact_copy(loop, from_offset, to_offset, length);
  }
}
#endif

TEST(PayloadCopy, MoveCopiesOverlappingRangesAsMemmove) {
  for (size_t length : {size_t{100}, size_t{4096}, size_t{65536}}) {
    for (std::ptrdiff_t shift : {-4096, -100, -17, -1, 1, 16, 31, 4096 - 16, 4096 + 16}) {
      std::vector<uint8_t> buffer(length + 2 * 8192);
      for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<uint8_t>(i * 7 + i / 251);
      std::vector<uint8_t> expected = buffer;
      const size_t from = 8192;
      const size_t to = static_cast<size_t>(static_cast<std::ptrdiff_t>(from) + shift);
      std::memmove(expected.data() + to, expected.data() + from, length);
      move_payload(buffer.data() + to, buffer.data() + from, length);
      ASSERT_EQ(buffer, expected) << "length " << length << ", shift " << shift;
    }
  }
}

}  // namespace
}  // namespace softverbs
