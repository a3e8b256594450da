// BUG (on purpose): the target of an RDMA WRITE watches the last byte of
// its buffer and, once it changes, takes the whole buffer as written. The
// IB spec does not order the placement of a message's bytes: only the
// completion (or a WRITE with immediate's receive completion) says the
// data is there. It passes on a device that happens to write front to
// back, and fails under `softverbs run --adversarial`, which places the
// data in pieces, the last often first.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "loopback_qps.h"

namespace {
constexpr uint32_t kBytes = 4096;
constexpr int kRounds = 50;
}  // namespace

int main() {
  bugs::Device device;
  ibv_cq* cq = ibv_create_cq(device.context, 64, nullptr, nullptr, 0);
  if (cq == nullptr) bugs::fail("ibv_create_cq");
  bugs::QpPair pair(device, cq);
  std::vector<unsigned char> source(kBytes), target(kBytes, 0);
  ibv_mr* source_mr = ibv_reg_mr(device.pd, source.data(), source.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* target_mr =
      ibv_reg_mr(device.pd, target.data(), target.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (source_mr == nullptr || target_mr == nullptr) bugs::fail("ibv_reg_mr");

  std::atomic<int> bad_round{-1};
  std::atomic<int> checked{0};
  // The "receiver": waits for each round's last byte, then reads the rest.
  std::thread receiver([&] {
    volatile unsigned char* bytes = target.data();
    for (int round = 1; round <= kRounds; ++round) {
      while (bytes[kBytes - 1] != static_cast<unsigned char>(round)) {
      }
      for (uint32_t i = 0; i < kBytes; ++i) {
        if (bytes[i] != static_cast<unsigned char>(round)) {
          bad_round = round;
          return;
        }
      }
      checked = round;
    }
  });
  for (int round = 1; round <= kRounds && bad_round < 0; ++round) {
    std::fill(source.begin(), source.end(), static_cast<unsigned char>(round));
    bugs::post_write(pair.a, source_mr, kBytes, reinterpret_cast<uint64_t>(target.data()), target_mr->rkey, round);
    bugs::wait_success(cq);
    while (checked < round && bad_round < 0) std::this_thread::yield();  // the receiver is done with this round
  }
  receiver.join();
  if (bad_round >= 0) {
    std::fprintf(stderr, "BUG: round %d: the last byte was written but earlier bytes were not yet\n", bad_round.load());
    return 1;
  }
  std::printf("the whole buffer was there each time its last byte was\n");
  return 0;
}
