// rdma-core's ibv_*_pingpong, unmodified, between two processes started with
// `softverbs run`: the shared-memory data path as users first meet it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "process_runner.h"

namespace softverbs {
namespace {

using test::ProcessResult;
using test::run_process;
using test::TemporaryDirectory;

struct PingpongCase {
  const char* name;
  const char* tool;
  std::vector<std::string> args;
  const char* copy_method = "auto";   // SOFTVERBS_COPY
  const char* finished = "iters in";  // what both print at the end
};

class Pingpong : public ::testing::TestWithParam<PingpongCase> {};

TEST_P(Pingpong, ServerAndClientExitZero) {
  const PingpongCase& c = GetParam();
  TemporaryDirectory dir;
  std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + dir.path() + "/rt",
                                  std::string("SOFTVERBS_COPY=") + c.copy_method};
  // A port per case, so that ctest -j runs them side by side.
  // A port of its own per run (the last run's may still be in TIME-WAIT).
  std::string port =
      std::to_string(20000 + static_cast<int>((std::hash<std::string>{}(c.name) + 7919u * getpid()) % 12000));
  auto command = [&](bool client) {
    std::vector<std::string> argv = {SOFTVERBS_CLI, "run", "--", c.tool, "-d", "softverbs0", "-p", port};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    if (client) argv.push_back("localhost");
    return argv;
  };
  // Bring the device up first, so that server and client do not race to.
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "up"}, env).exit_code, 0);
  auto server = std::async(std::launch::async, [&] { return run_process(command(false), env, 60); });
  ProcessResult client;
  for (int attempt = 0; attempt < 100; ++attempt) {
    client = run_process(command(true), env, 60);
    if (client.err.find("Couldn't connect") == std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ProcessResult served = server.get();
  EXPECT_EQ(client.exit_code, 0) << client.err << client.out;
  EXPECT_EQ(served.exit_code, 0) << served.err << served.out;
  for (const ProcessResult* r : {&client, &served}) {
    EXPECT_NE(r->out.find(c.finished), std::string::npos) << r->out << r->err;
    EXPECT_EQ(r->err.find("Failed status"), std::string::npos) << r->err;
    EXPECT_EQ(r->err.find("Couldn't prefetch"), std::string::npos) << r->err;  // -P goes on without it
    // With -t each receive carries the device clock: consecutive ones are
    // apart by a round trip, never by nothing.
    if (std::find(c.args.begin(), c.args.end(), "-t") != c.args.end()) {
      EXPECT_GT(test::number_after(r->out, "Min receive completion clock cycles = "), 0u) << r->out;
    }
  }
}

const PingpongCase kCases[] = {
    {"rc", "ibv_rc_pingpong", {"-n", "200"}},
    {"rc_events", "ibv_rc_pingpong", {"-e", "-n", "200"}},
    {"rc_gid_v2", "ibv_rc_pingpong", {"-g", "3", "-n", "200"}},
    {"rc_1MiB_validated", "ibv_rc_pingpong", {"-g", "1", "-s", "1048576", "-c", "-n", "50"}},
    {"rc_events_validated", "ibv_rc_pingpong", {"-g", "3", "-e", "-c", "-s", "65536", "-n", "50"}},
    {"rc_new_send_api", "ibv_rc_pingpong", {"-N", "-n", "200"}},
    {"rc_new_send_api_events", "ibv_rc_pingpong", {"-N", "-e", "-g", "3", "-c", "-n", "200"}},
    {"uc", "ibv_uc_pingpong", {"-n", "200"}},
    {"uc_events", "ibv_uc_pingpong", {"-e", "-n", "200"}},
    {"uc_gid_v2", "ibv_uc_pingpong", {"-g", "3", "-c", "-n", "200"}},
    // On the device's Ethernet (RoCE) port a UD address handle needs a GRH,
    // as on an HCA: ibv_ud_pingpong names a GID.
    {"ud", "ibv_ud_pingpong", {"-g", "1", "-n", "200"}},
    {"ud_events", "ibv_ud_pingpong", {"-g", "3", "-e", "-n", "200"}},
    {"ud_gid_v2", "ibv_ud_pingpong", {"-g", "3", "-c", "-n", "200"}},
    {"srq", "ibv_srq_pingpong", {"-n", "200"}},
    // Completion timestamps (the device clock, read by both processes).
    {"rc_timestamps", "ibv_rc_pingpong", {"-t", "-n", "200"}},
    {"rc_timestamps_validated", "ibv_rc_pingpong", {"-t", "-g", "3", "-c", "-s", "65536", "-n", "50"}},
    {"srq_events", "ibv_srq_pingpong", {"-e", "-n", "200"}},
    {"srq_gid_v2", "ibv_srq_pingpong", {"-g", "3", "-c", "-n", "200"}},
    // XRC: SENDs over XRC_SEND QPs into the peer's XRC SRQ (both in the
    // domain of /tmp/xrc_domain's inode), completing with the XRC_RECV QPN.
    {"xsrq", "ibv_xsrq_pingpong", {"-n", "200"}, "auto", "success"},
    {"xsrq_events_gid_v2", "ibv_xsrq_pingpong", {"-e", "-g", "3", "-n", "200"}, "auto", "success"},
    // The fallback for kernels that refuse process_vm_*, forced.
    {"rc_agent_copies", "ibv_rc_pingpong", {"-e", "-c", "-s", "65536", "-n", "50"}, "agent"},
    {"ud_agent_copies", "ibv_ud_pingpong", {"-g", "3", "-e", "-c", "-n", "50"}, "agent"},
    // On-demand paging (explicit, implicit, prefetched) and device memory.
    {"rc_odp_validated", "ibv_rc_pingpong", {"-o", "-c", "-n", "200"}},
    {"rc_implicit_odp_validated", "ibv_rc_pingpong", {"-O", "-c", "-n", "200"}},
    {"rc_odp_prefetch_validated", "ibv_rc_pingpong", {"-o", "-P", "-c", "-n", "200"}},
    {"rc_odp_agent_copies", "ibv_rc_pingpong", {"-o", "-c", "-s", "65536", "-n", "50"}, "agent"},
    {"rc_device_memory_validated", "ibv_rc_pingpong", {"-j", "-c", "-n", "200"}},
    {"ib_send_bw_odp", "ib_send_bw", {"--odp", "-n", "1000"}, "auto", "BW average"},
    // perftest's XRC mode: XRC_SEND QPs into the peer's XRC SRQ (and, both
    // ways or for latency, XRC_RECV QPs on each side too).
    {"ib_send_bw_xrc", "ib_send_bw", {"-c", "XRC", "-n", "1000"}, "auto", "BW average"},
    {"ib_write_bw_xrc_bidirectional", "ib_write_bw", {"-c", "XRC", "-b", "-n", "1000"}, "auto", "BW average"},
    {"ib_send_lat_xrc", "ib_send_lat", {"-c", "XRC", "-n", "500"}, "auto", "t_typical"},
    // perftest's other modes: UD with events, UC both ways, an SRQ, an MR per QP.
    {"ib_send_bw_ud_events_4qps", "ib_send_bw", {"-c", "UD", "-e", "-q", "4", "-n", "500"}, "auto", "BW average"},
    {"ib_write_bw_uc_bidirectional", "ib_write_bw", {"-c", "UC", "-b", "-n", "1000"}, "auto", "BW average"},
    {"ib_send_bw_srq_4qps", "ib_send_bw", {"--use-srq", "-q", "4", "-n", "500"}, "auto", "BW average"},
    {"ib_write_bw_mr_per_qp", "ib_write_bw", {"--mr_per_qp", "-q", "4", "-Q", "8", "-n", "500"}, "auto", "BW average"},
};

INSTANTIATE_TEST_SUITE_P(Tools, Pingpong, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<PingpongCase>& info) { return info.param.name; });

}  // namespace
}  // namespace softverbs
