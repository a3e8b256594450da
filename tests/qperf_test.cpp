// qperf (Debian's package, unmodified) between two processes started with
// `softverbs run`, on the transport this binary was built for
// (QPERF_TRANSPORT: shm or udp). qperf waits on completion channels by
// default and ends each test with SIGALRM, whose handler has no SA_RESTART:
// its latency tests need ibv_get_cq_event to return EINTR then, as the
// kernel's channel does. RoCE has no LIDs, so over UDP it connects through
// the rdma_cm (-cm1), as on a RoCE HCA; its UC and UD tests address the
// peer by LID alone and are refused there, as on such an HCA.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <ostream>
#include <regex>
#include <string>
#include <vector>

#include "process_runner.h"

namespace softverbs {
namespace {

using test::ProcessResult;
using test::run_process;
using test::TemporaryDirectory;

struct QperfCase {
  const char* name;
  bool use_cm;
  std::vector<std::string> tests;
};

void PrintTo(const QperfCase& c, std::ostream* os) { *os << c.name; }

class Qperf : public ::testing::TestWithParam<QperfCase> {
 protected:
  void SetUp() override {
    if (run_process({"sh", "-c", "command -v qperf"}).exit_code != 0)
      GTEST_SKIP() << "qperf is not installed (scripts/install-deps installs it)";
    env_ = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt"};
    auto up = run_process({SOFTVERBS_CLI, "up", "--transport", QPERF_TRANSPORT}, env_);
    ASSERT_EQ(up.exit_code, 0) << up.err;
  }

  TemporaryDirectory dir_;
  std::vector<std::string> env_;
};

// The value qperf printed for `test` ("rc_lat:\n    latency  =  18.5 us");
// 0 if it printed none.
double result_of(const std::string& out, const std::string& test) {
  std::smatch found;
  const std::regex line(test + ":\\n\\s+(bw|latency|msg_rate|send_bw)\\s+=\\s+([0-9.]+) ");
  return std::regex_search(out, found, line) ? std::strtod(found[2].str().c_str(), nullptr) : 0;
}

TEST_P(Qperf, EveryTestReportsAResult) {
  const QperfCase& c = GetParam();
  // A port of its own per run: the last run's may still be in TIME-WAIT.
  const std::string port = std::to_string(
      20000 + static_cast<int>((std::hash<std::string>{}(c.name) + 7919u * static_cast<unsigned>(getpid())) % 12000));
  const std::string cli = SOFTVERBS_CLI;
  const std::string qperf = cli + " run -- qperf -lp " + port;
  std::string tests;
  for (const std::string& test : c.tests) tests += " " + test;
  // The server forks a child per test and runs until told to quit; the
  // client waits until it answers.
  const std::string script = qperf + " & server=$!\n" + "for i in $(seq 100); do " + qperf +
                             " localhost conf >/dev/null 2>&1 && break; sleep 0.1; done\n" + qperf + " -t 1" +
                             (c.use_cm ? " -cm1" : "") + " localhost" + tests + "; status=$?\n" + qperf +
                             " localhost quit >/dev/null 2>&1 || kill $server\nwait $server\nexit $status\n";
  const ProcessResult r = run_process({"sh", "-c", script}, env_, 180);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(r.err.find("failed"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("error"), std::string::npos) << r.out;
  for (const std::string& test : c.tests) EXPECT_GT(result_of(r.out, test), 0) << test << ":\n" << r.err << r.out;
}

const QperfCase kCases[] = {
#if defined(QPERF_UDP)
    {"rc_through_the_rdma_cm",
     true,
     {"rc_bw", "rc_bi_bw", "rc_lat", "rc_rdma_read_bw", "rc_rdma_read_lat", "rc_rdma_write_bw", "rc_rdma_write_lat",
      "ver_rc_compare_swap", "ver_rc_fetch_add"}},
#else
    {"rc_uc",
     false,
     {"rc_bw", "rc_bi_bw", "rc_lat", "uc_bw", "uc_lat", "rc_rdma_read_bw", "rc_rdma_read_lat", "rc_rdma_write_bw",
      "rc_rdma_write_lat", "rc_rdma_write_poll_lat", "uc_rdma_write_bw", "uc_rdma_write_lat", "uc_rdma_write_poll_lat",
      "rc_compare_swap_mr", "rc_fetch_add_mr", "ver_rc_compare_swap", "ver_rc_fetch_add"}},
    {"rc_through_the_rdma_cm", true, {"rc_bw", "rc_lat", "rc_rdma_read_lat", "rc_rdma_write_lat", "ver_rc_fetch_add"}},
#endif
};

INSTANTIATE_TEST_SUITE_P(Tests, Qperf, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<QperfCase>& info) { return info.param.name; });

}  // namespace
}  // namespace softverbs
