// RoCE v2 over IPv6 as rxe sends it: with a UDP checksum of zero, the ICRC
// covering the packet instead. A Linux UDP socket drops such
// a datagram unless it allows them, so softverbs took nothing from a kernel
// peer over IPv6 but what needs no answer. ctest starts this binary through
// `softverbs run` on a --transport udp device on lo, which carries ::1.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "device_fixture.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace {

using namespace softverbs;
using namespace softverbs::test;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kSourceQp = 0x123;
constexpr size_t kGrhBytes = 40;
const std::string kMessage = "a SEND with a UDP checksum of zero";

wire::IpAddress loopback6() {
  wire::IpAddress address{};
  address[15] = 1;
  return address;
}

sockaddr_in6 at_loopback6(uint16_t port) {
  sockaddr_in6 where{};
  where.sin6_family = AF_INET6;
  where.sin6_addr = in6addr_loopback;
  where.sin6_port = htons(port);
  return where;
}

// A UDP socket on [::1] that sends its datagrams with a checksum of zero,
// as rxe's are; its port in `port`.
int zero_checksum_sender(uint16_t& port) {
  const int fd = socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  sockaddr_in6 from = at_loopback6(0);
  socklen_t length = sizeof from;
  if (setsockopt(fd, SOL_UDP, UDP_NO_CHECK6_TX, &one, sizeof one) != 0 ||
      bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&from), &length) != 0) {
    close(fd);
    return -1;
  }
  port = ntohs(from.sin6_port);
  return fd;
}

// A UD SEND ONLY of kMessage to QP `qpn`, sealed for `flow`.
std::vector<uint8_t> ud_send(uint32_t qpn, const wire::FlowAddress& flow) {
  wire::TransportPacket packet;
  packet.bth.opcode = wire::opcode(wire::Service::Ud, wire::op::kSendOnly);
  packet.bth.dest_qp = qpn;
  packet.deth = {kTestQkey, kSourceQp};
  packet.payload = {reinterpret_cast<const uint8_t*>(kMessage.data()), kMessage.size()};
  std::vector<uint8_t> datagram = wire::build(packet);
  wire::seal(flow, datagram);
  return datagram;
}

class ZeroChecksumOverIpv6 : public DeviceObjects<::testing::Test> {
 protected:
  void SetUp() override {
    DeviceObjects::SetUp();
    if (HasFatalFailure()) return;
    ibv_qp_init_attr init{};
    init.send_cq = init.recv_cq = cq_a_;
    init.qp_type = IBV_QPT_UD;
    init.cap = {4, 4, 1, 1, 0};
    qp_ = ibv_create_qp(pd_, &init);
    ASSERT_NE(qp_, nullptr);
    ASSERT_EQ(to_init(qp_, IBV_QPT_UD, 0), 0);
    ASSERT_EQ(to_rtr(qp_, IBV_QPT_UD, PeerPath{}), 0);
    ASSERT_EQ(to_rts(qp_, IBV_QPT_UD), 0);
    mr_ = ibv_reg_mr(pd_, buffer_.data(), buffer_.size(), IBV_ACCESS_LOCAL_WRITE);
    ASSERT_NE(mr_, nullptr);
    ibv_sge sge{reinterpret_cast<uintptr_t>(buffer_.data()), static_cast<uint32_t>(buffer_.size()), mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = 7;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_recv(qp_, &wr, &bad), 0);
  }
  void TearDown() override {
    if (qp_) {
      EXPECT_EQ(ibv_destroy_qp(qp_), 0);
    }
    if (mr_) {
      EXPECT_EQ(ibv_dereg_mr(mr_), 0);
    }
    DeviceObjects::TearDown();
  }

  ibv_qp* qp_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<uint8_t> buffer_ = std::vector<uint8_t>(kGrhBytes + 256);
};

TEST_F(ZeroChecksumOverIpv6, ASendWithAZeroUdpChecksumIsReceived) {
  uint16_t port = 0;
  const int fd = zero_checksum_sender(port);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const wire::FlowAddress flow{loopback6(), loopback6(), port, wire::kRoceV2Port};
  const std::vector<uint8_t> datagram = ud_send(qp_->qp_num, flow);

  // The premise: a plain UDP socket on ::1 drops what this sender sends.
  const int plain = socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_in6 plain_at = at_loopback6(0);
  socklen_t length = sizeof plain_at;
  ASSERT_EQ(bind(plain, reinterpret_cast<sockaddr*>(&plain_at), sizeof plain_at), 0);
  ASSERT_EQ(getsockname(plain, reinterpret_cast<sockaddr*>(&plain_at), &length), 0);
  ASSERT_EQ(sendto(fd, datagram.data(), datagram.size(), 0, reinterpret_cast<sockaddr*>(&plain_at), sizeof plain_at),
            static_cast<ssize_t>(datagram.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  uint8_t scratch[512];
  EXPECT_LT(recv(plain, scratch, sizeof scratch, 0), 0) << "the kernel let a zero checksum over IPv6 through";
  close(plain);

  const sockaddr_in6 device = at_loopback6(wire::kRoceV2Port);
  ASSERT_EQ(sendto(fd, datagram.data(), datagram.size(), 0, reinterpret_cast<const sockaddr*>(&device), sizeof device),
            static_cast<ssize_t>(datagram.size()));
  close(fd);
  ibv_wc wc{};
  int polled = 0;
  for (const auto deadline = Clock::now() + std::chrono::seconds(5); polled == 0 && Clock::now() < deadline;)
    polled = ibv_poll_cq(cq_a_, 1, &wc);
  ASSERT_EQ(polled, 1) << "the SEND was not received";
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.wr_id, 7u);
  EXPECT_EQ(wc.src_qp, kSourceQp);
  EXPECT_EQ(wc.byte_len, kGrhBytes + kMessage.size());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buffer_.data() + kGrhBytes), kMessage.size()), kMessage);
}

}  // namespace
