// Correct programs under `softverbs run --check=error`: rdma-core's
// pingpongs, perftest and rping, and programs of ours for what they do not
// exercise, finish with exit 0 and the verbs checker reports nothing, on the shared-memory transport and over UDP on
// lo.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "device_status.h"
#include "process_runner.h"

namespace softverbs {
namespace {

namespace fs = std::filesystem;
using test::ipv4_mapped_gid;
using test::ProcessResult;
using test::roce_v2_gid_index;
using test::run_process;
using test::TemporaryDirectory;

struct ToolCase {
  const char* name;
  std::vector<std::string> args;  // the server's; the client's add the server's address
  const char* gid_option;         // how the tool takes a GID index
};

const ToolCase kTools[] = {
    {"rc_pingpong", {"ibv_rc_pingpong", "-n", "300"}, "-g"},
    {"rc_pingpong_new_send_api", {"ibv_rc_pingpong", "-N", "-n", "200"}, "-g"},
    {"ud_pingpong", {"ibv_ud_pingpong", "-s", "1024", "-n", "300"}, "-g"},
    {"srq_pingpong", {"ibv_srq_pingpong", "-n", "300"}, "-g"},
    {"ib_write_bw", {"ib_write_bw", "-n", "2000", "-s", "4096"}, "-x"},
    {"ib_send_bw", {"ib_send_bw", "-n", "2000", "-s", "4096"}, "-x"},
    {"ib_read_bw", {"ib_read_bw", "-n", "1000", "-s", "4096"}, "-x"},
};

// A device with `transport()` in a private runtime directory.
class CheckedRun {
 protected:
  virtual ~CheckedRun() = default;
  virtual const std::string& transport() const = 0;
  void bring_up() {
    env_ = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt"};
    auto up = run_process({SOFTVERBS_CLI, "up", "--transport", transport()}, env_);
    ASSERT_EQ(up.exit_code, 0) << up.err;
  }

  std::string gid_index() const {
    if (transport() == "shm") return "0";
    return roce_v2_gid_index(run_process({SOFTVERBS_CLI, "status"}, env_).out, ipv4_mapped_gid("127.0.0.1"));
  }

  std::vector<std::string> checked(std::vector<std::string> command) const {
    command.insert(command.begin(), {SOFTVERBS_CLI, "run", "--check=error", "--"});
    return command;
  }

  static void expect_clean(const ProcessResult& r, const std::string& side) {
    EXPECT_EQ(r.exit_code, 0) << side << ":\n" << r.err << r.out;
    EXPECT_EQ(r.err.find("softverbs check"), std::string::npos) << side << ":\n" << r.err;
  }

  TemporaryDirectory dir_;
  std::vector<std::string> env_;
};

class CheckedTools : public CheckedRun, public ::testing::TestWithParam<std::tuple<ToolCase, std::string>> {
 protected:
  void SetUp() override { bring_up(); }
  const std::string& transport() const override { return std::get<1>(GetParam()); }
};

class CheckedRping : public CheckedRun, public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { bring_up(); }
  const std::string& transport() const override { return GetParam(); }
};

std::string port_for(const std::string& name) {
  return std::to_string(20000 + static_cast<int>((std::hash<std::string>{}(name) + 7919u * getpid()) % 12000));
}

TEST_P(CheckedTools, FinishCleanAndUnreported) {
  const ToolCase& tool = std::get<0>(GetParam());
  std::vector<std::string> server = tool.args;
  server.insert(server.end(), {"-d", "softverbs0", tool.gid_option, gid_index(), "-p", port_for(tool.name)});
  std::vector<std::string> client = server;
  client.push_back("127.0.0.1");
  auto background = std::async(std::launch::async, [&] { return run_process(checked(server), env_, 120); });
  ProcessResult client_result;
  for (int attempt = 0; attempt < 100; ++attempt) {
    client_result = run_process(checked(client), env_, 120);
    const bool refused = client_result.err.find("Couldn't connect") != std::string::npos ||
                         client_result.err.find("Unable to open file descriptor") != std::string::npos;
    if (!refused || client_result.exit_code == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const ProcessResult server_result = background.get();
  expect_clean(client_result, "client");
  expect_clean(server_result, "server");
}

TEST_P(CheckedRping, FinishesCleanAndUnreported) {
  const std::string runtime = dir_.path() + "/rt";
  auto background = std::async(std::launch::async, [&] {
    return run_process(checked({"rping", "-s", "-v", "-C", "10", "-a", "127.0.0.1"}), env_, 60);
  });
  auto listening = [&] { return test::rdmacm_listening(runtime); };
  for (int i = 0; i < 200 && !listening(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const ProcessResult client = run_process(checked({"rping", "-c", "-v", "-C", "10", "-a", "127.0.0.1"}), env_);
  const ProcessResult server = background.get();
  expect_clean(client, "client");
  expect_clean(server, "server");
  EXPECT_NE(client.out.find("ping data: rdma-ping-9"), std::string::npos) << client.out;
}

class CheckedPrograms : public CheckedRun, public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { bring_up(); }
  const std::string& transport() const override { return GetParam(); }
};

// A receive from an SRQ that completes for a QP that never posted (Open
// MPI's one-sided test over UCX was reported for one), or for a QP
// destroyed before the poll: the buffer, posted again, holds the first
// message's bytes past the second's, which the device wrote before the
// repost. Nothing to report.
TEST_P(CheckedPrograms, AnSrqReceiveOfAnUntrackedQpPostedAgainIsNotReported) {
  const ProcessResult r = run_process(checked({SRQ_RECEIVE_OF_UNTRACKED_QP, gid_index()}), env_, 60);
  expect_clean(r, "program");
  EXPECT_NE(r.out.find("never posted: second message placed over the first, checked"), std::string::npos)
      << r.err << r.out;
  EXPECT_NE(r.out.find("destroyed before the poll: second message placed over the first, checked"), std::string::npos)
      << r.err << r.out;
}

// An event acknowledged by another thread while the destroy is under way
// (UCX's async thread does so at MPI_Finalize): the destroy waits for it,
// as libibverbs does on an HCA, and there is nothing to report.
TEST_P(CheckedPrograms, AnEventAcknowledgedByAnotherThreadDuringTheDestroyIsNotReported) {
  const ProcessResult r = run_process(checked({CQ_EVENT_ACKNOWLEDGED_BY_ANOTHER_THREAD}), env_, 60);
  expect_clean(r, "program");
  EXPECT_NE(r.out.find("the destroy waited for the acknowledgement"), std::string::npos) << r.err << r.out;
}

INSTANTIATE_TEST_SUITE_P(Tools, CheckedTools,
                         ::testing::Combine(::testing::ValuesIn(kTools), ::testing::Values("shm", "udp")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param);
                         });
INSTANTIATE_TEST_SUITE_P(Tools, CheckedRping, ::testing::Values("shm", "udp"),
                         [](const auto& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(Programs, CheckedPrograms, ::testing::Values("shm", "udp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace softverbs
