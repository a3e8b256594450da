// rdma-core's rdma_cm tools and perftest in rdma_cm mode, unmodified,
// between two processes started with `softverbs run`: they load our
// librdmacm.so.1 and connect through its connection manager.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "device_status.h"
#include "mckey_group.h"
#include "process_runner.h"

namespace softverbs {
namespace {

namespace fs = std::filesystem;
using test::PairResult;
using test::run_process;
using test::TemporaryDirectory;

struct ToolPair {
  const char* name;
  std::vector<std::string> server;
  std::vector<std::string> client;
  // cmtime's server: rdma-core 44's never exits by itself; later ones (56)
  // end once their client is done.
  bool server_runs_until_killed = false;
};

// Test names and failure messages show the pair's name, not its bytes.
void PrintTo(const ToolPair& pair, std::ostream* out) { *out << pair.name; }

class RdmacmTools : public ::testing::TestWithParam<ToolPair> {};

std::vector<std::string> under_softverbs(std::vector<std::string> command) {
  command.insert(command.begin(), {SOFTVERBS_CLI, "run", "--"});
  return command;
}

TEST_P(RdmacmTools, ServerAndClientSucceed) {
  const ToolPair& pair = GetParam();
  TemporaryDirectory dir;
  std::string runtime = dir.path() + "/rt";
  std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + runtime};
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "up"}, env).exit_code, 0);
  std::vector<std::string> server = pair.server, client = pair.client;
  if (pair.server_runs_until_killed) {
    // The client stops the server once done, however long the run takes.
    const auto joined = [](const std::vector<std::string>& words) {
      std::string line;
      for (const std::string& word : words) line += (line.empty() ? "" : " ") + word;
      return line;
    };
    auto commands = test::server_stopped_by_client(joined(server), joined(client), dir.path() + "/server.pid");
    server = commands.server;
    client = commands.client;
  }
  // The client starts once the server's listener is in the CM directory.
  auto listening = [&] { return test::rdmacm_listening(runtime); };
  PairResult r = test::run_server_client(under_softverbs(server), under_softverbs(client), env, listening);
  EXPECT_EQ(r.client.exit_code, 0) << "client:\n"
                                   << r.client.err << r.client.out << "\nserver:\n"
                                   << r.server.err << r.server.out;
  // A server stopped by the client's SIGTERM: the shell's status 128 + 15.
  if (pair.server_runs_until_killed && r.server.exit_code != 0)
    EXPECT_EQ(r.server.exit_code, 143) << r.server.err << r.server.out;
  else
    EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
}

const ToolPair kPairs[] = {
    {"rping_verbose",
     {"rping", "-s", "-v", "-C", "10", "-a", "127.0.0.1"},
     {"rping", "-c", "-v", "-C", "10", "-a", "127.0.0.1"}},
    {"rping_1000", {"rping", "-s", "-C", "1000", "-a", "127.0.0.1"}, {"rping", "-c", "-C", "1000", "-a", "127.0.0.1"}},
    {"rping_64KiB",
     {"rping", "-s", "-S", "65535", "-C", "100", "-a", "127.0.0.1"},
     {"rping", "-c", "-S", "65535", "-C", "100", "-a", "127.0.0.1"}},
    {"rping_no_cm_qp",
     {"rping", "-s", "-q", "-C", "100", "-a", "127.0.0.1"},
     {"rping", "-c", "-q", "-C", "100", "-a", "127.0.0.1"}},
    {"rdma_server_client", {"rdma_server"}, {"rdma_client", "-s", "127.0.0.1"}},
    // rdma_xclient sends 16 bytes inline from a QP asked for no inline size.
    {"rdma_xserver_client_rc", {"rdma_xserver", "-c", "r"}, {"rdma_xclient", "-s", "127.0.0.1", "-c", "r"}},
    // XRC through the rdma_cm: an XRC_RECV QP and XRC SRQ in the shim's XRC
    // domain, the SRQ's number in the REP's private data.
    {"rdma_xserver_client_xrc", {"rdma_xserver", "-c", "x"}, {"rdma_xclient", "-s", "127.0.0.1", "-c", "x"}},
    {"ucmatose_4_connections",
     {"ucmatose", "-c", "4", "-C", "20", "-S", "1000"},
     {"ucmatose", "-s", "127.0.0.1", "-c", "4", "-C", "20", "-S", "1000"}},
    {"udaddy", {"udaddy"}, {"udaddy", "-s", "127.0.0.1"}},
    {"cmtime", {"cmtime", "-c", "50"}, {"cmtime", "-s", "127.0.0.1", "-c", "50"}, true},
    {"ib_send_bw",
     {"ib_send_bw", "-R", "-d", "softverbs0", "-n", "500"},
     {"ib_send_bw", "-R", "-d", "softverbs0", "-n", "500", "127.0.0.1"}},
    {"ib_write_lat",
     {"ib_write_lat", "-R", "-d", "softverbs0", "-n", "500"},
     {"ib_write_lat", "-R", "-d", "softverbs0", "-n", "500", "127.0.0.1"}},
    {"ib_read_bw",
     {"ib_read_bw", "-R", "-d", "softverbs0", "-n", "500"},
     {"ib_read_bw", "-R", "-d", "softverbs0", "-n", "500", "127.0.0.1"}},
};

INSTANTIATE_TEST_SUITE_P(Tools, RdmacmTools, ::testing::ValuesIn(kPairs),
                         [](const ::testing::TestParamInfo<ToolPair>& info) { return info.param.name; });

// mckey on one host over shared memory (the default device on lo): two
// receivers, one with two QPs, get every datagram of a sender in the group.
// (udp_tools_test runs it as IP multicast.)
TEST(Mckey, EveryReceiverGetsEveryDatagram) {
  TemporaryDirectory dir;
  std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + dir.path() + "/rt"};
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "up"}, env).exit_code, 0);
  test::McKeyGroup r = test::run_mckey_group(SOFTVERBS_CLI, env, dir.path(), "239.7.7.7", "127.0.0.1", {1, 2}, 100);
  EXPECT_EQ(r.sender.exit_code, 0) << r.sender.err << r.sender.out;
  for (size_t i = 0; i < r.receivers.size(); ++i) {
    EXPECT_EQ(r.receivers[i].exit_code, 0) << r.receivers[i].err;
    EXPECT_NE(r.receiver_outputs[i].find("data transfers complete"), std::string::npos) << r.receiver_outputs[i];
  }
}

TEST(RdmacmShim, ExportsEverySymbolOfTheRealLibraryInItsVersionNode) {
  auto symbols = [](const std::string& library) {
    auto r = run_process({"sh", "-c", "objdump -T " + library + " | grep RDMACM | awk '{print $(NF-1), $NF}' | sort"});
    return r.out;
  };
  std::string ours = symbols(SHIM_LIBRARY);
  ASSERT_FALSE(ours.empty());
  EXPECT_EQ(ours, symbols("/usr/lib/x86_64-linux-gnu/librdmacm.so.1"));
  auto soname = run_process({"sh", "-c", std::string("readelf -d ") + SHIM_LIBRARY + " | grep SONAME"});
  EXPECT_NE(soname.out.find("[librdmacm.so.1]"), std::string::npos) << soname.out;
}

}  // namespace
}  // namespace softverbs
