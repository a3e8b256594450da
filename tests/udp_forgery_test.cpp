// A local user who forges RoCEv2 packets at a root process's QP over the
// UDP transport (ctest starts this binary through `softverbs run` on a
// --transport udp device). The attacker here knows everything a guess would
// have to find (QPN, PSN, rkey, address), so what stops it is what the
// transport checks beyond them: the packet's source address against the
// QP's peer, as rxe does, and the forwarding socket's secret. A packet from
// the peer's own address does get through: RoCE authenticates nothing
// (docs/security.md), which the last test shows as a control.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "cross_user_helpers.h"
#include "rc_peer.h"
#include "udp/internal.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace {

using namespace softverbs;
using namespace softverbs::test;

constexpr uint32_t kLength = 64;
constexpr uint8_t kForged = 0xaa;

wire::IpAddress ipv4_mapped(const char* text) {
  wire::IpAddress address{};
  address[10] = address[11] = 0xff;
  inet_pton(AF_INET, text, address.data() + 12);
  return address;
}

// A WRITE ONLY of kLength bytes of kForged to `target`'s buffer, as a
// datagram (BTH .. ICRC) sent on `flow`.
std::vector<uint8_t> forged_write(const ConnectInfo& target, const wire::FlowAddress& flow) {
  wire::TransportPacket packet;
  packet.bth.opcode = wire::opcode(wire::Service::Rc, wire::op::kWriteOnly);
  packet.bth.dest_qp = target.qpn;
  packet.bth.psn = target.psn;  // what the target's responder expects next
  packet.bth.ack_request = true;
  packet.reth = {target.address, target.rkey, kLength};
  const std::vector<uint8_t> payload(kLength, kForged);
  packet.payload = payload;
  std::vector<uint8_t> datagram = wire::build(packet);
  wire::seal(flow, datagram);
  return datagram;
}

// Sends `datagram` from `source`:`source_port` to 127.0.0.1:`port`, as
// user nobody. True if the kernel took it.
bool send_as_nobody(const char* source, uint16_t source_port, uint16_t port, const std::vector<uint8_t>& datagram) {
  return run_as_nobody([&] {
           const int fd = socket(AF_INET, SOCK_DGRAM, 0);
           sockaddr_in from{};
           from.sin_family = AF_INET;
           from.sin_port = htons(source_port);
           inet_pton(AF_INET, source, &from.sin_addr);
           sockaddr_in to{};
           to.sin_family = AF_INET;
           to.sin_port = htons(port);
           to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
           if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) return 1;
           const ssize_t sent =
               sendto(fd, datagram.data(), datagram.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
           return sent == static_cast<ssize_t>(datagram.size()) ? 0 : 1;
         }) == 0;
}

// Waits (up to 5 s) until the device counter `name` exceeds `before`.
bool counter_rises(const std::string& name, uint64_t before) {
  for (int i = 0; i < 100; ++i) {
    const uint64_t now = device_counter(name);
    if (now != UINT64_MAX && now > before) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// Polls `self` until kLength bytes at its buffer's start are all `value`
// (up to 5 s): the UDP engine places a WRITE while the application polls.
bool buffer_becomes(Endpoint& self, uint8_t value) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    ibv_wc wc;
    self.poll(&wc, 1);
    bool all = true;
    for (uint32_t i = 0; i < kLength; ++i) all = all && self.data()[i] == value;
    if (all) return true;
  }
  return false;
}

bool buffer_untouched(Endpoint& self) {
  for (uint32_t i = 0; i < kLength; ++i)
    if (self.data()[i] != 0) return false;
  return true;
}

// The UDP ports process `pid` has bound on 127.0.0.1, but `except`.
std::set<uint16_t> loopback_udp_ports(pid_t pid, uint16_t except) {
  std::set<std::string> inodes;
  for (const auto& name : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(name.path(), error).string();
    if (!error && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::set<uint16_t> ports;
  std::ifstream table("/proc/net/udp");
  std::string line;
  std::getline(table, line);
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    if (!(fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode))
      continue;
    const uint16_t port = static_cast<uint16_t>(std::stoul(local.substr(local.find(':') + 1), nullptr, 16));
    if (local.rfind("0100007F:", 0) == 0 && inodes.count(inode) && port != except) ports.insert(port);
  }
  return ports;
}

class UdpForgery : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!can_switch_user()) GTEST_SKIP() << "needs root, to run a second user";
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sockets_), 0);
    child_ = spawn_peer(sockets_[1], 1 << 16, 16, 14, 7, [](Endpoint&, int fd) {
      char ready = 'R', never;
      write_all(fd, &ready, 1);
      read_all(fd, &never, 1);
      return 0;
    });
    ASSERT_GT(child_, 0);
    ConnectInfo peer;
    ASSERT_TRUE(open_connected(self_, sockets_[0], 1 << 16, 16, 14, 7, peer));
    me_ = self_.info();
    ASSERT_TRUE(buffer_untouched(self_));
  }
  void TearDown() override {
    if (child_ > 0) kill(child_, SIGKILL);
  }

  int sockets_[2] = {-1, -1};
  pid_t child_ = -1;
  Endpoint self_;
  ConnectInfo me_;
};

TEST_F(UdpForgery, AWriteFromAnAddressThatIsNotThePeersIsDropped) {
  const wire::FlowAddress flow{ipv4_mapped("127.0.0.2"), ipv4_mapped("127.0.0.1"), 0xc123, wire::kRoceV2Port};
  const uint64_t before = device_counter("wrong_source_dropped");
  ASSERT_NE(before, UINT64_MAX);
  ASSERT_TRUE(send_as_nobody("127.0.0.2", 0xc123, wire::kRoceV2Port, forged_write(me_, flow)));
  EXPECT_TRUE(counter_rises("wrong_source_dropped", before)) << "the packet was not seen and refused";
  EXPECT_TRUE(polls_nothing_for(self_, std::chrono::milliseconds(50)));
  EXPECT_TRUE(buffer_untouched(self_));
}

TEST_F(UdpForgery, AForwardedPacketWithoutTheDevicesSecretIsDropped) {
  const wire::FlowAddress flow{ipv4_mapped("127.0.0.1"), ipv4_mapped("127.0.0.1"), 0xc123, wire::kRoceV2Port};
  const std::vector<uint8_t> datagram = forged_write(me_, flow);
  udp::ForwardHeader header;  // everything right but the secret, which device memory keeps
  header.source_port = flow.source_port;
  header.destination_port = flow.destination_port;
  std::memcpy(header.source, flow.source.data(), 16);
  std::memcpy(header.destination, flow.destination.data(), 16);
  std::vector<uint8_t> forwarded(sizeof header + datagram.size());
  std::memcpy(forwarded.data(), &header, sizeof header);
  std::memcpy(forwarded.data() + sizeof header, datagram.data(), datagram.size());
  const std::set<uint16_t> ports = loopback_udp_ports(getpid(), wire::kRoceV2Port);
  ASSERT_FALSE(ports.empty()) << "this process's forwarding socket";
  const uint64_t before = device_counter("malformed_packets");
  for (uint16_t port : ports) EXPECT_TRUE(send_as_nobody("127.0.0.1", 0, port, forwarded));
  EXPECT_TRUE(counter_rises("malformed_packets", before));
  EXPECT_TRUE(polls_nothing_for(self_, std::chrono::milliseconds(50)));
  EXPECT_TRUE(buffer_untouched(self_));
}

// The control: the same WRITE from the peer's own address is placed. RoCE
// has no authentication; only what a guess must find protects a QP from a
// packet that a local user sends from the peer's address.
TEST_F(UdpForgery, TheSameWriteFromThePeersAddressIsPlaced) {
  const wire::FlowAddress flow{ipv4_mapped("127.0.0.1"), ipv4_mapped("127.0.0.1"), 0xc124, wire::kRoceV2Port};
  ASSERT_TRUE(send_as_nobody("127.0.0.1", 0xc124, wire::kRoceV2Port, forged_write(me_, flow)));
  EXPECT_TRUE(buffer_becomes(self_, kForged));
}

}  // namespace
