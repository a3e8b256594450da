// A dead peer never looks alive, and a removed device says so: two processes
// with RC QPs connected to each other, one of them killed (or the device
// taken down) while the other works. ctest runs this binary through
// `softverbs run` on a shared-memory device and on a UDP device; an HCA's
// answers are the reference: IBV_WC_RETRY_EXC_ERR once retry_cnt + 1
// timeouts have passed without an answer, the rest flushed, and
// IBV_EVENT_DEVICE_FATAL when the device goes.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "process_runner.h"
#include "rc_peer.h"

namespace {

using namespace softverbs::test;

// 4.096 us * 2^14 = 67 ms per try: at 2^10 (4.2 ms) a live peer in the
// sanitizer build, starved by a parallel test, missed 17 ms and looked dead.
constexpr uint8_t kTimeout = 14;
constexpr uint8_t kRetries = 3;

// Kills the child and reaps it: from then on it is dead for certain.
Clock::time_point kill_and_reap(pid_t child) {
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  return Clock::now();
}

// A peer that connects, says it is ready and then waits to be killed,
// having posted `receives` receives.
pid_t waiting_peer(int fd, int receives) {
  return spawn_peer(fd, 1 << 16, 64, kTimeout, kRetries, [receives](Endpoint& peer, int socket) {
    for (int i = 0; i < receives; ++i) peer.post_recv(i, 0, 4096);
    char ready = 'R';
    write_all(socket, &ready, 1);
    char never;
    read_all(socket, &never, 1);
    return 0;
  });
}

struct Outcome {
  std::vector<ibv_wc> completions;
  double seconds = 0;  // from the peer's death to the last completion
};

// Polls until `count` completions are in (or 10 s pass).
Outcome collect(Endpoint& self, size_t count, Clock::time_point since) {
  Outcome outcome;
  outcome.completions = poll_for(self, count, std::chrono::seconds(10));
  outcome.seconds = std::chrono::duration<double>(Clock::now() - since).count();
  return outcome;
}

// What an HCA reports for work that met a dead peer: one
// IBV_WC_RETRY_EXC_ERR, then flushes, each work request once, in order.
void expect_retry_exceeded_then_flushed(const Outcome& outcome, uint64_t first_wr_id, size_t count) {
  ASSERT_EQ(outcome.completions.size(), count) << "every work request completes, nothing hangs";
  EXPECT_EQ(outcome.completions[0].status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(outcome.completions[0].status);
  for (size_t i = 1; i < count; ++i)
    EXPECT_EQ(outcome.completions[i].status, IBV_WC_WR_FLUSH_ERR)
        << i << ": " << ibv_wc_status_str(outcome.completions[i].status);
  for (size_t i = 0; i < count; ++i) EXPECT_EQ(outcome.completions[i].wr_id, first_wr_id + i) << "in order";
  const double implied = implied_seconds(kTimeout, kRetries);
  EXPECT_LE(outcome.seconds, implied + 1.0) << "gave up late: implied " << implied << " s";
}

// This process's endpoint, connected to a waiting peer process's.
class ConnectedToAPeer : public ::testing::Test {
 protected:
  void SetUp() override {
    int sockets[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sockets), 0);
    child = waiting_peer(sockets[1], 0);
    ASSERT_GT(child, 0);
    ASSERT_TRUE(open_connected(self, sockets[0], 1 << 16, 256, kTimeout, kRetries, peer));
  }
  void TearDown() override {
    if (child > 0) kill_peer();
  }
  Clock::time_point kill_peer() {
    const Clock::time_point died = kill_and_reap(child);
    child = -1;
    return died;
  }
  pid_t child = -1;
  Endpoint self;
  ConnectInfo peer;
};

class DeadPeer : public ConnectedToAPeer {};
class DeviceRemoval : public ConnectedToAPeer {};

TEST_F(DeadPeer, WritesToAKilledPeerFailWithRetryExceededAndNoneSucceeds) {
  // A stream of WRITEs that succeed while the peer lives.
  uint64_t next_id = 1;
  for (int i = 0; i < 100; ++i) ASSERT_EQ(self.post_write(next_id++, 0, 4096, peer, 0), 0);
  auto before = poll_for(self, 100, std::chrono::seconds(5));
  ASSERT_EQ(before.size(), 100u);
  for (const ibv_wc& wc : before) ASSERT_EQ(wc.status, IBV_WC_SUCCESS);

  const Clock::time_point died = kill_peer();
  const uint64_t first_after = next_id;
  for (int i = 0; i < 32; ++i) ASSERT_EQ(self.post_write(next_id++, 0, 4096, peer, 0), 0);
  const Outcome outcome = collect(self, 32, died);
  expect_retry_exceeded_then_flushed(outcome, first_after, 32);
  EXPECT_EQ(self.state(), IBV_QPS_ERR);
  std::printf("RETRY_EXC_ERR %.3f s after the peer died (%.3f s implied)\n", outcome.seconds,
              implied_seconds(kTimeout, kRetries));
}

// rnr_retry 7 retries an RNR NAK for ever, but a dead QP sends no RNR NAK:
// SENDs waiting for a receive that will never come end as a dead peer's.
TEST_F(DeadPeer, SendsWaitingForAReceiveFailOnceThePeerDies) {
  for (uint64_t id = 1; id <= 64; ++id) ASSERT_EQ(self.post_send(id, 0, 64), 0);
  ASSERT_TRUE(polls_nothing_for(self, std::chrono::milliseconds(100))) << "RNR: nothing completes while it lives";
  const Clock::time_point died = kill_peer();
  const Outcome outcome = collect(self, 64, died);
  expect_retry_exceeded_then_flushed(outcome, 1, 64);
}

// The passive side's next WRITE after the active side died, even once the
// dead process's records have been reclaimed (another context opened the
// device), meets no responder: not a key that has gone.
TEST_F(DeadPeer, AWriteAfterThePeersRecordsWereReclaimedFailsWithRetryExceeded) {
  ASSERT_EQ(self.post_write(1, 0, 64, peer, 0), 0);
  auto first = poll_for(self, 1, std::chrono::seconds(5));
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(first[0].status, IBV_WC_SUCCESS);
  const Clock::time_point died = kill_peer();
  Endpoint reclaimer;  // opening the device reclaims what dead processes left
  ASSERT_TRUE(reclaimer.open(4096, 4));
  ASSERT_EQ(self.post_write(2, 0, 64, peer, 0), 0);
  ASSERT_EQ(self.post_write(3, 0, 64, peer, 0), 0);
  const Outcome outcome = collect(self, 2, died);
  expect_retry_exceeded_then_flushed(outcome, 2, 2);
}

// `softverbs down` of a device in use is an HCA's removal: every context
// gets IBV_EVENT_DEVICE_FATAL, and from then on nothing succeeds.
TEST_F(DeviceRemoval, TakingTheDeviceDownRaisesDeviceFatalAndFailsWhatFollows) {
  const char* cli = std::getenv("SOFTVERBS_CLI");
  ASSERT_NE(cli, nullptr) << "SOFTVERBS_CLI names the softverbs command";
  ASSERT_EQ(self.post_write(1, 0, 4096, peer, 0), 0);
  auto first = poll_for(self, 1, std::chrono::seconds(5));
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(first[0].status, IBV_WC_SUCCESS);

  const auto down = run_process({cli, "down", "softverbs0"});
  ASSERT_EQ(down.exit_code, 0) << down.err;
  pollfd event_fd{self.context()->async_fd, POLLIN, 0};
  ASSERT_EQ(poll(&event_fd, 1, 5000), 1) << "no asynchronous event within 5 s";
  ibv_async_event event{};
  ASSERT_EQ(ibv_get_async_event(self.context(), &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_DEVICE_FATAL) << ibv_event_type_str(event.event_type);
  ibv_ack_async_event(&event);

  for (uint64_t id = 10; id < 20; ++id) ASSERT_EQ(self.post_write(id, 0, 4096, peer, 0), 0);
  auto after = poll_for(self, 10, std::chrono::seconds(5));
  ASSERT_EQ(after.size(), 10u) << "work posted after the removal completes";
  for (const ibv_wc& wc : after) EXPECT_NE(wc.status, IBV_WC_SUCCESS) << "wr_id " << wc.wr_id;
  EXPECT_EQ(self.state(), IBV_QPS_ERR);
  EXPECT_EQ(ibv_alloc_pd(self.context()), nullptr);
  EXPECT_EQ(errno, EIO);
}

}  // namespace
