// Completion timestamps and the device clock through the installed
// libibverbs: the clock is CLOCK_MONOTONIC in nanoseconds (hca_core_clock
// 1 GHz), and a completion carries its reading at delivery.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <time.h>

#include <cerrno>
#include <cstring>

#include "verbs_features.h"

namespace softverbs::test {
namespace {

uint64_t now_ns(clockid_t clock) {
  timespec now{};
  clock_gettime(clock, &now);
  return static_cast<uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(now.tv_nsec);
}

class Timestamps : public DeviceFixture {
 protected:
  ibv_cq_ex* timestamp_cq(uint64_t flags) {
    ibv_cq_init_attr_ex attr{};
    attr.cqe = 16;
    attr.wc_flags = IBV_WC_STANDARD_FLAGS | flags;
    return ibv_create_cq_ex(context_, &attr);
  }

  // Polls one completion of `cq` with the extended API; its status, opcode
  // and what `read` gives for it.
  template <typename Read>
  bool poll_ex(ibv_cq_ex* cq, ibv_wc_opcode& opcode, uint64_t& value, Read read) {
    ibv_poll_cq_attr attr{};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int result = ENOENT;
    while ((result = ibv_start_poll(cq, &attr)) == ENOENT && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    if (result != 0) return false;
    const bool success = cq->status == IBV_WC_SUCCESS;
    opcode = ibv_wc_read_opcode(cq);
    value = read(cq);
    ibv_end_poll(cq);
    return success;
  }
};

TEST_F(Timestamps, DeviceReportsItsClock) {
  ibv_device_attr_ex attr{};
  ASSERT_EQ(ibv_query_device_ex(context_, nullptr, &attr), 0);
  EXPECT_EQ(attr.hca_core_clock, 1'000'000u) << "kHz: one tick a nanosecond";
  EXPECT_EQ(attr.completion_timestamp_mask, ~uint64_t{0});
}

TEST_F(Timestamps, RealTimeValuesReadTheMonotonicClock) {
  ibv_values_ex values{};
  values.comp_mask = IBV_VALUES_MASK_RAW_CLOCK;
  const uint64_t before = now_ns(CLOCK_MONOTONIC);
  ASSERT_EQ(ibv_query_rt_values_ex(context_, &values), 0);
  const uint64_t after = now_ns(CLOCK_MONOTONIC);
  EXPECT_EQ(values.comp_mask, static_cast<uint32_t>(IBV_VALUES_MASK_RAW_CLOCK));
  const uint64_t raw =
      static_cast<uint64_t>(values.raw_clock.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(values.raw_clock.tv_nsec);
  EXPECT_GE(raw, before);
  EXPECT_LE(raw, after);
  EXPECT_LT(values.raw_clock.tv_nsec, 1'000'000'000);

  // Nothing asked, nothing answered.
  values = {};
  ASSERT_EQ(ibv_query_rt_values_ex(context_, &values), 0);
  EXPECT_EQ(values.comp_mask, 0u);
}

TEST_F(Timestamps, CompletionsCarryTheDeviceClock) {
  ibv_cq_ex* send_cq = timestamp_cq(IBV_WC_EX_WITH_COMPLETION_TIMESTAMP);
  ibv_cq_ex* recv_cq = timestamp_cq(IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK);
  ASSERT_TRUE(send_cq && recv_cq) << std::strerror(errno);
  Pair pair;
  ASSERT_TRUE(pair.create(pd_, pd_, ibv_cq_ex_to_cq(send_cq), ibv_cq_ex_to_cq(recv_cq)));
  ASSERT_TRUE(pair.connect());

  const uint64_t monotonic_before = now_ns(CLOCK_MONOTONIC);
  const uint64_t real_before = now_ns(CLOCK_REALTIME);
  ibv_sge recv_sge{reinterpret_cast<uint64_t>(pair.buffer_b.data()), 64, pair.mr_b->lkey};
  ibv_recv_wr recv{};
  recv.sg_list = &recv_sge;
  recv.num_sge = 1;
  ibv_recv_wr* bad_recv = nullptr;
  ASSERT_EQ(ibv_post_recv(pair.qp_b, &recv, &bad_recv), 0);
  ibv_sge sge{reinterpret_cast<uint64_t>(pair.buffer_a.data()), 64, pair.mr_a->lkey};
  ibv_send_wr send{};
  send.sg_list = &sge;
  send.num_sge = 1;
  send.opcode = IBV_WR_SEND;
  send.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(pair.qp_a, &send, &bad), 0);

  ibv_wc_opcode opcode{};
  uint64_t stamp = 0, wallclock = 0;
  ASSERT_TRUE(poll_ex(send_cq, opcode, stamp, ibv_wc_read_completion_ts));
  EXPECT_EQ(opcode, IBV_WC_SEND);
  ASSERT_TRUE(poll_ex(recv_cq, opcode, wallclock, ibv_wc_read_completion_wallclock_ns));
  EXPECT_EQ(opcode, IBV_WC_RECV);
  const uint64_t monotonic_after = now_ns(CLOCK_MONOTONIC);
  const uint64_t real_after = now_ns(CLOCK_REALTIME);
  EXPECT_GE(stamp, monotonic_before);
  EXPECT_LE(stamp, monotonic_after);
  // The wall clock may step between readings: a second's slack.
  EXPECT_GE(wallclock + 1'000'000'000u, real_before);
  EXPECT_LE(wallclock, real_after + 1'000'000'000u);
  pair.destroy();
  EXPECT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(send_cq)), 0);
  EXPECT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(recv_cq)), 0);
}

TEST_F(Timestamps, UnsupportedWcFlagsAreStillRefused) {
  errno = 0;
  EXPECT_EQ(timestamp_cq(IBV_WC_EX_WITH_CVLAN), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

}  // namespace
}  // namespace softverbs::test
