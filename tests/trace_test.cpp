// `softverbs trace` and `softverbs diff` on real programs: rdma-core's
// ibv_rc_pingpong traced on a shared-memory device and on a UDP device
// gives the same traces; a program that takes an error path on request
// differs by exactly that path; the other processes of a traced program
// write FILE.<n>.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
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

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class Trace : public ::testing::Test {
 protected:
  // A device in a runtime directory of its own: `transport` shm or udp.
  std::vector<std::string> device(const std::string& name, const std::string& transport) {
    std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt-" + name};
    auto up = run_process({SOFTVERBS_CLI, "up", "--transport", transport}, env);
    EXPECT_EQ(up.exit_code, 0) << up.err;
    return env;
  }

  // ibv_rc_pingpong's server traced with `run --trace`, its client with
  // `run -- softverbs trace`: both ways must record.
  void pingpong(const std::vector<std::string>& env, const std::string& prefix) {
    const std::string gid =
        roce_v2_gid_index(run_process({SOFTVERBS_CLI, "status"}, env).out, ipv4_mapped_gid("127.0.0.1"));
    ASSERT_FALSE(gid.empty());
    const std::string port = std::to_string(20000 + getpid() % 20000);
    const std::vector<std::string> tool = {"ibv_rc_pingpong", "-d", "softverbs0", "-g", gid, "-p", port, "-n", "100"};
    std::vector<std::string> server = {SOFTVERBS_CLI, "run", "--trace", prefix + ".server", "--"};
    server.insert(server.end(), tool.begin(), tool.end());
    std::vector<std::string> client = {SOFTVERBS_CLI,      "run", "--", SOFTVERBS_CLI, "trace", "-o",
                                       prefix + ".client", "--"};
    client.insert(client.end(), tool.begin(), tool.end());
    client.push_back("localhost");
    auto background = std::async(std::launch::async, [&] { return run_process(server, env, 120); });
    ProcessResult result;
    for (int attempt = 0; attempt < 100; ++attempt) {
      result = run_process(client, env, 120);
      if (result.exit_code == 0 || result.err.find("Couldn't connect") == std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const ProcessResult server_result = background.get();
    ASSERT_EQ(result.exit_code, 0) << result.err;
    ASSERT_EQ(server_result.exit_code, 0) << server_result.err;
  }

  ProcessResult diff(const std::string& a, const std::string& b) { return run_process({SOFTVERBS_CLI, "diff", a, b}); }

  TemporaryDirectory dir_;
};

TEST_F(Trace, PingpongOnSharedMemoryAndUdpGivesTheSameTrace) {
  const std::string shm = dir_.path() + "/shm", udp = dir_.path() + "/udp";
  pingpong(device("shm", "shm"), shm);
  pingpong(device("udp", "udp"), udp);
  for (const char* side : {".server", ".client"}) {
    const std::string trace = read_file(shm + side);
    // Not an empty record: every round's completions are there.
    EXPECT_EQ(count(trace, " wc s"), 100u) << trace;
    EXPECT_EQ(count(trace, " wc r"), 100u) << trace;
    EXPECT_NE(trace.find("qp1 modify_qp mask=STATE|AV|PATH_MTU|RQ_PSN|MIN_RNR_TIMER|MAX_DEST_RD_ATOMIC|DEST_QPN "
                         "state=RTR dest=remote = 0"),
              std::string::npos)
        << trace;
    // Nothing per device or per run: no QP numbers, keys or addresses.
    EXPECT_EQ(trace.find("0x"), std::string::npos) << trace;
    auto result = diff(shm + side, udp + side);
    EXPECT_EQ(result.exit_code, 0) << result.err << result.out;
    EXPECT_EQ(result.out, "");
  }
}

TEST_F(Trace, AnErrorPathShowsAsExactlyThatDifference) {
  const auto env = device("shm", "shm");
  const std::string good = dir_.path() + "/good", bad = dir_.path() + "/bad", again = dir_.path() + "/again";
  for (const auto& [file, flag] : {std::pair{good, ""}, {bad, "--bad-rkey"}, {again, ""}}) {
    auto run = run_process({SOFTVERBS_CLI, "run", "--trace", file, "--", TRACE_EXAMPLE, flag}, env);
    ASSERT_EQ(run.exit_code, 0) << run.err;
  }
  auto same = diff(good, again);
  EXPECT_EQ(same.exit_code, 0) << same.out;

  auto result = diff(good, bad);
  EXPECT_EQ(result.exit_code, 1) << result.err;
  const std::string& out = result.out;
  // The WRITE to the bad rkey, the SEND flushed behind it, and the receive
  // that SEND would have consumed, flushed at the end instead: nothing else.
  EXPECT_NE(out.find("-qp1 wc s2 SUCCESS RDMA_WRITE cq=cq1\n-qp1 wc s3 SUCCESS SEND cq=cq1\n"
                     "+qp1 wc s2 REM_ACCESS_ERR cq=cq1\n+qp1 wc s3 WR_FLUSH_ERR cq=cq1\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("-qp2 wc r2 SUCCESS RECV len=64 cq=cq2\n+qp2 wc r2 WR_FLUSH_ERR cq=cq2\n"), std::string::npos)
      << out;
  EXPECT_EQ(count(out, "\n==="), 2u) << out;
  EXPECT_NE(out.find("=== qp1 send completions"), std::string::npos) << out;
  EXPECT_NE(out.find("=== qp2 receive completions"), std::string::npos) << out;
  EXPECT_EQ(count(out, "\n-qp"), 3u) << out;
  EXPECT_EQ(count(out, "\n+qp"), 3u) << out;
}

// _exit() runs no atexit handler: the trace of a program that leaves
// through it (fio's job processes do) still holds every call it made.
TEST_F(Trace, AProgramThatLeavesThroughUnderscoreExitKeepsItsTrace) {
  const auto env = device("shm", "shm");
  const std::string file = dir_.path() + "/left";
  auto run = run_process({SOFTVERBS_CLI, "run", "--trace", file, "--", TRACE_EXAMPLE, "--leave-at-once"}, env);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const std::string trace = read_file(file);
  EXPECT_NE(trace.find("dev1 open_device = ok"), std::string::npos) << trace;
  EXPECT_NE(trace.find("qp1 wc s3 SUCCESS SEND cq=cq1"), std::string::npos) << trace;
  EXPECT_NE(trace.find("qp2 wc r2 SUCCESS RECV len=64 cq=cq2"), std::string::npos) << trace;
  EXPECT_EQ(trace.find("destroy_qp"), std::string::npos) << trace;
}

TEST_F(Trace, OtherProcessesOfTheProgramWriteNumberedFiles) {
  const auto env = device("shm", "shm");
  const std::string file = dir_.path() + "/family";
  std::ofstream(file + ".7") << "stale\n";  // from an earlier run: removed
  const std::string twice = std::string(TRACE_EXAMPLE) + " && " + TRACE_EXAMPLE + " && true";
  auto run =
      run_process({SOFTVERBS_CLI, "run", "--", SOFTVERBS_CLI, "trace", "-o", file, "--", "sh", "-c", twice}, env);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_FALSE(fs::exists(file + ".7"));
  // The shell made no verbs call: its trace holds the header only.
  EXPECT_EQ(read_file(file), "# softverbs-trace 1\n");
  EXPECT_NE(read_file(file + ".1").find("dev1 open_device = ok"), std::string::npos);
  auto result = diff(file + ".1", file + ".2");
  EXPECT_EQ(result.exit_code, 0) << result.err << result.out;
}

TEST_F(Trace, WorksWithoutAnySoftverbsDevice) {
  // No `softverbs run`: the program sees the host's own devices (none here,
  // or an HCA) and behaves as it does untraced.
  const std::string file = dir_.path() + "/plain";
  auto plain = run_process({"ibv_devinfo"});
  auto traced = run_process({SOFTVERBS_CLI, "trace", "-o", file, "--", "ibv_devinfo"});
  EXPECT_EQ(traced.exit_code, plain.exit_code) << traced.err;
  EXPECT_EQ(traced.out, plain.out);
  EXPECT_EQ(read_file(file).rfind("# softverbs-trace 1\n", 0), 0u);
  auto missing = run_process({SOFTVERBS_CLI, "trace", "-o", file, "--", "no-such-program-here"});
  EXPECT_EQ(missing.exit_code, 127);
}

TEST_F(Trace, DiffRefusesWhatItCannotCompare) {
  const std::string trace = dir_.path() + "/t", other = dir_.path() + "/v2";
  std::ofstream(trace) << "# softverbs-trace 1\ndev1 open_device = ok\n";
  std::ofstream(other) << "# softverbs-trace 2\ndev1 open_device = ok\n";
  auto result = diff(trace, other);
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("format version 2"), std::string::npos) << result.err;
  EXPECT_EQ(diff(trace, dir_.path() + "/none").exit_code, 2);
  EXPECT_EQ(diff(trace, trace).exit_code, 0);
}

}  // namespace
}  // namespace softverbs
