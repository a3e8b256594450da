// A hostile local user against root's RDMA processes, with rdma-core's own
// tools as the victims: user nobody finds their abstract sockets in
// /proc/net/unix, as anyone can, and sends them what libibverbs would take
// for CQ, QP and port events. The victims must neither crash nor believe
// any of it. (Root only: the tests switch to a second user.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "cross_user_helpers.h"
#include "process_runner.h"

namespace softverbs {
namespace {

using test::ProcessResult;
using test::run_process;
using test::TemporaryDirectory;

// What libibverbs reads from an async fd: element, event type, reserved.
struct ForgedEvent {
  uint64_t element;
  uint32_t event_type;
  uint32_t reserved;
};

class CrossUser : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!test::can_switch_user()) GTEST_SKIP() << "needs root, to run a second user";
    ASSERT_EQ(run_process({SOFTVERBS_CLI, "up"}, env()).exit_code, 0);
  }
  std::vector<std::string> env() const { return {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt"}; }

  // The pid of `command` once it uses the device and holds at least
  // `sockets` abstract sockets (its copy agent, async fd, channels).
  pid_t wait_for_victim(const std::string& command, size_t sockets) {
    for (int i = 0; i < 200; ++i) {
      const pid_t pid = test::pid_in_status(run_process({SOFTVERBS_CLI, "status"}, env()).out, command);
      if (pid != 0 && test::abstract_sockets_of(pid).size() >= sockets) return pid;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return 0;
  }

  // As user nobody, sends every datagram of `forged` to every abstract
  // socket of `pid`; the number the kernel accepted.
  static int send_as_nobody(pid_t pid, const std::vector<std::vector<uint8_t>>& forged) {
    const std::vector<std::string> names = test::abstract_sockets_of(pid);
    int accepted = 0;
    for (const auto& name : names)
      for (const auto& bytes : forged)
        accepted +=
            test::run_as_nobody([&] { return test::send_to_abstract(name, bytes.data(), bytes.size()) ? 0 : 1; }) == 0;
    return accepted;
  }

  static std::vector<uint8_t> bytes_of(const void* data, size_t length) {
    const auto* begin = static_cast<const uint8_t*>(data);
    return {begin, begin + length};
  }

  TemporaryDirectory dir_;
};

// The reproduction: 0x4141414141414141 sent to a root
// `ibv_rc_pingpong -e` server killed it with SIGSEGV in ibv_get_cq_event.
TEST_F(CrossUser, ACompletionChannelIgnoresAnotherUsersDatagramsAndPointersToNothing) {
  auto server = std::async(std::launch::async, [&] {
    return run_process({SOFTVERBS_CLI, "run", "--", "ibv_rc_pingpong", "-e", "-n", "50"}, env(), 60);
  });
  // Copy agent, async fd and completion channel.
  const pid_t victim = wait_for_victim("ibv_rc_pingpong", 3);
  ASSERT_NE(victim, 0) << "the server did not come up";
  const uint64_t wild = 0x4141414141414141ull;
  const ForgedEvent event{wild, 1 /* IBV_EVENT_QP_FATAL */, 0};
  EXPECT_GT(send_as_nobody(victim, {bytes_of(&wild, sizeof wild), bytes_of(&event, sizeof event)}), 0)
      << "abstract sockets take datagrams from anyone: the defence must be the reader's";
  // The same user's datagrams get through, but must name a live CQ.
  for (const auto& name : test::abstract_sockets_of(victim)) test::send_to_abstract(name, &wild, sizeof wild);

  const ProcessResult client =
      run_process({SOFTVERBS_CLI, "run", "--", "ibv_rc_pingpong", "-e", "-n", "50", "localhost"}, env(), 60);
  const ProcessResult served = server.get();
  EXPECT_EQ(served.exit_code, 0) << "server: " << served.err << served.out;
  EXPECT_EQ(client.exit_code, 0) << "client: " << client.err << client.out;
  EXPECT_NE(served.out.find("50 iters"), std::string::npos) << served.out;
}

// ibv_asyncwatch acknowledges every event it reads: a forged QP event would
// have it lock a mutex at 0x4141414141414141.
TEST_F(CrossUser, AsyncEventsFromAnotherUserOrNamingNoObjectAreDropped) {
  auto watcher = std::async(std::launch::async, [&] {
    return run_process({SOFTVERBS_CLI, "run", "--", "timeout", "4", "ibv_asyncwatch", "-d", "softverbs0"}, env(), 30);
  });
  const pid_t victim = wait_for_victim("ibv_asyncwatch", 2);
  ASSERT_NE(victim, 0);
  const ForgedEvent qp_fatal{0x4141414141414141ull, 1 /* IBV_EVENT_QP_FATAL */, 0};
  const ForgedEvent port_error{1, 10 /* IBV_EVENT_PORT_ERR */, 0};
  EXPECT_GT(send_as_nobody(victim, {bytes_of(&qp_fatal, sizeof qp_fatal), bytes_of(&port_error, sizeof port_error)}),
            0);
  for (const auto& name : test::abstract_sockets_of(victim))
    test::send_to_abstract(name, &qp_fatal, sizeof qp_fatal);  // this user's, naming no QP
  // What counts: the device's own event.
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "down"}, env()).exit_code, 0);
  const ProcessResult r = watcher.get();
  EXPECT_EQ(r.exit_code, 124) << "ended by timeout(1), not by a signal: " << r.err << r.out;
  EXPECT_NE(r.out.find("IBV_EVENT_DEVICE_FATAL"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("IBV_EVENT_QP_FATAL"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("IBV_EVENT_PORT_ERR"), std::string::npos) << "nobody's port event: " << r.out;
}

}  // namespace
}  // namespace softverbs
