// The UDP completer as a requester sees its peer's answers: ACKs and NAKs
// for the PSNs of an RC QP's requests, fed in the order a lossy or
// reordering network may deliver them, with the packets the requester sends
// in reply recorded.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "device/device_memory.h"
#include "process_runner.h"
#include "udp/qp.h"
#include "wire/roce_headers.h"

namespace softverbs {
namespace {

constexpr uint32_t kFirstPsn = 0x500;
constexpr uint32_t kMtu = 1024;
constexpr uint32_t kPackets = 8;

class UdpCompleter : public ::testing::Test, public udp::TransportPort {
 protected:
  void SetUp() override {
    std::string error;
    memory_ = DeviceMemory::open(dir_.path() + "/dev.mem", &error);
    ASSERT_TRUE(memory_) << error;
    const auto address = reinterpret_cast<uint64_t>(buffer_.data());
    auto key =
        memory_->shared().mrs.register_region(pd_, getpid(), address, address, buffer_.size(), access::kLocalWrite);
    ASSERT_TRUE(key);
    key_ = *key;
    cq_ = memory_->allocate_cq();
    ASSERT_GE(cq_, 0);
    ASSERT_TRUE(memory_->allocate_completion_ring(memory_->shared().cqs[cq_], 64));
    const int index = memory_->allocate_qp();
    ASSERT_GE(index, 0);
    QpRecord& record = memory_->shared().qps[index];
    record.state = QpState::Rts;
    record.pd_handle = pd_;
    record.send_cq = record.recv_cq = cq_;
    qp_.index = index;
    qp_.qpn = record.qpn;
    qp_.type = QpType::Rc;
    qp_.pd_handle = pd_;
    qp_.send_cq = qp_.recv_cq = cq_;
    qp_.connected = true;
    qp_.sending = true;
    qp_.dest_qpn = 0x77;
    qp_.mtu = kMtu;
    qp_.attributes.timeout = 14;
    qp_.attributes.retry_count = 7;
    qp_.attributes.rnr_retry = 7;
    qp_.requester.next_psn = kFirstPsn;
    qp_.requester.acked_psn = udp::psn_add(kFirstPsn, udp::kPsnMask);
    qp_.requester.retries_left = 7;
    qp_.requester.rnr_retries_left = -1;
  }

  // One WRITE of kPackets packets.
  void post_write() {
    udp::SendWqe write;
    write.wr_id = 1;
    write.opcode = SendOpcode::RdmaWrite;
    write.signaled = true;
    write.sges = {{reinterpret_cast<uint64_t>(buffer_.data()), kPackets * kMtu, key_}};
    write.length = kPackets * kMtu;
    write.remote_address = 0x10000;
    write.rkey = 0x1234;
    udp::requester_post(*this, qp_, write);
  }

  // One request the responder answers with a response packet: an ATOMIC
  // WRITE of the buffer's first 8 bytes, or a FETCH_ADD into them.
  void post_answered(SendOpcode opcode) {
    udp::SendWqe request;
    request.wr_id = 2;
    request.opcode = opcode;
    request.signaled = true;
    request.sges = {{reinterpret_cast<uint64_t>(buffer_.data()), 8, key_}};
    request.length = 8;
    request.remote_address = 0x20000;
    request.rkey = 0x1234;
    request.compare_add = 1;
    udp::requester_post(*this, qp_, request);
  }

  // The response that ends such a request: an ATOMIC WRITE's zero-length
  // READ RESPONSE ONLY, an atomic's ATOMIC ACKNOWLEDGE.
  void respond(SendOpcode to, uint32_t psn) {
    wire::TransportPacket packet;
    const bool atomic = to != SendOpcode::AtomicWrite;
    packet.bth.opcode =
        wire::opcode(wire::Service::Rc, atomic ? wire::op::kAtomicAcknowledge : wire::op::kReadResponseOnly);
    packet.bth.dest_qp = qp_.qpn;
    packet.bth.psn = psn;
    packet.aeth.syndrome = udp::aeth::kAck;
    udp::completer_receive(*this, qp_, packet);
  }

  // What the retransmission timer sends once it runs out.
  std::vector<uint32_t> time_out() {
    now_ = qp_.requester.ack_deadline;
    udp::completer_tick(*this, qp_);
    return take_sent();
  }

  void answer(uint32_t psn, uint8_t syndrome) {
    wire::TransportPacket packet;
    packet.bth.opcode = wire::opcode(wire::Service::Rc, wire::op::kAcknowledge);
    packet.bth.dest_qp = qp_.qpn;
    packet.bth.psn = psn;
    packet.aeth.syndrome = syndrome;
    udp::completer_receive(*this, qp_, packet);
  }

  std::vector<uint32_t> take_sent() { return std::exchange(sent_, {}); }
  static std::vector<uint32_t> psns(uint32_t from, uint32_t to) {
    std::vector<uint32_t> out;
    for (uint32_t psn = from; psn <= to; ++psn) out.push_back(psn);
    return out;
  }

  // TransportPort
  DeviceMemory& memory() override { return *memory_; }
  udp::Clock::time_point now() const override { return now_; }
  uint64_t application_calls() const override { return 0; }
  void transmit(udp::UdpQp&, const udp::Path&, uint32_t, const wire::TransportPacket& packet,
                std::span<const iovec>) override {
    sent_.push_back(packet.bth.psn);
  }

  test::TemporaryDirectory dir_;
  std::shared_ptr<DeviceMemory> memory_;
  std::vector<uint8_t> buffer_ = std::vector<uint8_t>(kPackets * kMtu, 0x5a);
  uint32_t pd_ = 3;
  uint32_t key_ = 0;
  int cq_ = -1;
  udp::UdpQp qp_;
  udp::Clock::time_point now_{};
  std::vector<uint32_t> sent_;
};

TEST_F(UdpCompleter, ASequenceNakSendsAgainFromItsPsn) {
  post_write();
  ASSERT_EQ(take_sent(), psns(kFirstPsn, kFirstPsn + kPackets - 1));
  answer(kFirstPsn + 2, udp::aeth::kNak | udp::aeth::kNakSequenceError);
  EXPECT_EQ(take_sent(), psns(kFirstPsn + 2, kFirstPsn + kPackets - 1));
  EXPECT_EQ(qp_.requester.acked_psn, kFirstPsn + 1) << "the NAK acknowledges what precedes its PSN";
}

// A NAK for a PSN the peer has acknowledged since (it was sent before the
// ACK and overtaken by it) asks for nothing the peer lacks: an HCA ignores
// it, and sending all after it again would only duplicate.
TEST_F(UdpCompleter, AStaleSequenceNakSendsNothingAgain) {
  post_write();
  ASSERT_EQ(take_sent().size(), kPackets);
  answer(kFirstPsn + 5, udp::aeth::kAck);
  answer(kFirstPsn + 3, udp::aeth::kNak | udp::aeth::kNakSequenceError);
  answer(kFirstPsn + 5, udp::aeth::kNak | udp::aeth::kNakSequenceError);
  EXPECT_TRUE(take_sent().empty());
  EXPECT_EQ(qp_.requester.acked_psn, kFirstPsn + 5);
  // The next PSN is not stale: from there the packets go again.
  answer(kFirstPsn + 6, udp::aeth::kNak | udp::aeth::kNakSequenceError);
  EXPECT_EQ(take_sent(), psns(kFirstPsn + 6, kFirstPsn + kPackets - 1));
  answer(kFirstPsn + kPackets - 1, udp::aeth::kAck);
  CompletionRing ring = memory_->completion_ring(memory_->shared().cqs[cq_]);
  Completion completion[2];
  ASSERT_EQ(ring.pop(completion), 1u);
  EXPECT_EQ(completion[0].status, WcStatus::Success);
}

// An ACK for a duplicate WRITE acknowledges every PSN the responder has
// taken (rxe and HCAs answer so), past an ATOMIC WRITE or atomic whose own
// response was lost. Only that response ends the request: the requester
// asks again at once and, should that answer be lost as well, at every
// timeout, until the response comes or the retries run out.
TEST_F(UdpCompleter, ARequestAcknowledgedPastButUnansweredIsAskedAgainAtEachTimeout) {
  for (SendOpcode opcode : {SendOpcode::AtomicWrite, SendOpcode::AtomicFetchAdd}) {
    SCOPED_TRACE(opcode == SendOpcode::AtomicWrite ? "ATOMIC WRITE" : "FETCH_ADD");
    const uint32_t first = qp_.requester.next_psn;
    const uint32_t answered = first + kPackets;
    post_write();
    post_answered(opcode);
    ASSERT_EQ(take_sent(), psns(first, answered));
    answer(answered, udp::aeth::kAck);
    EXPECT_EQ(take_sent(), std::vector<uint32_t>{answered}) << "the ACK tells the response was lost";
    EXPECT_EQ(time_out(), std::vector<uint32_t>{answered});
    EXPECT_EQ(time_out(), std::vector<uint32_t>{answered});
    respond(opcode, answered);
    EXPECT_TRUE(take_sent().empty());
    CompletionRing ring = memory_->completion_ring(memory_->shared().cqs[cq_]);
    Completion completion[3];
    ASSERT_EQ(ring.pop(completion), 2u);
    EXPECT_EQ(completion[0].status, WcStatus::Success);
    EXPECT_EQ(completion[1].status, WcStatus::Success);
    EXPECT_EQ(completion[1].opcode, opcode == SendOpcode::AtomicWrite ? WcOpcode::AtomicWrite : WcOpcode::FetchAdd);
    EXPECT_TRUE(qp_.requester.queue.empty());
  }
}

}  // namespace
}  // namespace softverbs
