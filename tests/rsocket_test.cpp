// rsockets: rdma-core's rsocket tools (rstream, rcopy, riostream),
// unmodified, between two processes under `softverbs run`, on a
// shared-memory device and on a UDP (RoCEv2) one; and an unmodified TCP
// program (Debian's nc) over rsockets through the preload
// (`softverbs run --rsockets`).
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "device_status.h"
#include "process_runner.h"

namespace softverbs {
namespace {

using test::PairResult;
using test::run_process;
using test::TemporaryDirectory;

std::vector<std::string> under_softverbs(std::vector<std::string> command, bool rsockets = false) {
  command.insert(command.begin(), {SOFTVERBS_CLI, "run"});
  if (rsockets) command.insert(command.begin() + 2, "--rsockets");
  command.insert(command.begin() + (rsockets ? 3 : 2), "--");
  return command;
}

bool have_program(const std::string& name) {
  return run_process({"sh", "-c", "command -v " + name + " >/dev/null"}).exit_code == 0;
}

// A device of the transport in a private runtime directory.
class Device {
 public:
  explicit Device(const std::string& transport) {
    runtime_ = dir_.path() + "/rt";
    env_ = {"SOFTVERBS_RUNTIME_DIR=" + runtime_};
    std::vector<std::string> up = {SOFTVERBS_CLI, "up"};
    if (transport == "udp") up.insert(up.end(), {"--transport", "udp"});
    up_ = run_process(up, env_).exit_code == 0;
  }
  bool up() const { return up_; }
  const std::vector<std::string>& env() const { return env_; }
  const std::string& path() const { return dir_.path(); }
  // The server's listener is in the CM directory.
  bool listening() const { return test::rdmacm_listening(runtime_); }

 private:
  TemporaryDirectory dir_;
  std::string runtime_;
  std::vector<std::string> env_;
  bool up_ = false;
};

std::string transport_of(const std::string& name) { return name.rfind("udp", 0) == 0 ? "udp" : "shm"; }

struct ToolPair {
  const char* name;
  std::vector<std::string> server;
  std::vector<std::string> client;
};

// ctest shows the case's name, not its bytes.
void PrintTo(const ToolPair& pair, std::ostream* out) { *out << pair.name; }

class RsocketTools : public ::testing::TestWithParam<ToolPair> {};

TEST_P(RsocketTools, ServerAndClientSucceed) {
  const ToolPair& pair = GetParam();
  Device device(transport_of(pair.name));
  ASSERT_TRUE(device.up());
  PairResult r = test::run_server_client(
      under_softverbs(pair.server), under_softverbs(pair.client), device.env(), [&] { return device.listening(); },
      240);  // -S all: about a minute over UDP on 2 busy cores
  EXPECT_EQ(r.client.exit_code, 0) << "client:\n"
                                   << r.client.err << r.client.out << "\nserver:\n"
                                   << r.server.err << r.server.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  EXPECT_EQ(r.client.err.find("failed"), std::string::npos) << r.client.err;
}

// rstream_async_poll: the server waits in rpoll (-T a), not the client:
// after the last transfer the server closes, and a client whose rpoll finds
// the last data and the DISCONNECT together gets POLLHUP and gives up, as
// with rdma-core's rsockets (rpoll reports both; rstream fails on POLLHUP).
// riostream_*: riowrite into the peer's riomap'd buffer, on which the
// receiver spins.
#define RSOCKET_PAIRS(prefix)                                                                                      \
  ToolPair{prefix "rstream", {"rstream"}, {"rstream", "-s", "127.0.0.1"}},                                         \
      ToolPair{prefix "rstream_all_sizes", {"rstream", "-S", "all"}, {"rstream", "-S", "all", "-s", "127.0.0.1"}}, \
      ToolPair{prefix "rstream_verify",                                                                            \
               {"rstream", "-T", "v", "-S", "1000000", "-C", "50"},                                                \
               {"rstream", "-T", "v", "-S", "1000000", "-C", "50", "-s", "127.0.0.1"}},                            \
      ToolPair{prefix "rstream_nonblocking",                                                                       \
               {"rstream", "-T", "n", "-S", "100000", "-C", "100"},                                                \
               {"rstream", "-T", "n", "-S", "100000", "-C", "100", "-s", "127.0.0.1"}},                            \
      ToolPair{prefix "rstream_small_queues",                                                                      \
               {"rstream", "-B", "4096", "-i", "0", "-S", "65536", "-C", "200"},                                   \
               {"rstream", "-B", "4096", "-i", "0", "-S", "65536", "-C", "200", "-s", "127.0.0.1"}},               \
      ToolPair{prefix "rstream_async_poll",                                                                        \
               {"rstream", "-T", "a", "-S", "100000", "-C", "100"},                                                \
               {"rstream", "-S", "100000", "-C", "100", "-s", "127.0.0.1"}},                                       \
      ToolPair{prefix "riostream_stream",                                                                          \
               {"riostream", "-T", "v", "-S", "65536", "-C", "100"},                                               \
               {"riostream", "-T", "v", "-S", "65536", "-C", "100", "-s", "127.0.0.1"}},                           \
      ToolPair {                                                                                                   \
    prefix "riostream_pingpong", {"riostream", "-S", "64", "-I", "200", "-C", "1"}, {                              \
      "riostream", "-S", "64", "-I", "200", "-C", "1", "-s", "127.0.0.1"                                           \
    }                                                                                                              \
  }

const ToolPair kPairs[] = {
    RSOCKET_PAIRS("shm_"),
    // riostream's default runs: 111,100 ping-pongs and 111,100 streamed
    // transfers, each side spinning on its memory (minutes on two loaded
    // CPUs over UDP, where each transfer also needs the receiver's io thread).
    ToolPair{"shm_riostream", {"riostream"}, {"riostream", "-s", "127.0.0.1"}},
    ToolPair{"shm_riostream_all_sizes", {"riostream", "-S", "all"}, {"riostream", "-S", "all", "-s", "127.0.0.1"}},
    RSOCKET_PAIRS("udp_"),
    // rstream's own TCP mode, as the baseline the bench compares with.
    ToolPair{"tcp_rstream_sockets", {"rstream", "-T", "s"}, {"rstream", "-T", "s", "-s", "127.0.0.1"}},
};

INSTANTIATE_TEST_SUITE_P(Tools, RsocketTools, ::testing::ValuesIn(kPairs),
                         [](const ::testing::TestParamInfo<ToolPair>& info) { return info.param.name; });

void write_random_file(const std::string& path, size_t size, unsigned seed) {
  std::mt19937_64 random(seed);
  std::vector<uint64_t> block(1 << 17);
  std::ofstream out(path, std::ios::binary);
  for (size_t written = 0; written < size;) {
    for (auto& word : block) word = random();
    size_t n = std::min(size - written, block.size() * sizeof(uint64_t));
    out.write(reinterpret_cast<const char*>(block.data()), static_cast<std::streamsize>(n));
    written += n;
  }
}

class Rcopy : public ::testing::TestWithParam<std::string> {};

// rcopy of a 100 MB file, compared byte for byte.
TEST_P(Rcopy, CopiesA100MBFileExactly) {
  Device device(GetParam());
  ASSERT_TRUE(device.up());
  const std::string source = device.path() + "/source";
  const std::string target = device.path() + "/target";
  write_random_file(source, 100 << 20, 7);
  // rcopy's server writes the file under the name the client gives, and
  // serves until killed.
  PairResult r = test::run_server_client(
      under_softverbs({"timeout", "40", "rcopy"}), under_softverbs({"rcopy", source, "127.0.0.1:" + target}),
      device.env(), [&] { return device.listening(); }, 180);
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  auto cmp = run_process({"cmp", source, target});
  EXPECT_EQ(cmp.exit_code, 0) << cmp.err << cmp.out;
}

INSTANTIATE_TEST_SUITE_P(Transports, Rcopy, ::testing::Values("shm", "udp"));

class Preload : public ::testing::TestWithParam<std::string> {};

// Debian's nc, unmodified, over rsockets: 4 MiB from client to server,
// compared byte for byte.
TEST_P(Preload, NetcatMovesAFileOverRsockets) {
  if (!have_program("nc")) GTEST_SKIP() << "nc (netcat-openbsd) is not installed; scripts/install-deps installs it";
  Device device(GetParam());
  ASSERT_TRUE(device.up());
  const std::string source = device.path() + "/source";
  const std::string target = device.path() + "/target";
  write_random_file(source, 4 << 20, 11);
  PairResult r = test::run_server_client(
      under_softverbs({"sh", "-c", "exec nc -l 127.0.0.1 7471 > " + target}, true),
      under_softverbs({"sh", "-c", "exec nc -N 127.0.0.1 7471 < " + source}, true), device.env(),
      [&] { return device.listening(); }, 120);
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  auto cmp = run_process({"cmp", source, target});
  EXPECT_EQ(cmp.exit_code, 0) << cmp.err << cmp.out;
}

// Debian's iperf3, unmodified, both ends over rsockets: 50 MiB, and both
// ends count every byte (iperf3 checks counts, not contents; nc above
// checks contents).
TEST_P(Preload, Iperf3CountsEveryByteOverRsockets) {
  if (!have_program("iperf3")) GTEST_SKIP() << "iperf3 is not installed; scripts/install-deps installs it";
  Device device(GetParam());
  ASSERT_TRUE(device.up());
  constexpr long kBytes = 50L << 20;
  PairResult r = test::run_server_client(
      under_softverbs({"iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", "7472"}, true),
      under_softverbs({"iperf3", "-c", "127.0.0.1", "-p", "7472", "-n", std::to_string(kBytes), "--json"}, true),
      device.env(), [&] { return device.listening(); }, 60);
  ASSERT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  auto bytes_of = [&](const std::string& section) -> long {
    std::smatch m;
    std::regex pattern("\"" + section + "\":\\s*\\{[^}]*?\"bytes\":\\s*(\\d+)");
    return std::regex_search(r.client.out, m, pattern) ? std::stol(m[1]) : -1;
  };
  // iperf3 -n checks the count only between the rounds of writes it makes
  // per select() (up to 10 of a 128 KiB block): once the count is reached,
  // each later round of that call still writes a block while the socket
  // takes one, so it may end up to 9 blocks past it (1 seen on shm).
  constexpr long kBlock = 128L << 10;
  EXPECT_GE(bytes_of("sum_sent"), kBytes) << r.client.out;
  EXPECT_LE(bytes_of("sum_sent"), kBytes + 9 * kBlock) << r.client.out;
  // iperf3's receiver stops counting at the client's TEST_END, which can
  // overtake the last data still in the receive buffer (over TCP too): what
  // it counts is all but at most one buffer (rsockets' default: 128 KiB).
  EXPECT_LE(bytes_of("sum_received"), bytes_of("sum_sent")) << r.client.out;
  EXPECT_GE(bytes_of("sum_received"), bytes_of("sum_sent") - kBlock) << r.client.out;
}

INSTANTIATE_TEST_SUITE_P(Transports, Preload, ::testing::Values("shm", "udp"));

}  // namespace
}  // namespace softverbs
