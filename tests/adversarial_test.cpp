// Correct programs survive `softverbs run --adversarial=SEED`: rdma-core's
// pingpongs, perftest and rping, unmodified, with fixed seeds, on the
// transport this binary was built for (ADVERSARIAL_TRANSPORT: shm or udp).
// The examples that fail under it are in examples/bugs (adversarial.cmake).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <ostream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "device_status.h"
#include "process_runner.h"

namespace softverbs {
namespace {

namespace fs = std::filesystem;
using test::ProcessResult;
using test::run_process;
using test::TemporaryDirectory;

enum class Meeting { Tcp, RdmaCm };  // how the two sides find each other

struct Tool {
  const char* name;
  Meeting meeting;
  std::vector<std::string> server;  // "GID" stands for the RoCE v2 GID index of 127.0.0.1
  std::vector<std::string> client;
};

struct Case {
  Tool tool;
  int seed;
};

const Tool kTools[] = {
    {"rc_pingpong", Meeting::Tcp, {"ibv_rc_pingpong", "-g", "GID", "-n", "200"}, {"localhost"}},
    {"rc_pingpong_events", Meeting::Tcp, {"ibv_rc_pingpong", "-g", "GID", "-e", "-n", "200"}, {"localhost"}},
    {"ud_pingpong", Meeting::Tcp, {"ibv_ud_pingpong", "-g", "GID", "-n", "200"}, {"localhost"}},
    {"srq_pingpong", Meeting::Tcp, {"ibv_srq_pingpong", "-g", "GID", "-n", "200"}, {"localhost"}},
    {"srq_pingpong_events", Meeting::Tcp, {"ibv_srq_pingpong", "-g", "GID", "-e", "-n", "200"}, {"localhost"}},
    {"ib_write_bw", Meeting::Tcp, {"ib_write_bw", "-x", "GID", "-n", "1000"}, {"127.0.0.1"}},
    {"ib_send_bw", Meeting::Tcp, {"ib_send_bw", "-x", "GID", "-n", "1000"}, {"127.0.0.1"}},
    {"ib_read_lat", Meeting::Tcp, {"ib_read_lat", "-x", "GID", "-n", "1000"}, {"127.0.0.1"}},
    {"rping", Meeting::RdmaCm, {"rping", "-s", "-v", "-C", "10", "-a", "127.0.0.1"}, {}},
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.tool.name << " seed " << c.seed; }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const Tool& tool : kTools)
    for (int seed : {1, 2}) cases.push_back({tool, seed});
  return cases;
}

class Adversarial : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    env_ = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt"};
    auto up = run_process({SOFTVERBS_CLI, "up", "--transport", ADVERSARIAL_TRANSPORT}, env_);
    ASSERT_EQ(up.exit_code, 0) << up.err;
    gid_ =
        test::roce_v2_gid_index(run_process({SOFTVERBS_CLI, "status"}, env_).out, test::ipv4_mapped_gid("127.0.0.1"));
    ASSERT_FALSE(gid_.empty());
  }

  std::vector<std::string> command(const std::vector<std::string>& words, int seed) const {
    std::vector<std::string> argv = {SOFTVERBS_CLI, "run", "--adversarial=" + std::to_string(seed), "--"};
    for (const std::string& word : words) argv.push_back(word == "GID" ? gid_ : word);
    return argv;
  }

  TemporaryDirectory dir_;
  std::vector<std::string> env_;
  std::string gid_;
};

TEST_P(Adversarial, CorrectProgramSurvives) {
  const Case& c = GetParam();
  const int seed = c.seed;
  std::vector<std::string> server = c.tool.server;
  std::vector<std::string> client;
  test::PairResult r;
  if (c.tool.meeting == Meeting::Tcp) {
    // A port of its own per run (the last run's may still be in TIME-WAIT).
    const std::string port = std::to_string(
        20000 + static_cast<int>((std::hash<std::string>{}(c.tool.name) + 7919u * getpid() + seed) % 12000));
    server.insert(server.end(), {"-p", port});
    client = server;
    client.insert(client.end(), c.tool.client.begin(), c.tool.client.end());
    auto background = std::async(std::launch::async, [&] { return run_process(command(server, seed), env_, 120); });
    for (int attempt = 0; attempt < 100; ++attempt) {
      r.client = run_process(command(client, seed), env_, 120);
      const bool refused = r.client.err.find("Couldn't connect") != std::string::npos ||
                           r.client.err.find("Unable to open file descriptor") != std::string::npos;
      if (!refused || r.client.exit_code == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    r.server = background.get();
  } else {
    client = server;
    client[1] = "-c";
    const std::string runtime = dir_.path() + "/rt";
    auto listening = [&] { return test::rdmacm_listening(runtime); };
    r = test::run_server_client(command(server, seed), command(client, seed), env_, listening, 120);
  }
  for (const ProcessResult* p : {&r.server, &r.client}) {
    EXPECT_EQ(p->exit_code, 0) << "client:\n"
                               << r.client.err << r.client.out << "\nserver:\n"
                               << r.server.err << r.server.out;
    EXPECT_NE(p->err.find("softverbs adversarial: seed " + std::to_string(seed) + "\n"), std::string::npos) << p->err;
    EXPECT_EQ(p->err.find("Failed status"), std::string::npos) << p->err;
  }
}

INSTANTIATE_TEST_SUITE_P(Tools, Adversarial, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.tool.name) + "_seed" + std::to_string(info.param.seed);
                         });

// Without =SEED, a seed is chosen at random and printed, once per process.
TEST(AdversarialSeed, ChosenAtRandomAndPrintedOnce) {
  TemporaryDirectory dir;
  std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + dir.path() + "/rt"};
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "up", "--transport", ADVERSARIAL_TRANSPORT}, env).exit_code, 0);
  std::vector<std::string> seeds;
  for (int run = 0; run < 2; ++run) {
    ProcessResult r = run_process({SOFTVERBS_CLI, "run", "--adversarial", "--", "ibv_devinfo"}, env);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::smatch match;
    const std::regex line("softverbs adversarial: seed ([0-9]+)\n");
    ASSERT_TRUE(std::regex_search(r.err, match, line)) << r.err;
    seeds.push_back(match[1]);
    EXPECT_EQ(r.err.find("softverbs adversarial", match.position(0) + 1), std::string::npos) << r.err;
  }
  EXPECT_NE(seeds[0], seeds[1]);
  // A seed that is not a number is a usage error.
  EXPECT_EQ(run_process({SOFTVERBS_CLI, "run", "--adversarial=x", "--", "true"}, env).exit_code, 2);
}

}  // namespace
}  // namespace softverbs
