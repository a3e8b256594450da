// Unmodified rdma-core tools and perftest over the UDP transport, on one
// host: a device brought up with `--transport udp` sends every packet as
// RoCEv2 to 127.0.0.1:4791, even between two processes of the same host.
// Also: fault injection survived and counted, and captures that tshark
// decodes and whose ICRCs scapy recomputes. These tests share lo's port
// 4791, so ctest runs them one at a time (RESOURCE_LOCK roce_port_lo).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "device_status.h"
#include "mckey_group.h"
#include "process_runner.h"

namespace softverbs {
namespace {

namespace fs = std::filesystem;
using test::ipv4_mapped_gid;
using test::parse_counters;
using test::ProcessResult;
using test::roce_v2_gid_index;
using test::run_process;
using test::TemporaryDirectory;

// A port for perftest's exchange (below).
std::string port_for(const std::string& name);

class UdpOnLoopback : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt"};
    auto up = run_process({SOFTVERBS_CLI, "up", "--transport", "udp"}, env_);
    ASSERT_EQ(up.exit_code, 0) << up.err;
  }

  std::vector<std::string> under_softverbs(std::vector<std::string> command) const {
    command.insert(command.begin(), {SOFTVERBS_CLI, "run", "--"});
    return command;
  }

  // The index of the RoCE v2 GID of 127.0.0.1, as `softverbs status` lists it.
  std::string ipv4_gid_index() const {
    return roce_v2_gid_index(run_process({SOFTVERBS_CLI, "status"}, env_).out, ipv4_mapped_gid("127.0.0.1"));
  }

  // Starts `server`, calls `while_server_waits`, then runs `client` until
  // it connects (the server listens on TCP for the exchange of QP numbers),
  // and waits for both.
  struct Pair {
    ProcessResult server, client;
  };
  Pair run_pair(const std::vector<std::string>& server, const std::vector<std::string>& client,
                std::vector<std::string> extra_env = {}, const std::function<void()>& while_server_waits = {}) {
    std::vector<std::string> env = env_;
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    auto background = std::async(std::launch::async, [&] { return run_process(under_softverbs(server), env, 120); });
    if (while_server_waits) while_server_waits();
    Pair result;
    for (int attempt = 0; attempt < 100; ++attempt) {
      result.client = run_process(under_softverbs(client), env, 120);
      bool refused = result.client.err.find("Couldn't connect") != std::string::npos ||
                     result.client.err.find("Unable to open file descriptor") != std::string::npos ||
                     result.client.err.find("Failed to create QP") != std::string::npos ||
                     result.client.err.find("Couldn't connect") != std::string::npos;
      if (!refused || result.client.exit_code == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    result.server = background.get();
    return result;
  }

  // ib_write_bw -s SIZE -n ITERATIONS between two processes over the
  // RoCE v2 GID of 127.0.0.1, with `extra_env` in both.
  Pair ib_write_bw(const std::string& name, const std::string& size, const std::string& iterations,
                   std::vector<std::string> extra_env) {
    std::vector<std::string> server = {"ib_write_bw",  "-d", "softverbs0", "-x", ipv4_gid_index(), "-p",
                                       port_for(name), "-s", size,         "-n", iterations};
    std::vector<std::string> client = server;
    client.push_back("127.0.0.1");
    return run_pair(server, client, std::move(extra_env));
  }

  std::map<std::string, uint64_t> counters() const {
    auto r = run_process({SOFTVERBS_CLI, "stat", "softverbs0"}, env_);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return parse_counters(r.out);
  }

  TemporaryDirectory dir_;
  std::vector<std::string> env_;
};

std::string port_for(const std::string& name) {
  // Not the same port in every run: perftest's server cannot listen on a
  // port that the previous run's connection holds in TIME-WAIT for a minute.
  // Below 32768, where the kernel's ephemeral ports start (the shim's TCP
  // connections of tests running beside this one take those).
  return std::to_string(20000 + static_cast<int>((std::hash<std::string>{}(name) + 7919u * getpid()) % 12000));
}

struct PingpongCase {
  const char* name;
  const char* tool;
  std::vector<std::string> args;
  const char* finished = "iters in";  // what the client prints at the end
};

class UdpPingpong : public UdpOnLoopback, public ::testing::WithParamInterface<PingpongCase> {};

TEST_P(UdpPingpong, RunsOverRoceV2) {
  const PingpongCase& c = GetParam();
  std::string gid = ipv4_gid_index();
  ASSERT_FALSE(gid.empty());
  std::vector<std::string> command = {c.tool, "-d", "softverbs0", "-g", gid, "-p", port_for(c.name)};
  command.insert(command.end(), c.args.begin(), c.args.end());
  std::vector<std::string> client = command;
  client.push_back("127.0.0.1");
  Pair r = run_pair(command, client);
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  EXPECT_NE(r.client.out.find(c.finished), std::string::npos) << r.client.out;
  for (const auto* end : {&r.client, &r.server})
    EXPECT_EQ(end->err.find("Couldn't prefetch"), std::string::npos) << end->err;  // -P goes on without it
  // With -t each receive carries the device clock: consecutive ones are
  // apart by a round trip, never by nothing.
  if (std::find(c.args.begin(), c.args.end(), "-t") != c.args.end()) {
    for (const ProcessResult* side : {&r.client, &r.server}) {
      EXPECT_GT(test::number_after(side->out, "Min receive completion clock cycles = "), 0u) << side->out;
    }
  }
  auto count = counters();
  EXPECT_GT(count["rx_packets"], 0u) << "the traffic went over UDP";
  EXPECT_EQ(count["icrc_errors"], 0u);
  EXPECT_EQ(count["malformed_packets"], 0u);
}

const PingpongCase kPingpongs[] = {
    {"rc", "ibv_rc_pingpong", {"-n", "500"}},
    {"rc_1MiB_validated", "ibv_rc_pingpong", {"-s", "1048576", "-c", "-n", "20"}},
    {"rc_mtu_256_validated", "ibv_rc_pingpong", {"-m", "256", "-s", "10000", "-c", "-n", "50"}},
    {"rc_events_validated", "ibv_rc_pingpong", {"-e", "-s", "65536", "-c", "-n", "50"}},
    {"rc_new_send_api", "ibv_rc_pingpong", {"-N", "-c", "-n", "200"}},
    {"rc_timestamps_validated", "ibv_rc_pingpong", {"-t", "-c", "-n", "200"}},
    {"uc_validated", "ibv_uc_pingpong", {"-s", "8192", "-c", "-n", "200"}},
    {"ud_validated", "ibv_ud_pingpong", {"-s", "2048", "-c", "-n", "200"}},
    {"ud_events", "ibv_ud_pingpong", {"-e", "-n", "200"}},
    {"srq_validated", "ibv_srq_pingpong", {"-s", "4096", "-c", "-n", "200"}},
    {"xsrq", "ibv_xsrq_pingpong", {"-n", "200"}, "success"},
    {"xsrq_events", "ibv_xsrq_pingpong", {"-e", "-s", "8192", "-n", "200"}, "success"},
    {"rc_odp_validated", "ibv_rc_pingpong", {"-o", "-c", "-n", "200"}},
    {"rc_implicit_odp_validated", "ibv_rc_pingpong", {"-O", "-c", "-n", "200"}},
    {"rc_odp_prefetch_validated", "ibv_rc_pingpong", {"-o", "-P", "-c", "-n", "200"}},
    {"rc_device_memory_validated", "ibv_rc_pingpong", {"-j", "-c", "-n", "200"}},
};

INSTANTIATE_TEST_SUITE_P(Tools, UdpPingpong, ::testing::ValuesIn(kPingpongs),
                         [](const ::testing::TestParamInfo<PingpongCase>& info) { return info.param.name; });

struct PerftestCase {
  const char* name;
  std::vector<std::string> args;
  uint64_t least_rx_packets = 0;  // the data packets the run must deliver
};

class UdpPerftest : public UdpOnLoopback, public ::testing::WithParamInterface<PerftestCase> {};

TEST_P(UdpPerftest, ClientAndServerFinish) {
  std::string gid = ipv4_gid_index();
  ASSERT_FALSE(gid.empty());
  std::vector<std::string> command = GetParam().args;
  command.insert(command.end(), {"-d", "softverbs0", "-x", gid, "-p", port_for(GetParam().name)});
  std::vector<std::string> client = command;
  client.push_back("127.0.0.1");
  Pair r = run_pair(command, client);
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  // Both ends are processes of this device: every packet received was sent
  // (ACKs and retransmissions included), and the data packets all arrived.
  auto count = counters();
  EXPECT_GT(count["rx_packets"], 0u);
  EXPECT_GE(count["rx_packets"], GetParam().least_rx_packets);
  EXPECT_LE(count["rx_packets"], count["tx_packets"]);
  EXPECT_LE(count["rx_bytes"], count["tx_bytes"]);
}

const PerftestCase kPerftests[] = {
    {"ib_write_bw", {"ib_write_bw", "-n", "2000", "-s", "65536"}, 2000 * 16},  // 16 packets at MTU 4096
    {"ib_read_bw", {"ib_read_bw", "-n", "1000", "-s", "65536"}},
    {"ib_send_bw", {"ib_send_bw", "-n", "2000"}},
    {"ib_send_bw_odp", {"ib_send_bw", "--odp", "-n", "2000"}},
    {"ib_atomic_bw", {"ib_atomic_bw", "-n", "2000"}},
    {"ib_write_lat", {"ib_write_lat", "-n", "1000"}},
    {"ib_read_lat", {"ib_read_lat", "-n", "1000", "-s", "8192"}},
    {"ib_send_lat", {"ib_send_lat", "-n", "1000"}},
    {"ib_atomic_lat", {"ib_atomic_lat", "-n", "1000"}},
    {"ib_send_bw_xrc", {"ib_send_bw", "-c", "XRC", "-n", "2000"}},
    {"ib_atomic_bw_xrc", {"ib_atomic_bw", "-c", "XRC", "-n", "2000"}},
    {"ib_write_bw_xrc_bidirectional", {"ib_write_bw", "-c", "XRC", "-b", "-n", "1000"}},
    {"ib_send_bw_ud_events_4qps", {"ib_send_bw", "-c", "UD", "-e", "-q", "4", "-n", "500"}},
    {"ib_write_bw_uc_bidirectional", {"ib_write_bw", "-c", "UC", "-b", "-n", "1000"}},
    {"ib_send_bw_srq_4qps", {"ib_send_bw", "--use-srq", "-q", "4", "-n", "500"}},
    {"ib_write_bw_mr_per_qp", {"ib_write_bw", "--mr_per_qp", "-q", "4", "-Q", "8", "-n", "500"}},
};

INSTANTIATE_TEST_SUITE_P(Tools, UdpPerftest, ::testing::ValuesIn(kPerftests),
                         [](const ::testing::TestParamInfo<PerftestCase>& info) { return info.param.name; });

// ibv_xsrq_pingpong's server with two clients: every process opens the
// XRC domain of /tmp/xrc_domain's inode, and the server sends round robin,
// through the QP connected to one client into the SRQ of the other. Over UDP
// the XRC_RECV QP's process places the SEND into the other process's
// receive buffer (process_vm_writev, or the copy agent).
TEST_F(UdpOnLoopback, XsrqPingpongServesTwoClientsThroughEachOthersSrqs) {
  const std::string gid = ipv4_gid_index();
  ASSERT_FALSE(gid.empty());
  for (const std::string method : {"auto", "agent"}) {
    std::vector<std::string> env = env_;
    env.push_back("SOFTVERBS_COPY=" + method);
    const std::string port = port_for("xsrq_two_clients_" + method);
    const std::vector<std::string> common = {
        "ibv_xsrq_pingpong", "-d", "softverbs0", "-g", gid, "-p", port, "-n", "50"};
    std::vector<std::string> server = common;
    server.insert(server.end(), {"-c", "2"});
    std::vector<std::string> client = common;
    client.push_back("127.0.0.1");
    auto served = std::async(std::launch::async, [&] { return run_process(under_softverbs(server), env, 60); });
    auto run_client = [&] {
      ProcessResult r;
      for (int attempt = 0; attempt < 100; ++attempt) {
        r = run_process(under_softverbs(client), env, 60);
        if (r.err.find("Couldn't connect") == std::string::npos) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      return r;
    };
    auto first = std::async(std::launch::async, run_client);
    auto second = std::async(std::launch::async, run_client);
    for (const ProcessResult& r : {first.get(), second.get(), served.get()}) {
      EXPECT_EQ(r.exit_code, 0) << method << ": " << r.err << r.out;
      EXPECT_NE(r.out.find("success"), std::string::npos) << method << ": " << r.out;
    }
  }
}

TEST_F(UdpOnLoopback, RcAndUdOverIpv6Gids) {
  // ::1's RoCE v2 GID: the packets travel as IPv6/UDP, the ICRC over the
  // masked IPv6 header. Both ends name that GID index, so the address each
  // end learns of its peer is ::1.
  auto status = run_process({SOFTVERBS_CLI, "status"}, env_);
  const std::string gid = roce_v2_gid_index(status.out, "0000:0000:0000:0000:0000:0000:0000:0001");
  ASSERT_FALSE(gid.empty()) << status.out;
  for (const char* tool : {"ibv_rc_pingpong", "ibv_ud_pingpong"}) {
    std::vector<std::string> command = {
        tool, "-d", "softverbs0", "-g", gid, "-p", port_for(std::string("v6") + tool), "-s", "1024", "-c", "-n", "100"};
    std::vector<std::string> client = command;
    client.push_back("127.0.0.1");  // the tools' TCP exchange of QP numbers listens on IPv4
    Pair r = run_pair(command, client);
    EXPECT_EQ(r.client.exit_code, 0) << tool << ": " << r.client.err << r.client.out;
    EXPECT_EQ(r.server.exit_code, 0) << tool << ": " << r.server.err << r.server.out;
    EXPECT_NE(r.client.out.find("GID ::1"), std::string::npos) << r.client.out;
  }
  auto count = counters();
  EXPECT_GT(count["rx_packets"], 400u);
  EXPECT_EQ(count["icrc_errors"], 0u);
}

TEST_F(UdpOnLoopback, ALinkLocalGidThatLoLacksFailsAtOnceNamingTheGidsToUse) {
  // GID index 0 is the link-local GID of lo's MAC, as in rxe's table, but lo
  // has no link-local address: packets from it went nowhere and the tool
  // failed only after its retries ran out (a UD send at once, unexplained).
  // Now the QP's move to RTR, or the making of the address handle, fails,
  // and says which GIDs lo can carry.
  auto status = run_process({SOFTVERBS_CLI, "status"}, env_);
  ASSERT_NE(status.out.find("GID[0] fe80:"), std::string::npos) << status.out;
  const std::string usable = ipv4_gid_index();
  ASSERT_FALSE(usable.empty());
  std::vector<std::string> command = {"ibv_rc_pingpong", "-d", "softverbs0", "-g", "0", "-p",
                                      port_for("lacks"), "-n", "5"};
  std::vector<std::string> client = command;
  client.push_back("127.0.0.1");
  Pair r = run_pair(command, client);
  EXPECT_NE(r.server.exit_code, 0);
  EXPECT_NE(r.client.exit_code, 0);
  const std::string said = r.server.err + r.client.err;
  EXPECT_NE(said.find("source GID index 0 (fe80::200:ff:fe00:0) is not an address of lo"), std::string::npos) << said;
  EXPECT_NE(said.find("index " + usable + " (127.0.0.1)"), std::string::npos) << said;
  EXPECT_NE(said.find("Failed to modify QP to RTR"), std::string::npos) << said;
  // A UD address handle from that GID fails the same way, when it is made.
  command[0] = client[0] = "ibv_ud_pingpong";
  command[6] = client[6] = port_for("lacks ud");
  r = run_pair(command, client);
  EXPECT_NE(r.server.exit_code, 0);
  EXPECT_NE(r.client.exit_code, 0);
  const std::string said_ud = r.server.err + r.client.err;
  EXPECT_NE(said_ud.find("address handle: source GID index 0 (fe80::200:ff:fe00:0) is not an address of lo"),
            std::string::npos)
      << said_ud;
  EXPECT_NE(said_ud.find("Failed to create AH"), std::string::npos) << said_ud;
  EXPECT_EQ(counters()["tx_packets"], 0u) << "nothing was sent from an address lo lacks";
}

TEST_F(UdpOnLoopback, RpingThroughTheRdmacmShim) {
  auto runtime = dir_.path() + "/rt";
  auto background = std::async(std::launch::async, [&] {
    return run_process(under_softverbs({"rping", "-s", "-v", "-C", "200", "-S", "4000", "-a", "127.0.0.1"}), env_, 60);
  });
  auto listening = [&] { return test::rdmacm_listening(runtime); };
  for (int i = 0; i < 200 && !listening(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto client = run_process(under_softverbs({"rping", "-c", "-v", "-C", "200", "-S", "4000", "-a", "127.0.0.1"}), env_);
  auto server = background.get();
  EXPECT_EQ(client.exit_code, 0) << client.err << client.out;
  EXPECT_EQ(server.exit_code, 0) << server.err << server.out;
  EXPECT_NE(client.out.find("ping data: rdma-ping-199"), std::string::npos);
  EXPECT_GT(counters()["rx_packets"], 800u) << "rping's SENDs, READs and WRITEs as packets";
}

// XRC through the rdmacm shim over the wire: the REQ's transport type
// (extended, XRC) makes the server's id an XRC_RECV one, whose SEND from the
// client's XRC_SEND QP lands in the XRC SRQ the REP named.
TEST_F(UdpOnLoopback, RdmaXserverAndXclientConnectXrc) {
  auto runtime = dir_.path() + "/rt";
  auto background = std::async(std::launch::async, [&] {
    return run_process(under_softverbs({"rdma_xserver", "-c", "x"}), env_, 60);
  });
  auto listening = [&] { return test::rdmacm_listening(runtime); };
  for (int i = 0; i < 200 && !listening(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto client = run_process(under_softverbs({"rdma_xclient", "-s", "127.0.0.1", "-c", "x"}), env_, 60);
  auto server = background.get();
  EXPECT_EQ(client.exit_code, 0) << client.err << client.out;
  EXPECT_EQ(server.exit_code, 0) << server.err << server.out;
  EXPECT_NE(server.out.find("rdma_xserver: end 0"), std::string::npos) << server.out;
  // REQ, REP, RTU, the SEND and its ACK, DREQ and DREP at least.
  EXPECT_GE(counters()["rx_packets"], 7u);
}

// Adversarial mode RNR-NAKs the first SEND to each QP; with every packet
// sent twice, the duplicate of that SEND is then taken and ACKed. Each
// side's requester gets the RNR NAK, then the ACK: the requests behind
// the SEND must go at once. (They used to wait out the RNR timer, 655 ms
// for rping's QPs, past a retry budget of 7 x 67 ms: IBV_WC_RETRY_EXC_ERR
// on both sides at the first WRITE, in every run.)
TEST_F(UdpOnLoopback, RpingSurvivesAnRnrNakFollowedByTheAckOfADuplicate) {
  auto runtime = dir_.path() + "/rt";
  std::vector<std::string> env = env_;
  env.push_back("SOFTVERBS_FAULTS=duplicate=1");
  auto rping = [](const char* role) {
    return std::vector<std::string>{SOFTVERBS_CLI, "run", "--adversarial=1", "--", "rping", role, "-v", "-C",
                                    "5",           "-a",  "127.0.0.1"};
  };
  auto background = std::async(std::launch::async, [&] { return run_process(rping("-s"), env, 60); });
  auto listening = [&] { return test::rdmacm_listening(runtime); };
  for (int i = 0; i < 200 && !listening(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto client = run_process(rping("-c"), env, 60);
  auto server = background.get();
  EXPECT_EQ(client.exit_code, 0) << client.err << client.out;
  EXPECT_EQ(server.exit_code, 0) << server.err << server.out;
  EXPECT_NE(client.out.find("ping data: rdma-ping-4"), std::string::npos) << client.out;
  auto count = counters();
  EXPECT_GE(count["rnr_naks_received"], 2u) << "each side's first SEND was turned back once";
  EXPECT_GT(count["faults_duplicated"], 0u);
}

// A UD datagram that finds no receive posted is counted where it is dropped.
TEST_F(UdpOnLoopback, UdDatagramsWithNoReceivePostedAreCounted) {
  auto r =
      run_process(under_softverbs({VERBS_DATAPATH_TEST,
                                   "--gtest_filter=DataPath.AUdDatagramThatFindsNoReceiveIsDroppedAndTheNextIsTaken"}),
                  env_, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(counters()["ud_no_receive_dropped"], 1u);
}

// Every flow's source port (RoCE's 0xC000-0xFFFF, which overlaps Linux's
// ephemeral ports) held by another socket of 127.0.0.1, as any program's
// UDP sockets may hold one: the packets leave from port 4791 instead, their
// ICRC computed over that port. (Computed over the flow's port, every one
// was dropped as damaged and the pingpongs failed with retries exceeded.)
TEST_F(UdpOnLoopback, FlowsWhosePortsAnotherProgramHoldsLeaveFromPort4791) {
  constexpr int kFirstFlowPort = 0xc000, kPorts = 0x4000;
  rlimit files{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  const rlim_t saved = files.rlim_cur;
  // A hard limit below what holding the ports takes is raised where we may (root).
  files.rlim_cur = kPorts + 1024;
  files.rlim_max = std::max(files.rlim_max, files.rlim_cur);
  if (setrlimit(RLIMIT_NOFILE, &files) != 0)
    GTEST_SKIP() << "cannot hold " << kPorts << " sockets: RLIMIT_NOFILE's hard limit is below it";
  struct HeldPorts {
    std::vector<int> fds;
    ~HeldPorts() {
      for (int fd : fds) ::close(fd);
    }
  } held;
  for (int port = kFirstFlowPort; port < kFirstFlowPort + kPorts; ++port) {
    const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0) << strerror(errno);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    // A port some other socket of this machine holds stays held.
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0)
      held.fds.push_back(fd);
    else
      ::close(fd);
  }
  EXPECT_GT(held.fds.size(), static_cast<size_t>(kPorts) * 9 / 10);
  const std::string gid = ipv4_gid_index();
  for (const char* tool : {"ibv_rc_pingpong", "ibv_ud_pingpong"}) {
    std::vector<std::string> server = {tool, "-d", "softverbs0", "-g", gid, "-p", port_for(tool), "-c", "-n", "200"};
    std::vector<std::string> client = server;
    client.push_back("127.0.0.1");
    Pair r = run_pair(server, client);
    EXPECT_EQ(r.client.exit_code, 0) << tool << ": " << r.client.err << r.client.out;
    EXPECT_EQ(r.server.exit_code, 0) << tool << ": " << r.server.err << r.server.out;
  }
  for (int fd : held.fds) ::close(fd);
  held.fds.clear();
  files.rlim_cur = saved;
  setrlimit(RLIMIT_NOFILE, &files);
  auto count = counters();
  EXPECT_GE(count["rx_packets"], 800u);
  EXPECT_EQ(count["icrc_errors"], 0u);
  EXPECT_EQ(count["retransmissions"], 0u);
}

// cmtime connects 500 ids at once. No CM MAD is lost (five per connection:
// REQ, REP, RTU, DREQ, DREP; a lost one is sent again after a second): the
// CM agents take that many at once, as the kernel's MAD layer does (512
// receives), and a QP's flow socket, which takes any packet to the port
// between its bind() and its connect(), reads those with their real source
// (they were dropped for a bad ICRC, computed over the wrong source port).
// A MAD whose answer a loaded machine delays past the CM's 1.07 s timeout
// is sent again, as the kernel's CM would: that is not a loss.
TEST_F(UdpOnLoopback, CmtimeConnectsFiveHundredIdsAtOnceAndNoMadIsLost) {
  constexpr int kIds = 500;
  const std::string ids = std::to_string(kIds);
  const auto commands =
      test::server_stopped_by_client("cmtime -c " + ids, "cmtime -s 127.0.0.1 -c " + ids, dir_.path() + "/cmtime.pid");
  const auto runtime = dir_.path() + "/rt";
  auto pair = test::run_server_client(
      under_softverbs(commands.server), under_softverbs(commands.client), env_,
      [&] { return test::rdmacm_listening(runtime); }, 120);
  ASSERT_EQ(pair.client.exit_code, 0) << pair.client.err << pair.client.out << pair.server.err << pair.server.out;
  EXPECT_NE(pair.client.out.find("connect"), std::string::npos) << pair.client.out;
  auto count = counters();
  EXPECT_EQ(count["icrc_errors"], 0u);
  EXPECT_EQ(count["ud_no_receive_dropped"], 0u) << "a burst overran a CM agent's receives";
  EXPECT_GE(count["tx_packets"], 5u * kIds);
  EXPECT_EQ(count["rx_packets"], count["tx_packets"]) << "every MAD sent arrived";
}

// mckey's group as IP multicast on lo: each receiving process joins the
// group and takes its datagrams from its own socket, so the device counts
// at least one packet per datagram and receiving process.
TEST_F(UdpOnLoopback, MckeyGroupIsIpMulticast) {
  test::McKeyGroup r = test::run_mckey_group(SOFTVERBS_CLI, env_, dir_.path(), "239.7.7.7", "127.0.0.1", {1, 2}, 100);
  EXPECT_EQ(r.sender.exit_code, 0) << r.sender.err << r.sender.out;
  for (size_t i = 0; i < r.receivers.size(); ++i) {
    EXPECT_EQ(r.receivers[i].exit_code, 0) << r.receivers[i].err;
    EXPECT_NE(r.receiver_outputs[i].find("joined dgid: ::ffff:239.7.7.7"), std::string::npos)
        << "RoCE v2's group GID: " << r.receiver_outputs[i];
    EXPECT_NE(r.receiver_outputs[i].find("data transfers complete"), std::string::npos) << r.receiver_outputs[i];
  }
  EXPECT_GE(counters()["rx_packets"], 200u);
  EXPECT_EQ(counters()["icrc_errors"], 0u);
}

// perftest's bandwidth tools keep both ends up until both are done (they
// meet over TCP at the end), so a lost last ACK is retransmitted, as the
// protocol intends. (ibv_rc_pingpong's server may exit while its final ACK
// is being lost; the client then rightly fails with RETRY_EXC_ERR.)
TEST_F(UdpOnLoopback, LossDuplicationReorderingAndCorruptionAreSurvivedAndCounted) {
  auto set = run_process(
      {SOFTVERBS_CLI, "faults", "softverbs0", "loss=0.05,duplicate=0.03,reorder=0.03,corrupt=0.02,seed=11"}, env_);
  ASSERT_EQ(set.exit_code, 0) << set.err;
  EXPECT_NE(run_process({SOFTVERBS_CLI, "status"}, env_).out.find("fault injection: loss=0.05"), std::string::npos);
  std::string gid = ipv4_gid_index();
  std::vector<std::string> command = {"ib_send_bw",       "-d", "softverbs0", "-x", gid,  "-p",
                                      port_for("faults"), "-s", "65536",      "-n", "500"};
  std::vector<std::string> client = command;
  client.push_back("127.0.0.1");
  Pair r = run_pair(command, client);
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  auto count = counters();
  EXPECT_GT(count["faults_dropped"], 0u);
  EXPECT_GT(count["faults_duplicated"], 0u);
  EXPECT_GT(count["faults_reordered"], 0u);
  EXPECT_GT(count["faults_corrupted"], 0u);
  EXPECT_GT(count["retransmissions"], 0u) << "losses were repaired";
  EXPECT_GT(count["icrc_errors"], 0u) << "corrupted packets were caught by the ICRC";
  EXPECT_GT(count["duplicates_received"], 0u);
  EXPECT_GT(count["seq_naks_sent"], 0u) << "gaps were NAKed";
  // The counters reset.
  ASSERT_EQ(run_process({SOFTVERBS_CLI, "stat", "--reset"}, env_).exit_code, 0);
  EXPECT_EQ(counters()["rx_packets"], 0u);
}

// 64 RC QPs of one process share its bytes in flight (kInFlightBytes). With
// a full window each they put 64 MiB in flight, which on a loaded machine
// waited in the peer's socket queues past the ACK timeout: nothing was lost,
// but go-back-N resent a fifth to a half of the packets, and one run in two
// failed with IBV_WC_RETRY_EXC_ERR. Three runs, each must finish.
TEST_F(UdpOnLoopback, SixtyFourQpsShareTheBytesInFlightAndOutliveTheirTimers) {
  std::string gid = ipv4_gid_index();
  ASSERT_FALSE(gid.empty());
  for (int run = 0; run < 3; ++run) {
    std::vector<std::string> command = {
        "ib_write_bw", "-d", "softverbs0", "-x",    gid,  "-p", port_for("qps64_" + std::to_string(run)),
        "-q",          "64", "-s",         "65536", "-n", "300"};
    std::vector<std::string> client = command;
    client.push_back("127.0.0.1");
    Pair r = run_pair(command, client);
    ASSERT_EQ(r.client.exit_code, 0) << "run " << run << ":\n" << r.client.err << r.client.out;
    ASSERT_EQ(r.server.exit_code, 0) << "run " << run << ":\n" << r.server.err << r.server.out;
  }
  auto count = counters();
  EXPECT_GE(count["rx_packets"], 3u * 64 * 300 * 16);  // 16 packets per WRITE at MTU 4096
  EXPECT_LT(count["retransmissions"] * 20, count["tx_packets"]) << "timers fired on packets that were not lost";
}

TEST_F(UdpOnLoopback, EnvironmentFaultsOverrideTheDevicesForOneProgram) {
  Pair r = ib_write_bw("envfaults", "16384", "500", {"SOFTVERBS_FAULTS=loss=0.1,seed=5"});
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  EXPECT_GT(counters()["faults_dropped"], 0u);
  auto bad = run_process(under_softverbs({"ibv_devinfo"}), {env_[0], "SOFTVERBS_FAULTS=loss=2"});
  EXPECT_EQ(bad.exit_code, 0) << "a bad setting does not stop programs that never send over UDP";
}

// A WRITE of 10,000 bytes at path MTU 4096, as tshark decodes the capture:
// by default three WRITE ONLY packets whose RETHs name consecutive parts of
// the range (4096, 4096 and 1808 bytes); with SOFTVERBS_UDP_WRITES=messages
// FIRST, MIDDLE and LAST, the FIRST's RETH naming all 10,000 bytes.
TEST_F(UdpOnLoopback, CaptureShowsMultiPacketWritesInTheFramingAsked) {
  constexpr int kWriteFirst = 6, kWriteMiddle = 7, kWriteLast = 8, kWriteOnly = 10;
  std::string gid = ipv4_gid_index();
  ASSERT_FALSE(gid.empty());
  std::string cli = SOFTVERBS_CLI;
  for (std::string framing : {"packets", "messages"}) {
    SCOPED_TRACE(framing);
    std::string capture = dir_.path() + "/" + framing + ".pcap";
    const std::string tool = "SOFTVERBS_UDP_WRITES=" + framing + " " + cli + " run -- ib_write_bw -d softverbs0 -x " +
                             gid + " -p " + port_for("framing_" + framing) + " -s 10000 -n 20";
    std::string script = cli + " capture -w " + capture + " & capture=$!\n" + "while [ ! -s " + capture +
                         " ]; do sleep 0.05; done; sleep 0.2\n" + tool + " > server.txt 2>&1 & server=$!; sleep 0.5\n" +
                         "for try in $(seq 1 50); do " + tool +
                         " 127.0.0.1 > client.txt 2>&1 && break; grep -q \"Couldn't connect\" client.txt || break; "
                         "sleep 0.2; done; status=$?\n" +
                         "wait $server || status=1\n" + "kill -INT $capture; wait $capture; exit $status\n";
    auto r = run_process({"bash", "-c", "cd " + dir_.path() + " || exit 1\n" + script}, env_, 120);
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;

    auto decoded =
        run_process({"tshark", "-r", capture, "-T", "fields", "-E", "separator=,", "-e", "infiniband.bth.opcode", "-e",
                     "infiniband.bth.psn", "-e", "infiniband.reth.va", "-e", "infiniband.reth.dmalen"});
    ASSERT_EQ(decoded.exit_code, 0) << decoded.err;
    struct Write {
      int opcode;
      uint32_t psn;
      uint64_t va;  // 0: no RETH
      uint32_t length;
    };
    std::vector<Write> writes;
    std::map<int, int> count;
    std::istringstream lines(decoded.out);
    std::string line;
    while (std::getline(lines, line)) {
      Write w{};
      unsigned long long va = 0;
      int fields = std::sscanf(line.c_str(), "%d,%u,%llx,%u", &w.opcode, &w.psn, &va, &w.length);
      if (fields < 2 || w.opcode < kWriteFirst || w.opcode > kWriteOnly || w.opcode == 9) continue;
      w.va = va;
      writes.push_back(w);
      ++count[w.opcode];
    }
    if (framing == "packets") {
      EXPECT_EQ(count[kWriteFirst] + count[kWriteMiddle] + count[kWriteLast], 0) << decoded.out;
      ASSERT_GE(count[kWriteOnly], 3 * 20) << decoded.out;
      int parts_followed = 0;
      for (size_t i = 0; i + 1 < writes.size(); ++i) {
        const Write &w = writes[i], &next = writes[i + 1];
        EXPECT_TRUE(w.length == 4096 || w.length == 1808) << "PSN " << w.psn << ": " << w.length << " bytes";
        if (w.length == 4096 && next.psn == ((w.psn + 1) & 0xffffff)) {
          EXPECT_EQ(next.va, w.va + 4096) << "the next part of the range, PSN " << next.psn;
          ++parts_followed;
        }
      }
      EXPECT_GE(parts_followed, 2 * 20);
    } else {
      EXPECT_EQ(count[kWriteOnly], 0) << decoded.out;
      EXPECT_GE(count[kWriteFirst], 20);
      EXPECT_EQ(count[kWriteMiddle], count[kWriteFirst]);
      EXPECT_EQ(count[kWriteLast], count[kWriteFirst]);
      for (const Write& w : writes) {
        if (w.opcode == kWriteFirst) {
          EXPECT_EQ(w.length, 10000u) << "the FIRST's RETH names the whole WRITE";
        }
      }
    }
  }
}

// A value of SOFTVERBS_UDP_WRITES that means nothing is named on stderr, and
// the WRITEs still go (as WRITE ONLY packets).
TEST_F(UdpOnLoopback, AnUnknownWriteFramingIsNamedAndTheDefaultUsed) {
  Pair r = ib_write_bw("bad_framing", "10000", "20", {"SOFTVERBS_UDP_WRITES=bytes"});
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  EXPECT_NE(r.client.err.find("SOFTVERBS_UDP_WRITES=bytes is neither packets nor messages; using packets"),
            std::string::npos)
      << r.client.err;
  EXPECT_GE(counters()["rx_packets"], 3u * 20) << "every WRITE arrived";
}

// ibv_xsrq_pingpong's capture as tshark decodes it: XRC SEND FIRST, MIDDLE
// and LAST (a 3000-byte message at MTU 1024) to each side's XRC_RECV QP and
// XRC ACKs back; every request's XRCETH, the 4 bytes after the BTH, names
// the SRQ of the side it goes to. (Wireshark 4.0 names XRC opcodes but shows
// the XRCETH as the first 4 bytes of an unknown header sequence.)
TEST_F(UdpOnLoopback, CaptureOfXrcShowsXrcOpcodesAndTheXrcethsSrqNumber) {
  std::string capture = dir_.path() + "/xrc.pcap";
  std::string gid = ipv4_gid_index();
  ASSERT_FALSE(gid.empty());
  std::string cli = SOFTVERBS_CLI;
  const std::string tool = cli + " run -- ibv_xsrq_pingpong -d softverbs0 -g " + gid + " -p " +
                           port_for("xrc_capture") + " -s 3000 -m 1024 -n 3";
  std::string script = cli + " capture -w " + capture + " & capture=$!\n" + "while [ ! -s " + capture +
                       " ]; do sleep 0.05; done; sleep 0.2\n" + tool + " > server.txt 2>&1 & server=$!; sleep 0.5\n" +
                       "for try in $(seq 1 50); do " + tool +
                       " 127.0.0.1 > client.txt 2>&1 && break; grep -q \"Couldn't connect\" client.txt || break; "
                       "sleep 0.2; done; status=$?\n" +
                       "wait $server || status=1\n" + "kill -INT $capture; wait $capture; exit $status\n";
  auto r = run_process({"bash", "-c", "cd " + dir_.path() + " || exit 1\n" + script}, env_, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  std::ifstream client_file(dir_.path() + "/client.txt");
  std::string client_out((std::istreambuf_iterator<char>(client_file)), std::istreambuf_iterator<char>());
  const std::regex address("(local|remote): .*QPN RECV ([0-9a-f]+) SEND ([0-9a-f]+), PSN [0-9a-f]+, SRQN ([0-9a-f]+)");
  std::map<uint32_t, uint32_t> srqn_of_recv_qp;  // both sides'
  for (auto it = std::sregex_iterator(client_out.begin(), client_out.end(), address); it != std::sregex_iterator();
       ++it)
    srqn_of_recv_qp[std::stoul((*it)[2].str(), nullptr, 16)] = std::stoul((*it)[4].str(), nullptr, 16);
  ASSERT_EQ(srqn_of_recv_qp.size(), 2u) << client_out;

  auto decoded = run_process({"tshark", "-r", capture, "-T", "fields", "-E", "separator=,", "-E", "occurrence=f", "-e",
                              "infiniband.bth.opcode", "-e", "infiniband.bth.destqp", "-e", "infiniband.vendor"});
  ASSERT_EQ(decoded.exit_code, 0) << decoded.err;
  std::map<int, int> count;
  std::istringstream lines(decoded.out);
  std::string line;
  while (std::getline(lines, line)) {
    int opcode = 0;
    unsigned qpn = 0, xrceth = 0;
    const int fields = std::sscanf(line.c_str(), "%d,%x,%8x", &opcode, &qpn, &xrceth);
    if (fields < 2) continue;
    ++count[opcode];
    if (opcode < 0xa0 || opcode > 0xa4) continue;  // the requests: XRC SEND FIRST .. ONLY
    ASSERT_EQ(fields, 3) << line;
    ASSERT_TRUE(srqn_of_recv_qp.count(qpn)) << "to an XRC_RECV QP: " << line;
    EXPECT_EQ(xrceth >> 24, 0u) << "XRCETH's reserved byte: " << line;
    EXPECT_EQ(xrceth & 0xffffff, srqn_of_recv_qp[qpn]) << line;
  }
  for (int expected : {0xa0, 0xa1, 0xa2, 0xb1})
    EXPECT_GE(count[expected], 3) << "opcode " << expected << " in\n" << decoded.out;
  for (const auto& [opcode, n] : count) EXPECT_GE(opcode, 0xa0) << "only XRC opcodes";
}

// ATOMIC WRITE on the wire, from the data-path tests' own requests: RC
// opcode 0x1d (29) with its RETH and 8 bytes, answered by an RDMA READ
// RESPONSE ONLY without payload at the same PSN whose AETH says ACK; the
// misaligned one by a NAK Invalid Request. tshark 4.0 names no opcode 29,
// so its RETH is read from the UDP payload.
TEST_F(UdpOnLoopback, CaptureShowsAtomicWriteAndItsEmptyReadResponse) {
  std::string capture = dir_.path() + "/atomic_write.pcap";
  std::string cli = SOFTVERBS_CLI;
  std::string script = cli + " capture -w " + capture + " & capture=$!\n" + "while [ ! -s " + capture +
                       " ]; do sleep 0.05; done; sleep 0.2\n" + cli + " run -- " + VERBS_DATAPATH_TEST +
                       " --gtest_filter='AtomicWrite.PlacesEight*:AtomicWrite.AMisaligned*'; status=$?\n" +
                       "kill -INT $capture; wait $capture; exit $status\n";
  auto r = run_process({"bash", "-c", script}, env_, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  auto decoded =
      run_process({"tshark", "-r", capture, "-T", "fields", "-E", "separator=,", "-e", "infiniband.bth.opcode", "-e",
                   "infiniband.bth.psn", "-e", "infiniband.aeth.syndrome", "-e", "udp.length", "-e", "udp.payload"});
  ASSERT_EQ(decoded.exit_code, 0) << decoded.err;
  struct Packet {
    int opcode = -1;
    unsigned psn = 0, syndrome = 0, udp_length = 0;
    std::string bytes;  // the UDP payload, in hex
  };
  std::vector<Packet> packets;
  std::istringstream lines(decoded.out);
  std::string line;
  while (std::getline(lines, line)) {
    std::vector<std::string> fields;
    std::istringstream parts(line);
    std::string field;
    while (std::getline(parts, field, ',')) fields.push_back(field);
    fields.resize(5);
    if (fields[0].empty()) continue;
    Packet p;
    p.opcode = std::stoi(fields[0]);
    p.psn = fields[1].empty() ? 0 : std::stoul(fields[1]);
    p.syndrome = fields[2].empty() ? 0 : std::stoul(fields[2]);
    p.udp_length = fields[3].empty() ? 0 : std::stoul(fields[3]);
    p.bytes = fields[4];
    packets.push_back(p);
  }
  std::vector<size_t> requests;
  for (size_t i = 0; i < packets.size(); ++i)
    if (packets[i].opcode == 29) requests.push_back(i);
  ASSERT_EQ(requests.size(), 2u) << decoded.out;
  for (size_t i : requests) {
    // UDP header, BTH, RETH, 8 bytes, ICRC.
    EXPECT_EQ(packets[i].udp_length, 8u + 12 + 16 + 8 + 4) << decoded.out;
  }
  // After the BTH (12 bytes) the RETH: its DMA length is 8; then the first
  // test's value, as the sender's memory holds it.
  const std::string& first = packets[requests[0]].bytes;
  ASSERT_GE(first.size(), 2u * (12 + 16 + 8)) << decoded.out;
  EXPECT_EQ(first.substr(48, 8), "00000008") << "RETH DMA length";
  EXPECT_EQ(first.substr(56, 16), "efcdab8967452301") << "the 8 bytes";
  auto answer_to = [&](size_t request) {
    for (size_t i = request + 1; i < packets.size(); ++i)
      if (packets[i].psn == packets[request].psn && (packets[i].opcode == 16 || packets[i].opcode == 17))
        return packets[i];
    return Packet{};
  };
  Packet placed = answer_to(requests[0]);
  EXPECT_EQ(placed.opcode, 16) << "RDMA READ RESPONSE ONLY\n" << decoded.out;
  EXPECT_EQ(placed.syndrome >> 5, 0u) << "an ACK in its AETH";
  EXPECT_EQ(placed.udp_length, 8u + 12 + 4 + 4) << "no payload";
  Packet refused = answer_to(requests[1]);
  EXPECT_EQ(refused.opcode, 17) << decoded.out;
  EXPECT_EQ(refused.syndrome, 0x61u) << "NAK, Invalid Request";
}

TEST_F(UdpOnLoopback, CaptureDecodesInTsharkAndScapyAgreesWithEveryIcrc) {
  std::string capture = dir_.path() + "/traffic.pcap";
  std::string gid = ipv4_gid_index();
  std::string cli = SOFTVERBS_CLI;
  // Capture while a multi-packet SEND ping-pong, a READ and an atomic
  // latency test run; stop the capture with Ctrl-C (SIGINT), as a user would.
  const std::string g = " -d softverbs0 ";
  std::string script = cli + " capture -w " + capture + " & capture=$!\n" + "while [ ! -s " + capture +
                       " ]; do sleep 0.05; done; sleep 0.2\n" + "run() { " + cli + " run -- \"$@\"; }\n" +
                       "pair() { run \"$@\" > server.txt 2>&1 & server=$!; sleep 0.5;\n" +
                       "  run \"$@\" 127.0.0.1 > client.txt; status=$?; wait $server; return $status; }\n" +
                       "pair ibv_rc_pingpong" + g + "-g " + gid +
                       " -p 23456 -m 1024 -s 3000 -n 3 && cp client.txt rc.txt &&\n" + "pair ib_read_lat" + g + "-x " +
                       gid + " -p 23457 -n 5 -s 5000 &&\n" + "pair ib_atomic_lat" + g + "-x " + gid +
                       " -p 23458 -n 5; status=$?\n" + "kill -INT $capture; wait $capture; exit $status\n";
  auto r = run_process({"bash", "-c", "cd " + dir_.path() + " || exit 1\n" + script}, env_, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.err.find("packets captured"), std::string::npos) << r.err;

  // The client's QPN and first PSN, as ibv_rc_pingpong prints them.
  std::ifstream client_file(dir_.path() + "/rc.txt");
  std::string client_out((std::istreambuf_iterator<char>(client_file)), std::istreambuf_iterator<char>());
  std::smatch local, remote;
  ASSERT_TRUE(std::regex_search(client_out, local, std::regex("local address: .*QPN (0x[0-9a-f]+), PSN (0x[0-9a-f]+)")))
      << client_out;
  ASSERT_TRUE(
      std::regex_search(client_out, remote, std::regex("remote address: .*QPN (0x[0-9a-f]+), PSN (0x[0-9a-f]+)")));
  const uint32_t server_qpn = std::stoul(remote[1].str(), nullptr, 16);
  const uint32_t client_psn = std::stoul(local[2].str(), nullptr, 16);

  auto decoded =
      run_process({"tshark", "-r", capture, "-T", "fields", "-E", "separator=,", "-e", "infiniband.bth.opcode", "-e",
                   "infiniband.bth.destqp", "-e", "infiniband.bth.psn", "-e", "udp.dstport"});
  ASSERT_EQ(decoded.exit_code, 0) << decoded.err;
  std::set<int> opcodes;
  std::vector<std::tuple<int, uint32_t, uint32_t>> packets;
  std::istringstream lines(decoded.out);
  std::string line;
  while (std::getline(lines, line)) {
    int opcode = 0, port = 0;
    unsigned qpn = 0, psn = 0;
    if (std::sscanf(line.c_str(), "%d,%x,%u,%d", &opcode, &qpn, &psn, &port) != 4) continue;
    EXPECT_EQ(port, 4791);
    opcodes.insert(opcode);
    packets.emplace_back(opcode, qpn, psn);
  }
  ASSERT_GT(packets.size(), 40u) << decoded.out;
  // SEND first/middle/last (a 3000-byte message at MTU 1024), ACK, READ
  // request and responses, fetch-and-add or compare-and-swap, atomic ACK.
  for (int expected : {0, 1, 2, 17, 12, 13, 15, 18})
    EXPECT_TRUE(opcodes.count(expected)) << "opcode " << expected << " missing in\n" << decoded.out;
  EXPECT_TRUE(opcodes.count(19) || opcodes.count(20)) << "an atomic request";
  // The client's first SEND goes to the server's QPN with the client's PSN.
  auto first = std::find_if(packets.begin(), packets.end(),
                            [&](const auto& p) { return std::get<0>(p) == 0 && std::get<1>(p) == server_qpn; });
  ASSERT_NE(first, packets.end());
  EXPECT_EQ(std::get<2>(*first), client_psn);
  auto next = std::find_if(first, packets.end(), [&](const auto& p) { return std::get<0>(p) == 1; });
  ASSERT_NE(next, packets.end());
  EXPECT_EQ(std::get<2>(*next), (client_psn + 1) & 0xffffff) << "SEND MIDDLE follows with the next PSN";

  auto scapy = run_process({CHECK_ICRC_SCRIPT, capture});
  EXPECT_EQ(scapy.exit_code, 0) << scapy.err << scapy.out;
  EXPECT_NE(scapy.out.find(", 0 bad"), std::string::npos) << scapy.out;

  // A flipped byte in a packet is noticed by the independent check.
  std::fstream file(capture, std::ios::in | std::ios::out | std::ios::binary);
  file.seekp(24 + 16 + 28 + 12 + 100);  // inside the first packet's payload
  char byte;
  file.seekg(file.tellp());
  file.get(byte);
  file.seekp(-1, std::ios::cur);
  file.put(static_cast<char>(byte ^ 0x01));
  file.close();
  EXPECT_NE(run_process({CHECK_ICRC_SCRIPT, capture}).exit_code, 0);
}

// A SEND with invalidate over UDP: SEND ONLY WITH INVALIDATE (opcode 23,
// IBA table 38) carrying the window's rkey in its IETH, which Wireshark
// decodes, and an ICRC that the independent check accepts.
TEST_F(UdpOnLoopback, SendWithInvalidateCarriesItsIethInTshark) {
  const std::string capture = dir_.path() + "/invalidate.pcap";
  const std::string cli = SOFTVERBS_CLI;
  const std::string script = cli + " capture -w " + capture + " & capture=$!\n" + "while [ ! -s " + capture +
                             " ]; do sleep 0.05; done; sleep 0.2\n" + cli + " run -- " + VERBS_DATAPATH_TEST +
                             " --gtest_filter=MemoryWindow.Type2WindowInvalidatedBySendWithInvalidate; status=$?\n" +
                             "kill -INT $capture; wait $capture; exit $status\n";
  auto r = run_process({"bash", "-c", "cd " + dir_.path() + " || exit 1\n" + script}, env_, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  std::smatch printed;
  ASSERT_TRUE(std::regex_search(r.out, printed, std::regex("send with invalidate of rkey (0x[0-9a-f]+)"))) << r.out;
  const uint32_t rkey = std::stoul(printed[1].str(), nullptr, 16);

  auto decoded = run_process({"tshark", "-r", capture, "-Y", "infiniband.bth.opcode == 23", "-T", "fields", "-E",
                              "separator=,", "-e", "infiniband.bth.opcode", "-e", "infiniband.ieth"});
  ASSERT_EQ(decoded.exit_code, 0) << decoded.err;
  char expected[16];
  std::snprintf(expected, sizeof expected, "23,%08x", rkey);
  EXPECT_NE(decoded.out.find(expected), std::string::npos) << "want " << expected << " in\n" << decoded.out;

  auto scapy = run_process({CHECK_ICRC_SCRIPT, capture});
  EXPECT_EQ(scapy.exit_code, 0) << scapy.err << scapy.out;
  EXPECT_NE(scapy.out.find(", 0 bad"), std::string::npos) << scapy.out;
}

// iproute2's `rdma` where the kernel has no RDMA netlink: the preload answers
// its resource and statistic queries about softverbs devices from the
// device's memory.
class RdmaToolOnLoopback : public UdpOnLoopback {
 protected:
  void SetUp() override {
    if (run_process({"sh", "-c", "command -v rdma"}).exit_code != 0) GTEST_SKIP() << "iproute2's rdma is not installed";
    if (run_process({NETLINK_PROBE}).out.find("\nNETLINK_RDMA: ok") != std::string::npos)
      GTEST_SKIP() << "this kernel has RDMA netlink (ib_core): `rdma` shows its devices, not softverbs'";
    UdpOnLoopback::SetUp();
  }
  ProcessResult rdma(std::vector<std::string> words) const {
    return run_process(under_softverbs(std::move(words)), env_);
  }
  // Runs `tool` as a pingpong server and client over 127.0.0.1's RoCE v2 GID,
  // calling `while_server_waits` once the server is started; both must pass.
  void pingpong(const std::string& tool, const std::string& iterations,
                const std::function<void()>& while_server_waits) {
    const std::string gid = ipv4_gid_index();
    ASSERT_FALSE(gid.empty());
    const std::vector<std::string> server = {tool, "-d",           "softverbs0", "-g",      gid,
                                             "-p", port_for(tool), "-n",         iterations};
    std::vector<std::string> client = server;
    client.push_back("127.0.0.1");
    const Pair r = run_pair(server, client, {}, while_server_waits);
    EXPECT_EQ(r.client.exit_code, 0) << r.client.err;
    EXPECT_EQ(r.server.exit_code, 0) << r.server.err;
  }
  // `rdma` with `words` until its output matches `wanted` (a server
  // starting up), at most 5 s.
  ProcessResult rdma_until(const std::vector<std::string>& words, const std::regex& wanted) const {
    ProcessResult listed;
    for (int i = 0; i < 200; ++i) {
      listed = rdma(words);
      if (std::regex_search(listed.out, wanted)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return listed;
  }
};

// A pingpong server's QP, CQ, MR and context are listed while it waits for
// its client; once both are done none is, and the port's counters are the
// device's.
TEST_F(RdmaToolOnLoopback, ShowsLiveQpsAndTheDevicesCounters) {
  pingpong("ibv_rc_pingpong", "500", [&] {
    const std::regex server_qp(
        R"re(\{"ifindex":1,"ifname":"softverbs0","port":1,"lqpn":\d+,"rqpn":\d+,"type":"RC","state":"INIT",.*"pid":\d+,"comm":"ibv_rc_pingpong"\})re");
    const ProcessResult qps = rdma_until({"rdma", "resource", "show", "qp", "-j"}, server_qp);
    EXPECT_TRUE(std::regex_search(qps.out, server_qp)) << qps.out << qps.err;
    // ibv_rc_pingpong's one CQ (rx_depth 500 + 1 entries, rounded up to a
    // power of two) serves its QP as send and as receive CQ: two users.
    const ProcessResult cqs = rdma({"rdma", "resource", "show", "cq", "-j"});
    EXPECT_TRUE(std::regex_search(
        cqs.out,
        std::regex(
            R"re(\{"ifindex":1,"ifname":"softverbs0","cqn":\d+,"cqe":512,"users":2,"pid":\d+,"comm":"ibv_rc_pingpong"\})re")))
        << cqs.out << cqs.err;
    // Its one 4 KiB buffer's MR; the keys and address only to a caller with
    // CAP_NET_ADMIN, as the kernel shows them.
    const ProcessResult mrs = rdma({"rdma", "resource", "show", "mr", "-j"});
    const std::regex server_mr(
        R"re(\{"ifindex":1,"ifname":"softverbs0","mrn":\d+,"rkey":"([0-9a-f]+)","lkey":"([0-9a-f]+)","iova":"[0-9a-f]+","mrlen":4096,"pdn":\d+,"pid":\d+,"comm":"ibv_rc_pingpong"\})re");
    std::smatch mr;
    EXPECT_TRUE(std::regex_search(mrs.out, mr, server_mr)) << mrs.out << mrs.err;
    if (!mr.empty()) {
      EXPECT_EQ(mr[1], mr[2]);
    }
    if (run_process({"sh", "-c", "command -v setpriv"}).exit_code == 0) {
      const ProcessResult unprivileged = rdma({"setpriv", "--inh-caps=-all", "--bounding-set=-net_admin", "rdma",
                                               "resource", "show", "mr", "mrlen", "4096"});
      EXPECT_TRUE(std::regex_search(
          unprivileged.out, std::regex(R"(^dev softverbs0 mrn \d+ mrlen 4096 pdn \d+ pid \d+ comm ibv_rc_pingpong)")))
          << unprivileged.out << unprivileged.err;
    }
    const ProcessResult contexts = rdma({"rdma", "resource", "show", "ctx"});
    EXPECT_TRUE(std::regex_search(contexts.out, std::regex(R"(^dev softverbs0 ctxn \d+ pid \d+ comm ibv_rc_pingpong)")))
        << contexts.out << contexts.err;
    const ProcessResult summary = rdma({"rdma", "resource", "show"});
    EXPECT_EQ(summary.exit_code, 0) << summary.err;
    EXPECT_TRUE(std::regex_search(summary.out, std::regex(R"(^1: softverbs0: cq 1 qp 1 mr 1 srq 0 ctx 1)")))
        << summary.out;
  });

  const ProcessResult qps = rdma({"rdma", "resource", "show", "qp"});
  EXPECT_EQ(qps.exit_code, 0) << qps.err;
  EXPECT_EQ(qps.out, "") << "no process holds a QP any more";
  EXPECT_EQ(rdma({"rdma", "resource", "show", "cq"}).out, "") << "nor a CQ";
  EXPECT_EQ(rdma({"rdma", "resource", "show", "mr"}).out, "") << "nor an MR";
  EXPECT_EQ(rdma({"rdma", "resource", "show", "ctx"}).out, "") << "nor a context";
  const ProcessResult summary = rdma({"rdma", "resource", "show"});
  EXPECT_NE(summary.out.find("softverbs0: cq 0 qp 0 mr 0 srq 0 ctx 0"), std::string::npos) << summary.out;

  // Every counter as `softverbs stat` shows it, in the kernel's hardware
  // counter format; the 500 SENDs each way among them.
  ProcessResult statistic = rdma({"rdma", "statistic", "show", "link", "softverbs0/1"});
  ASSERT_EQ(statistic.exit_code, 0) << statistic.err;
  const std::map<std::string, uint64_t> expected = counters();
  ASSERT_FALSE(expected.empty());
  EXPECT_GE(expected.at("tx_packets"), 2u * 500);
  for (const auto& [name, value] : expected) {
    if (name == "processes" || name == "qps" || name == "cqs" || name == "srqs" || name == "mrs" ||
        name == "heap_bytes")
      continue;  // what the device holds: `rdma resource show`
    EXPECT_NE(statistic.out.find(" " + name + " " + std::to_string(value) + " "), std::string::npos)
        << name << " " << value << " in: " << statistic.out;
  }
  EXPECT_TRUE(statistic.out.starts_with("link softverbs0/1 tx_packets ")) << statistic.out;
  // Per-QP counters and counter modes are not emulated: refused, not made up.
  ProcessResult per_qp = rdma({"rdma", "statistic", "qp", "show"});
  EXPECT_NE(per_qp.exit_code, 0) << per_qp.out;
  EXPECT_NE(per_qp.err.find("Operation not supported"), std::string::npos) << per_qp.err;
}

// ibv_srq_pingpong's server: one SRQ that its 16 QPs receive from, as
// `rdma resource show srq` lists it on a kernel device.
TEST_F(RdmaToolOnLoopback, ListsAnSrqWithTheQpsThatUseIt) {
  pingpong("ibv_srq_pingpong", "100", [&] {
    const std::regex listed(
        R"re(^dev softverbs0 srqn \d+ type BASIC lqpn ((\d+,){15}\d+) pdn \d+ pid \d+ comm ibv_srq_pingpon)re");
    const ProcessResult srqs = rdma_until({"rdma", "resource", "show", "srq"}, listed);
    std::smatch match;
    EXPECT_TRUE(std::regex_search(srqs.out, match, listed)) << srqs.out << srqs.err;
    if (match.empty()) return;
    // Every QP it names is one of the server's, listed by `rdma resource show qp`.
    const std::string qps = rdma({"rdma", "resource", "show", "qp"}).out;
    std::stringstream numbers(match[1].str());
    for (std::string qpn; std::getline(numbers, qpn, ',');)
      EXPECT_NE(qps.find("lqpn " + qpn + " "), std::string::npos) << qpn << " in:\n" << qps;
  });
  EXPECT_EQ(rdma({"rdma", "resource", "show", "srq"}).out, "");
}

}  // namespace
}  // namespace softverbs
