// fio's rdma engine (Debian's fio, unmodified): a server job (rw=read) and a
// client job (rw=write) connect through the rdma_cm, exchange their
// buffers' keys in SENDs, and the client moves the job's bytes with RDMA
// WRITEs or READs into and out of the server's registered buffers, waiting
// on a completion channel. Both started with `softverbs run`, on a
// shared-memory and a UDP device.
//
// Its SEND verb is not run: fio connects with an RNR retry count of 0, so a
// receiver that falls behind its sender by the server's iodepth fails the
// job with IBV_WC_RNR_RETRY_EXC_ERR, on an HCA as here (fio's own comments
// say so); on a 2-core machine that happens within a second.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "device_status.h"
#include "process_runner.h"

namespace softverbs {
namespace {

using test::TemporaryDirectory;

struct FioCase {
  const char* name;
  const char* transport;  // for `softverbs up --transport`
  const char* verb;       // fio's rdma engine: write or read
};
void PrintTo(const FioCase& c, std::ostream* out) { *out << c.name; }

class FioRdma : public ::testing::TestWithParam<FioCase> {
 protected:
  void SetUp() override {
    if (test::run_process({"sh", "-c", "command -v fio"}).exit_code != 0)
      GTEST_SKIP() << "fio is not installed (scripts/install-deps installs it)";
    env_ = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt"};
    const auto up = test::run_process({SOFTVERBS_CLI, "up", "--transport", GetParam().transport}, env_);
    ASSERT_EQ(up.exit_code, 0) << up.err;
  }

  std::vector<std::string> fio(const std::string& job, const std::vector<std::string>& options) const {
    std::vector<std::string> command = {SOFTVERBS_CLI,
                                        "run",
                                        "--",
                                        "fio",
                                        "--name=" + job,
                                        "--ioengine=rdma",
                                        "--port=5555",
                                        "--bs=64k",
                                        "--size=256m",
                                        "--iodepth=16",
                                        std::string("--verb=") + GetParam().verb};
    command.insert(command.end(), options.begin(), options.end());
    return command;
  }

  TemporaryDirectory dir_;
  std::vector<std::string> env_;
};

TEST_P(FioRdma, TheClientMovesTheWholeJobAndBothSidesEndWithoutError) {
  const std::string runtime = dir_.path() + "/rt";
  const auto pair = test::run_server_client(
      fio("server", {"--rw=read"}), fio("client", {"--rw=write", "--hostname=127.0.0.1"}), env_,
      [&] { return test::rdmacm_listening(runtime); }, 60);
  // fio exits 0 after a failed connection too: its report says what ran.
  const std::string both =
      "client:\n" + pair.client.out + pair.client.err + "\nserver:\n" + pair.server.out + pair.server.err;
  EXPECT_EQ(pair.client.exit_code, 0) << both;
  EXPECT_EQ(pair.server.exit_code, 0) << both;
  EXPECT_NE(pair.client.out.find("client: (groupid=0, jobs=1): err= 0"), std::string::npos) << both;
  EXPECT_NE(pair.server.out.find("server: (groupid=0, jobs=1): err= 0"), std::string::npos) << both;
  EXPECT_NE(pair.client.out.find("io=256MiB"), std::string::npos) << both;
  EXPECT_EQ((pair.client.err + pair.server.err).find("fio: "), std::string::npos) << both;
}

INSTANTIATE_TEST_SUITE_P(Verbs, FioRdma,
                         ::testing::Values(FioCase{"shm_write", "auto", "write"}, FioCase{"shm_read", "auto", "read"},
                                           FioCase{"udp_write", "udp", "write"}, FioCase{"udp_read", "udp", "read"}),
                         [](const ::testing::TestParamInfo<FioCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace softverbs
