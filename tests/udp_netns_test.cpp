// Two hosts as two network namespaces joined by a veth pair, each with its
// own softverbs device on its end of the pair (transport auto: the peer's
// GID is not local, so the UDP transport carries the traffic) and its own
// runtime directory: they share nothing but the wire. Unmodified rdma-core
// tools run in each namespace and talk RoCEv2 over the veth, rdma_cm ones
// through IB CM MADs to QP1. Needs root (ip netns); skipped otherwise.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include "device_status.h"
#include "process_runner.h"

namespace softverbs {
namespace {

using test::ipv4_mapped_gid;
using test::ProcessResult;
using test::roce_v2_gid_index;
using test::run_process;
using test::TemporaryDirectory;

class TwoNamespaces : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
    if (run_process({"ip", "-V"}).exit_code != 0) GTEST_SKIP() << "needs iproute2";
    const std::string id = std::to_string(getpid() % 100000);
    ns_a_ = "svt-a-" + id;
    ns_b_ = "svt-b-" + id;
    const std::string subnet = "10.231." + std::to_string(getpid() % 250) + ".";
    address_a_ = subnet + "1";
    address_b_ = subnet + "2";
    env_a_ = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt-a"};
    env_b_ = {"SOFTVERBS_RUNTIME_DIR=" + dir_.path() + "/rt-b"};
    for (const auto& command : std::vector<std::vector<std::string>>{
             {"ip", "netns", "add", ns_a_},
             {"ip", "netns", "add", ns_b_},
             {"ip", "link", "add", "sva" + id, "type", "veth", "peer", "name", "svb" + id},
             {"ip", "link", "set", "sva" + id, "netns", ns_a_},
             {"ip", "link", "set", "svb" + id, "netns", ns_b_},
             {"ip", "-n", ns_a_, "addr", "add", address_a_ + "/24", "dev", "sva" + id},
             {"ip", "-n", ns_b_, "addr", "add", address_b_ + "/24", "dev", "svb" + id},
             {"ip", "-n", ns_a_, "link", "set", "sva" + id, "up"},
             {"ip", "-n", ns_b_, "link", "set", "svb" + id, "up"},
             {"ip", "-n", ns_a_, "link", "set", "lo", "up"},
             {"ip", "-n", ns_b_, "link", "set", "lo", "up"},
         }) {
      auto r = run_process(command);
      ASSERT_EQ(r.exit_code, 0) << command[0] << ' ' << command[1] << ' ' << command[2] << ": " << r.err;
    }
    created_ = true;
    netdev_a_ = "sva" + id;
    netdev_b_ = "svb" + id;
    auto up_a = in_a({SOFTVERBS_CLI, "up", "--name", "sva", "--netdev", "sva" + id});
    ASSERT_EQ(up_a.exit_code, 0) << up_a.err;
    auto up_b = in_b({SOFTVERBS_CLI, "up", "--name", "svb", "--netdev", "svb" + id});
    ASSERT_EQ(up_b.exit_code, 0) << up_b.err;
    gid_a_ = ipv4_gid_index("sva", address_a_);
    gid_b_ = ipv4_gid_index("svb", address_b_);
    ASSERT_FALSE(gid_a_.empty());
    ASSERT_FALSE(gid_b_.empty());
  }

  void TearDown() override {
    if (!created_) return;
    run_process({"ip", "netns", "del", ns_a_});
    run_process({"ip", "netns", "del", ns_b_});
  }

  ProcessResult in_namespace(const std::string& ns, std::vector<std::string> command, int timeout = 120) {
    command.insert(command.begin(), {"ip", "netns", "exec", ns});
    return run_process(command, ns == ns_a_ ? env_a_ : env_b_, timeout);
  }
  ProcessResult in_a(std::vector<std::string> command) { return in_namespace(ns_a_, std::move(command)); }
  ProcessResult in_b(std::vector<std::string> command) { return in_namespace(ns_b_, std::move(command)); }
  const std::vector<std::string>& env_of(const std::string& device) { return device == "sva" ? env_a_ : env_b_; }

  // tshark capturing RoCEv2 (UDP port 4791) on `netdev` of namespace `ns`
  // into `capture`, until stop(); started once its file has its header.
  class Tshark {
   public:
    Tshark(TwoNamespaces& test, const std::string& ns, const std::string& netdev, const std::string& capture)
        : pid_file_(capture + ".pid") {
      running_ = std::async(std::launch::async, [&test, ns, netdev, capture, pid_file = pid_file_] {
        return test.in_namespace(ns, {"bash", "-c",
                                      "tshark -q -B 64 -i " + netdev + " -f 'udp port 4791' -w " + capture +
                                          " & echo $! > " + pid_file + "; wait"});
      });
      for (int i = 0; i < 1000 && !(std::filesystem::exists(capture) && std::filesystem::file_size(capture) > 0); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      started_ = std::filesystem::exists(capture);
    }
    ~Tshark() {
      if (running_.valid()) stop();  // a test that failed on the way
    }
    Tshark(const Tshark&) = delete;
    Tshark& operator=(const Tshark&) = delete;
    bool started() const { return started_; }
    // Its exit status.
    int stop() {
      run_process({"bash", "-c", "kill -INT $(cat " + pid_file_ + ")"});
      return running_.get().exit_code;
    }

   private:
    std::string pid_file_;
    std::future<ProcessResult> running_;
    bool started_ = false;
  };

  // The RoCE v2 GID index of `address` (a.b.c.d) on `device`.
  std::string ipv4_gid_index(const std::string& device, const std::string& address) {
    return roce_v2_gid_index(run_process({SOFTVERBS_CLI, "status", device}, env_of(device)).out,
                             ipv4_mapped_gid(address));
  }

  // A server in namespace A, its client in B connecting to A's address.
  struct Pair {
    ProcessResult server, client;
  };
  // `ready` says when the server listens; without it the client retries
  // while it cannot connect.
  Pair run_pair(const std::vector<std::string>& tool_a, const std::vector<std::string>& tool_b,
                std::function<bool()> ready = nullptr) {
    std::vector<std::string> server = {SOFTVERBS_CLI, "run", "--"};
    server.insert(server.end(), tool_a.begin(), tool_a.end());
    std::vector<std::string> client = {SOFTVERBS_CLI, "run", "--"};
    client.insert(client.end(), tool_b.begin(), tool_b.end());
    auto background = std::async(std::launch::async, [&] { return in_a(server); });
    Pair result;
    if (ready)
      for (int i = 0; i < 200 && !ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (int attempt = 0; attempt < 100; ++attempt) {
      result.client = in_b(client);
      if (ready || result.client.exit_code == 0 || result.client.err.find("Couldn't connect") == std::string::npos)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    result.server = background.get();
    return result;
  }

  uint64_t counter(const std::string& device, const std::string& name) {
    auto r = run_process({SOFTVERBS_CLI, "stat", device}, env_of(device));
    std::smatch match;
    if (!std::regex_search(r.out, match, std::regex(name + "\\s+(\\d+)"))) return 0;
    return std::stoull(match[1].str());
  }

  void expect_pingpong(const std::string& tool, std::vector<std::string> args) {
    std::vector<std::string> a = {tool, "-d", "sva", "-g", gid_a_};
    std::vector<std::string> b = {tool, "-d", "svb", "-g", gid_b_};
    a.insert(a.end(), args.begin(), args.end());
    b.insert(b.end(), args.begin(), args.end());
    b.push_back(address_a_);
    Pair r = run_pair(a, b);
    EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
    EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
    EXPECT_NE(r.client.out.find("iters in"), std::string::npos);
    EXPECT_NE(r.client.out.find("GID ::ffff:" + address_a_), std::string::npos)
        << "the peer is named by its RoCE v2 GID";
    EXPECT_GT(counter("sva", "rx_packets"), 0u);
    EXPECT_GT(counter("svb", "rx_packets"), 0u);
    EXPECT_EQ(counter("sva", "forwarded_packets"), 0u) << "one process per host: no forwarding";
    EXPECT_EQ(counter("svb", "icrc_errors"), 0u);
  }

  TemporaryDirectory dir_;
  std::vector<std::string> env_a_, env_b_;
  std::string ns_a_, ns_b_, netdev_a_, netdev_b_, address_a_, address_b_, gid_a_, gid_b_;
  bool created_ = false;
};

TEST_F(TwoNamespaces, RcPingpong4KiBValidated) {
  expect_pingpong("ibv_rc_pingpong", {"-s", "4096", "-c", "-n", "500"});
}

TEST_F(TwoNamespaces, RcPingpong1MiBValidated) {
  expect_pingpong("ibv_rc_pingpong", {"-s", "1048576", "-c", "-n", "30"});
}

TEST_F(TwoNamespaces, RcPingpongWithEvents) {
  expect_pingpong("ibv_rc_pingpong", {"-e", "-s", "65536", "-c", "-n", "100"});
}

TEST_F(TwoNamespaces, UcPingpongValidated) { expect_pingpong("ibv_uc_pingpong", {"-s", "8192", "-c", "-n", "200"}); }

TEST_F(TwoNamespaces, UdPingpongValidated) {
  // A UD message fits one packet: the veth's 1500-byte MTU gives RoCE 1024.
  expect_pingpong("ibv_ud_pingpong", {"-s", "1000", "-c", "-n", "200"});
}

TEST_F(TwoNamespaces, RpingThroughTheRdmacmShim) {
  const std::string runtime = dir_.path() + "/rt-a";
  std::vector<std::string> server = {"rping", "-s", "-v", "-V", "-C", "100", "-a", address_a_, "-p", "7199"};
  std::vector<std::string> client = {"rping", "-c", "-v", "-V", "-C", "100", "-a", address_a_, "-p", "7199"};
  Pair r = run_pair(server, client, [&] { return test::rdmacm_listening(runtime); });
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  EXPECT_NE(r.client.out.find("ping data: rdma-ping-99"), std::string::npos);
  EXPECT_GT(counter("svb", "rx_packets"), 0u);
}

// The packets as a strict receiver (rxe, a RoCE NIC) checks them: each
// ICRC over the IP header the kernel wrote, identification included, which
// the kernel gives a datagram sent alone (0) and each of a GSO send (its
// place). The veths segment GSO sends themselves (tx-udp-segmentation off),
// so a capture on B's end sees every datagram as a NIC would send it.
TEST_F(TwoNamespaces, IcrcsHoldForTheIdentificationsTheKernelGives) {
  if (run_process({"ethtool", "--version"}).exit_code != 0) GTEST_SKIP() << "needs ethtool";
  ASSERT_EQ(in_a({"ethtool", "-K", netdev_a_, "tx-udp-segmentation", "off"}).exit_code, 0);
  ASSERT_EQ(in_b({"ethtool", "-K", netdev_b_, "tx-udp-segmentation", "off"}).exit_code, 0);
  const std::string capture = dir_.path() + "/wire.pcap";
  Tshark tshark(*this, ns_b_, netdev_b_, capture);
  ASSERT_TRUE(tshark.started()) << "tshark did not start";
  // 64 KiB SENDs each way: 64 packets of path MTU 1024, GSO sends of many.
  expect_pingpong("ibv_rc_pingpong", {"-s", "65536", "-c", "-n", "20"});
  const std::string runtime = dir_.path() + "/rt-a";
  Pair r = run_pair({"rping", "-s", "-C", "3", "-a", address_a_, "-p", "7197"},
                    {"rping", "-c", "-C", "3", "-a", address_a_, "-p", "7197"},
                    [&] { return test::rdmacm_listening(runtime); });
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the last packets into the file
  ASSERT_EQ(tshark.stop(), 0);
  auto scapy = run_process({CHECK_ICRC_SCRIPT, capture});
  EXPECT_EQ(scapy.exit_code, 0) << scapy.err << scapy.out;
  std::smatch counts;
  ASSERT_TRUE(std::regex_search(scapy.out, counts,
                                std::regex(R"(checked (\d+) packets, (\d+) bad, \d+ IPv6 skipped, (\d+) nonzero)")))
      << scapy.out;
  EXPECT_GT(std::stoul(counts[1].str()), 2 * 20 * 64u) << "both ways' SENDs";
  EXPECT_EQ(counts[2].str(), "0") << scapy.out;
  EXPECT_GT(std::stoul(counts[3].str()), 20 * 60u) << "the datagrams after the first of each GSO send";
}

// The connection management on the wire, as tshark reads a capture of A's
// device: REQ, REP, RTU, DREQ, DREP, each a UD SEND from QP1 to QP1.
TEST_F(TwoNamespaces, CmExchangeIsIbCmOnQp1AsTsharkDecodesIt) {
  const std::string capture = dir_.path() + "/cm.pcap";
  auto capturing = std::async(std::launch::async, [&] {
    return in_a({SOFTVERBS_CLI, "capture", "sva", "-w", capture, "--duration", "4"});
  });
  // Until the capture has made its file: it starts capturing right after.
  for (int i = 0; i < 1000 && !std::filesystem::exists(capture); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(std::filesystem::exists(capture)) << "softverbs capture did not start";
  const std::string runtime = dir_.path() + "/rt-a";
  Pair r = run_pair({"rping", "-s", "-C", "3", "-a", address_a_, "-p", "7198"},
                    {"rping", "-c", "-C", "3", "-a", address_a_, "-p", "7198"},
                    [&] { return test::rdmacm_listening(runtime); });
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out;
  ASSERT_EQ(capturing.get().exit_code, 0);
  auto decoded = run_process({"tshark", "-r", capture, "-Y", "infiniband.mad", "-T", "fields", "-E", "separator=,",
                              "-e", "ip.src", "-e", "infiniband.mad.attributeid", "-e", "infiniband.bth.destqp", "-e",
                              "infiniband.deth.srcqp", "-e", "infiniband.deth.q_key"});
  ASSERT_EQ(decoded.exit_code, 0) << decoded.err;
  const std::string a = address_a_, b = address_b_;
  const std::string qp1 = ",0x000001,0x00000001,0x0000000080010000\n";  // to QP1, from QP1, Q_Key of QP1
  const std::string expected = b + ",0x0010" + qp1 +                    // REQ
                               a + ",0x0013" + qp1 +                    // REP
                               b + ",0x0014" + qp1 +                    // RTU
                               b + ",0x0015" + qp1 +                    // DREQ
                               a + ",0x0016" + qp1;                     // DREP
  EXPECT_EQ(decoded.out, expected);
  auto rep = run_process({"tshark", "-r", capture, "-Y", "infiniband.cm.req", "-T", "fields", "-e",
                          "infiniband.cm.req.serviceid.dport", "-e", "infiniband.cm.req.ip_cm.sip4", "-e",
                          "infiniband.cm.req.ip_cm.dip4", "-e", "infiniband.cm.req.prim_localgid_ipv4"});
  EXPECT_EQ(rep.out, "0x1c1e\t" + b + "\t" + a + "\t" + b + "\n") << "port 7198 and rdma_cm's IP header";

  // A REQ's or REP's starting PSN is the one its sender expects to receive,
  // as the kernel's IB CM reads it: the peer's first request carries it.
  auto psns = run_process({"tshark", "-r", capture, "-T", "fields", "-E", "separator=,", "-e", "ip.src", "-e",
                           "infiniband.cm.req.startpsn", "-e", "infiniband.cm.rep.startpsn", "-e",
                           "infiniband.bth.opcode", "-e", "infiniband.bth.psn"});
  ASSERT_EQ(psns.exit_code, 0) << psns.err;
  std::optional<unsigned long> req_psn, rep_psn, first_from_a, first_from_b;
  std::istringstream lines(psns.out);
  for (std::string line; std::getline(lines, line);) {
    std::vector<std::string> field;
    std::istringstream parts(line);
    for (std::string part; std::getline(parts, part, ',');) field.push_back(part);
    field.resize(5);
    if (!field[1].empty()) req_psn = std::stoul(field[1], nullptr, 0);
    if (!field[2].empty()) rep_psn = std::stoul(field[2], nullptr, 0);
    if (field[3].empty()) continue;
    const unsigned long opcode = std::stoul(field[3], nullptr, 0);
    const bool rc_request = opcode <= 12 || opcode == 19 || opcode == 20;  // SEND, WRITE, READ, atomics
    if (!rc_request) continue;
    auto& first = field[0] == a ? first_from_a : first_from_b;
    if (!first) first = std::stoul(field[4], nullptr, 0);
  }
  ASSERT_TRUE(req_psn && rep_psn && first_from_a && first_from_b) << psns.out;
  EXPECT_EQ(*first_from_a, *req_psn) << "the passive side sends from the REQ's starting PSN";
  EXPECT_EQ(*first_from_b, *rep_psn) << "the active side sends from the REP's starting PSN";
}

// CM MADs are UD datagrams: lost ones are sent again (a REQ, REP or DREQ
// after ~1.07 s, a DREQ also after its process has ended; an RTU when its
// REP comes again). With a tenth of every packet lost each way, rping
// still connects, moves its data and disconnects on both sides.
TEST_F(TwoNamespaces, CmSurvivesLoss) {
  ASSERT_EQ(in_a({SOFTVERBS_CLI, "faults", "sva", "loss=0.1,seed=7"}).exit_code, 0);
  ASSERT_EQ(in_b({SOFTVERBS_CLI, "faults", "svb", "loss=0.1,seed=11"}).exit_code, 0);
  const std::string runtime = dir_.path() + "/rt-a";
  Pair r = run_pair({"rping", "-s", "-V", "-C", "20", "-a", address_a_, "-p", "7197"},
                    {"rping", "-c", "-V", "-C", "20", "-a", address_a_, "-p", "7197"},
                    [&] { return test::rdmacm_listening(runtime); });
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  // The client's last step is receiving the server's last SEND: if that
  // SEND's ACK is lost too and so is the client's first DREQ, the server's
  // resends meet a QP that is gone and run out of retries (IBV_WC_RETRY_EXC_ERR,
  // 8 x 67 ms) before the DREQ comes again (~1.07 s), as on an HCA. That
  // end (about 1 run in 100) is the one server failure allowed, and only
  // once the client validated every iteration; the DREQ must still arrive.
  const std::string server_text = r.server.out + r.server.err;
  const bool last_ack_and_dreq_lost = r.client.exit_code == 0 &&
                                      server_text.find("cq completion failed status 12") != std::string::npos &&
                                      server_text.find("server DISCONNECT EVENT") != std::string::npos;
  if (!last_ack_and_dreq_lost) {
    EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  }
  EXPECT_GT(counter("sva", "faults_dropped") + counter("svb", "faults_dropped"), 0u);
}

// perftest's rdma_cm mode (-R), a bandwidth and a latency test.
TEST_F(TwoNamespaces, PerftestOverRdmaCm) {
  const std::string runtime = dir_.path() + "/rt-a";
  for (const std::string tool : {"ib_send_bw", "ib_write_lat"}) {
    Pair r = run_pair({tool, "-R", "-n", "200", "-p", "18600"}, {tool, "-R", "-n", "200", "-p", "18600", address_a_},
                      [&] { return test::rdmacm_listening(runtime); });
    EXPECT_EQ(r.client.exit_code, 0) << tool << ":\n"
                                     << r.client.err << r.client.out << "\nserver:\n"
                                     << r.server.err << r.server.out;
    EXPECT_EQ(r.server.exit_code, 0) << tool << ":\n" << r.server.err << r.server.out;
    EXPECT_NE(r.client.out.find(" 200 "), std::string::npos) << tool << ": " << r.client.out;
  }
}

// udaddy: UD over rdma_cm (SIDR_REQ/SIDR_REP, then datagrams).
TEST_F(TwoNamespaces, UdaddyOverSidr) {
  const std::string runtime = dir_.path() + "/rt-a";
  Pair r = run_pair({"udaddy"}, {"udaddy", "-s", address_a_}, [&] { return test::rdmacm_listening(runtime); });
  EXPECT_EQ(r.client.exit_code, 0) << r.client.err << r.client.out << "\nserver:\n" << r.server.err << r.server.out;
  EXPECT_EQ(r.server.exit_code, 0) << r.server.err << r.server.out;
  EXPECT_NE(r.client.out.find("test complete"), std::string::npos) << r.client.out;
}

// mckey: rdma_cm multicast, one sender in B and receivers in both
// namespaces (two QPs in A's). The group travels as IP multicast: every
// receiver's host joined it on the netdev (IGMP, as the kernel's rdma_cm
// does for RoCE v2), and each datagram is a RoCE v2 UD SEND to the group's
// address and QPN 0xffffff, which every receiving QP takes.
TEST_F(TwoNamespaces, MckeyOverIpMulticast) {
  const std::string group = "239.77.1.2", count = "100";
  const std::string capture = dir_.path() + "/mc.pcap";
  auto capturing = std::async(std::launch::async, [&] {
    return in_a({SOFTVERBS_CLI, "capture", "sva", "-w", capture, "--duration", "6"});
  });
  std::vector<std::string> receiver_a = {SOFTVERBS_CLI, "run", "--", "mckey", "-m",  group, "-b",
                                         address_a_,    "-c",  "2",  "-C",    count, "-S",  "1000"};
  std::vector<std::string> receiver_b = {SOFTVERBS_CLI, "run",      "--", "mckey", "-m", group,
                                         "-b",          address_b_, "-C", count,   "-S", "1000"};
  auto in_a_receiving = std::async(std::launch::async, [&] { return in_a(receiver_a); });
  auto in_b_receiving = std::async(std::launch::async, [&] { return in_b(receiver_b); });
  auto joined = [&](const std::string& ns, const std::string& netdev) {
    return run_process({"ip", "-n", ns, "maddr", "show", "dev", netdev}).out.find(group) != std::string::npos;
  };
  for (int i = 0; i < 200 && !(joined(ns_a_, netdev_a_) && joined(ns_b_, netdev_b_)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(joined(ns_a_, netdev_a_)) << "A's host is a member of the group";
  auto sender =
      in_b({SOFTVERBS_CLI, "run", "--", "mckey", "-m", group, "-s", "-b", address_b_, "-C", count, "-S", "1000"});
  EXPECT_EQ(sender.exit_code, 0) << sender.err << sender.out;
  for (auto* receiving : {&in_a_receiving, &in_b_receiving}) {
    ProcessResult r = receiving->get();
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    EXPECT_NE(r.out.find("joined dgid: ::ffff:" + group), std::string::npos) << "RoCE v2's group GID: " << r.out;
    EXPECT_NE(r.out.find("data transfers complete"), std::string::npos) << r.out;
  }
  ASSERT_EQ(capturing.get().exit_code, 0);
  auto decoded = run_process({"tshark", "-r", capture, "-Y", "infiniband.bth.destqp == 0xffffff", "-T", "fields", "-e",
                              "ip.dst", "-e", "infiniband.deth.q_key"});
  ASSERT_EQ(decoded.exit_code, 0) << decoded.err;
  std::string one = group + "\t0x0000000001234567\n";  // RDMA_UDP_QKEY
  std::string all;
  for (int i = 0; i < std::stoi(count); ++i) all += one;
  EXPECT_EQ(decoded.out, all) << "A received each datagram once, sent to the group";
}

// A REQ for a port nobody listens on is rejected with the kernel's reason
// (8, invalid service ID); one to a host where nothing answers ends in
// UNREACHABLE (-ETIMEDOUT) once the MAD retries run out.
TEST_F(TwoNamespaces, NoListenerIsRejectedAndSilenceIsUnreachable) {
  const std::vector<std::string> to_7301 = {"rping", "-c", "-C", "1", "-a", address_a_, "-p", "7301"};
  std::vector<std::string> alone = {SOFTVERBS_CLI, "run", "--"};
  alone.insert(alone.end(), to_7301.begin(), to_7301.end());
  const auto start = std::chrono::steady_clock::now();
  auto silent = in_b(alone);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(silent.exit_code, 0);
  EXPECT_NE((silent.out + silent.err).find("RDMA_CM_EVENT_UNREACHABLE, error -110"), std::string::npos)
      << silent.err << silent.out;
  EXPECT_LT(seconds, 15.0) << "the MAD retry bound (5 tries of ~1.07 s)";

  // A listens on another port (and is stopped after a while).
  const std::string runtime = dir_.path() + "/rt-a";
  Pair r = run_pair({"timeout", "3", "rping", "-s", "-C", "1", "-a", address_a_, "-p", "7302"}, to_7301,
                    [&] { return test::rdmacm_listening(runtime); });
  EXPECT_NE((r.client.out + r.client.err).find("RDMA_CM_EVENT_REJECTED, error 8"), std::string::npos)
      << r.client.err << r.client.out;
}

// Connections refused, rejected, accepted and ended across the hosts, as
// cm_semantics_probe checks them against what the kernel's rdma_cm gives,
// with a third process on each host that uses rdma_cm (an rping server
// waiting for a client). A process that is killed sends nothing; the
// kernel's CM sends a DREQ for each of its connections as its file
// closes, and here the other process of its host does (it holds a QP1
// agent on the device), so the peer on the other host sees DISCONNECTED.
TEST_F(TwoNamespaces, CmOutcomesMatchTheKernelsWithABystanderOnEachHost) {
  std::map<std::string, std::future<ProcessResult>> bystanders;
  for (const auto& [ns, address] : {std::pair{ns_a_, address_a_}, std::pair{ns_b_, address_b_}}) {
    const std::string pid_file = dir_.path() + "/" + ns + ".pid";
    bystanders[pid_file] = std::async(std::launch::async, [this, ns, address, pid_file] {
      return in_namespace(ns, {SOFTVERBS_CLI, "run", "--", "bash", "-c",
                               "rping -s -a " + address + " -p 7401 & echo $! > " + pid_file + "; wait"});
    });
  }
  for (const std::string& runtime : {dir_.path() + "/rt-a", dir_.path() + "/rt-b"})
    for (int i = 0; i < 200 && !test::rdmacm_listening(runtime); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto passive = std::async(std::launch::async, [&] {
    return in_a({SOFTVERBS_CLI, "run", "--", CM_SEMANTICS_PROBE, "-b", address_a_, "-p", "7410"});
  });
  auto active = in_b({SOFTVERBS_CLI, "run", "--", CM_SEMANTICS_PROBE, "-b", address_b_, "-p", "7410", address_a_});
  auto passive_result = passive.get();
  for (auto& [pid_file, bystander] : bystanders) {
    run_process({"bash", "-c", "kill $(cat " + pid_file + ")"});
    bystander.get();
  }
  EXPECT_EQ(active.exit_code, 0) << active.err << active.out;
  EXPECT_EQ(passive_result.exit_code, 0) << passive_result.err << passive_result.out;
  EXPECT_NE(active.out.find("PASS accepted, then the active side's process is killed (active side)"), std::string::npos)
      << active.out;
  EXPECT_NE(active.out.find("PASS accepted, then the passive side's process is killed (active side)"),
            std::string::npos)
      << active.out;
}

// A process killed while connected, with no other rdma_cm process of its
// device on its host: its device's CM watcher (started by `softverbs up`)
// sends the DREQ that the kernel's CM sends as the process's file closes,
// so the peer on the other host sees DISCONNECTED, whichever side died.
TEST_F(TwoNamespaces, APeerOfAProcessKilledAloneOnItsHostIsDisconnected) {
  int port = 7420;
  for (const std::string side : {"active", "passive"}) {
    const std::string name = side + "-killed";
    port += 20;
    auto passive = std::async(std::launch::async, [&] {
      return in_a(
          {SOFTVERBS_CLI, "run", "--", CM_SEMANTICS_PROBE, "-b", address_a_, "-c", name, "-p", std::to_string(port)});
    });
    auto active = in_b({SOFTVERBS_CLI, "run", "--", CM_SEMANTICS_PROBE, "-b", address_b_, "-c", name, "-p",
                        std::to_string(port), address_a_});
    auto passive_result = passive.get();
    // The probe's other process on the dead one's host made no rdma_cm call.
    EXPECT_NE(active.out.find("1 of 1 cases"), std::string::npos) << active.err << active.out;
    EXPECT_NE(passive_result.out.find("1 of 1 cases"), std::string::npos) << passive_result.err << passive_result.out;
    EXPECT_EQ(active.exit_code, 0) << active.err << active.out;
    EXPECT_EQ(passive_result.exit_code, 0) << passive_result.err << passive_result.out;
  }
}

// As the kernel's CM, which resends a DREQ until the peer's DREP comes:
// a process killed alone on its host has nobody there to take its peer's
// DREP, so the watcher's DREQ goes out 1 + 4 times, ~1.07 s apart, as a
// capture on the peer's end shows.
TEST_F(TwoNamespaces, AKilledProcesssDreqIsResentUntilItsRetriesRunOut) {
  const std::string capture = dir_.path() + "/dreq.pcap";
  Tshark tshark(*this, ns_a_, netdev_a_, capture);
  ASSERT_TRUE(tshark.started()) << "tshark did not start";
  const std::string port = "7490";
  auto passive = std::async(std::launch::async, [&] {
    return in_a({SOFTVERBS_CLI, "run", "--", CM_SEMANTICS_PROBE, "-b", address_a_, "-c", "active-killed", "-p", port});
  });
  auto active = in_b({SOFTVERBS_CLI, "run", "--", CM_SEMANTICS_PROBE, "-b", address_b_, "-c", "active-killed", "-p",
                      port, address_a_});
  auto passive_result = passive.get();
  EXPECT_EQ(active.exit_code, 0) << active.err << active.out;
  EXPECT_EQ(passive_result.exit_code, 0) << passive_result.err << passive_result.out;
  // The first DREQ ended the case; four resends follow within ~4.6 s.
  std::this_thread::sleep_for(std::chrono::milliseconds(5500));
  ASSERT_EQ(tshark.stop(), 0);
  auto dreqs = run_process({"tshark", "-r", capture, "-Y", "infiniband.mad.attributeid == 0x0015", "-T", "fields", "-e",
                            "ip.src", "-e", "frame.time_relative"});
  ASSERT_EQ(dreqs.exit_code, 0) << dreqs.err;
  std::istringstream lines(dreqs.out);
  std::vector<double> times;
  for (std::string source, time; lines >> source >> time;) {
    EXPECT_EQ(source, address_b_) << dreqs.out;
    times.push_back(std::stod(time));
  }
  ASSERT_EQ(times.size(), 5u) << "the DREQ and its 4 resends:\n" << dreqs.out;
  for (size_t i = 1; i < times.size(); ++i) {
    EXPECT_GT(times[i] - times[i - 1], 0.9) << dreqs.out;
    EXPECT_LT(times[i] - times[i - 1], 1.6) << dreqs.out;
  }
}

}  // namespace
}  // namespace softverbs
