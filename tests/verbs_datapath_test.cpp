// The data path through the installed libibverbs: every opcode and error
// status on real QPs, RNR waits, QP state changes, address handles.
//
// Started through `softverbs run` by ctest, on a shared-memory device, over
// UDP, with kernel copies and with the copy agent: the verbs_datapath_*_test
// files make one executable.
#include "verbs_datapath.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "task_state.h"

namespace {

using namespace softverbs::test;

TEST_P(DataPath, SendWithImmediateDeliversDataAndCompletions) {
  ibv_qp_type type = GetParam();
  connect(type);
  uint32_t header = type == IBV_QPT_UD ? 40 : 0;
  for (int i = 0; i < 100; ++i) buffer_a_[i] = static_cast<uint8_t>(i * 7);
  ASSERT_EQ(post_recv_b(77, 0, 200 + header), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND_WITH_IMM, 11, 0, 100), 0);
  auto sent = poll_n(cq_a_, 1);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(sent.size(), 1u);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(sent[0].wr_id, 11u);
  EXPECT_EQ(sent[0].opcode, IBV_WC_SEND);
  EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(received[0].wr_id, 77u);
  EXPECT_EQ(received[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(received[0].byte_len, 100u + header);
  EXPECT_TRUE(received[0].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(ntohl(received[0].imm_data), 0xabcd0123u);
  EXPECT_EQ(received[0].qp_num, qp_b_->qp_num);
  EXPECT_EQ(received[0].src_qp, qp_a_->qp_num);
  EXPECT_EQ(std::memcmp(buffer_b_.data() + header, buffer_a_.data(), 100), 0);
  EXPECT_EQ(buffer_b_[header + 100], 0) << "nothing written past the message";
  if (type == IBV_QPT_UD) {
    // Between IPv4 RoCE v2 GIDs, the IPv4 header sits in the last 20 bytes
    // of the 40-byte GRH area, as RoCE NICs leave it.
    EXPECT_TRUE(received[0].wc_flags & IBV_WC_GRH);
    EXPECT_EQ(buffer_b_[20], 0x45) << "IPv4, 20-byte header";
    EXPECT_EQ(buffer_b_[20 + 9], 17) << "protocol UDP";
    EXPECT_EQ(std::memcmp(buffer_b_.data() + 20 + 12, "\x7f\x00\x00\x01", 4), 0) << "source 127.0.0.1";
  }
}

TEST_P(DataPath, ZeroLengthSend) {
  connect(GetParam());
  ASSERT_EQ(post_recv_b(1, 0, 64), 0);
  ibv_send_wr wr{};
  wr.wr_id = 5;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (GetParam() == IBV_QPT_UD) {
    wr.wr.ud.ah = ah_;
    wr.wr.ud.remote_qpn = qp_b_->qp_num;
    wr.wr.ud.remote_qkey = kTestQkey;
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  auto sent = poll_n(cq_a_, 1);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(sent.size(), 1u);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(received[0].byte_len, GetParam() == IBV_QPT_UD ? 40u : 0u);
}

TEST_P(DataPath, PostSendBeforeRtsFailsWithEinval) {
  ibv_qp_type type = GetParam();
  qp_a_ = make_qp(type, cq_a_);
  ASSERT_NE(qp_a_, nullptr);
  qp_b_ = make_qp(type, cq_b_);
  EXPECT_EQ(post_a(IBV_WR_SEND, 1, 0, 8), EINVAL) << "RESET";
  ASSERT_EQ(to_init(qp_a_, type, kAllAccess), 0);
  EXPECT_EQ(post_a(IBV_WR_SEND, 1, 0, 8), EINVAL) << "INIT";
  ASSERT_EQ(to_rtr(qp_a_, type, qp_b_->qp_num), 0);
  EXPECT_EQ(post_a(IBV_WR_SEND, 1, 0, 8), EINVAL) << "RTR";
  EXPECT_TRUE(poll_n(cq_a_, 1, std::chrono::milliseconds(100)).empty()) << "a refused post completes nothing";
}

TEST_P(DataPath, OpcodesTheQpTypeDoesNotSupportAreRefused) {
  ibv_qp_type type = GetParam();
  connect(type);
  int read_result = post_a(IBV_WR_RDMA_READ, 1, 0, 8, addr_b(0), mr_b_->rkey);
  EXPECT_EQ(read_result, type == IBV_QPT_RC ? 0 : EINVAL);
  int write_result = post_a(IBV_WR_RDMA_WRITE, 2, 0, 8, addr_b(0), mr_b_->rkey);
  EXPECT_EQ(write_result, type == IBV_QPT_UD ? EINVAL : 0);
}

TEST_P(DataPath, LocalSgeOutsideItsRegionIsALocalProtectionError) {
  connect(GetParam());
  ASSERT_EQ(post_recv_b(1, 0, 4096), 0);
  // 16 bytes past the end of mr_a.
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data() + buffer_a_.size() - 16), 32, mr_a_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 9;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (GetParam() == IBV_QPT_UD) {
    wr.wr.ud.ah = ah_;
    wr.wr.ud.remote_qpn = qp_b_->qp_num;
    wr.wr.ud.remote_qkey = kTestQkey;
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  auto sent = poll_n(cq_a_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(sent[0].wr_id, 9u);
  EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(100)).empty()) << "nothing arrived";
}

INSTANTIATE_TEST_SUITE_P(QpTypes, DataPath, ::testing::Values(IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD),
                         [](const auto& info) {
                           return std::string(info.param == IBV_QPT_RC ? "RC" : info.param == IBV_QPT_UC ? "UC" : "UD");
                         });

TEST_F(RcDataPath, RdmaWriteAndReadMoveBytesWithoutTheTarget) {
  connect(IBV_QPT_RC);
  for (int i = 0; i < 512; ++i) buffer_a_[i] = static_cast<uint8_t>(255 - i);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 512, addr_b(1024), mr_b_->rkey), 0);
  auto wrote = poll_n(cq_a_, 1);
  ASSERT_EQ(wrote.size(), 1u);
  EXPECT_EQ(wrote[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(wrote[0].opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(std::memcmp(buffer_b_.data() + 1024, buffer_a_.data(), 512), 0);
  EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(100)).empty())
      << "a plain WRITE completes nothing at the target";

  std::memset(buffer_b_.data() + 4096, 0x5c, 300);
  ASSERT_EQ(post_a(IBV_WR_RDMA_READ, 2, 2048, 300, addr_b(4096), mr_b_->rkey), 0);
  auto read = poll_n(cq_a_, 1);
  ASSERT_EQ(read.size(), 1u);
  EXPECT_EQ(read[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(read[0].opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(read[0].byte_len, 300u);
  for (int i = 0; i < 300; ++i) ASSERT_EQ(buffer_a_[2048 + i], 0x5c) << i;
}

TEST_F(RcDataPath, WriteWithImmediateConsumesAReceive) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_recv_b(42, 0, 0), 0);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE_WITH_IMM, 3, 0, 64, addr_b(256), mr_b_->rkey), 0);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(received[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(received[0].wr_id, 42u);
  EXPECT_EQ(received[0].byte_len, 64u);
  EXPECT_EQ(ntohl(received[0].imm_data), 0xabcd0123u);
  EXPECT_EQ(poll_n(cq_a_, 1).size(), 1u);
}

// A zero-length RDMA operation touches no memory and checks no key (IBA
// C9-88), as UCX's rc_verbs flush expects: an inline WRITE of nothing,
// rkey 0, no SGE. The QP's own access rights still apply.
TEST_F(RcDataPath, AZeroLengthRdmaOperationChecksNoKey) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_recv_b(7, 0, 0), 0);
  for (ibv_wr_opcode opcode : {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE_WITH_IMM}) {
    ibv_send_wr wr{};
    wr.wr_id = 100 + opcode;
    wr.opcode = opcode;
    wr.num_sge = 0;
    wr.send_flags = IBV_SEND_SIGNALED | (opcode == IBV_WR_RDMA_READ ? 0 : IBV_SEND_INLINE);
    wr.imm_data = htonl(5);
    wr.wr.rdma = {0, 0};  // no address, rkey 0
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
    auto done = poll_n(cq_a_, 1);
    ASSERT_EQ(done.size(), 1u);
    EXPECT_EQ(done[0].status, IBV_WC_SUCCESS) << "opcode " << opcode << ": " << ibv_wc_status_str(done[0].status);
  }
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u) << "the WRITE with immediate took a receive";
  EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(received[0].byte_len, 0u);
  EXPECT_EQ(received[0].wr_id, 7u);
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(ibv_query_qp(qp_a_, &attr, IBV_QP_STATE, &init), 0);
  EXPECT_EQ(attr.qp_state, IBV_QPS_RTS);
}

// A send WQE's room serves its SGEs or its inline bytes (rxe's rule): a QP
// created with no inline size sends 16 bytes inline per SGE, as
// rdma_xclient does, and one asked for more inline has SGEs to match.
TEST_F(RcDataPath, InlineRoomFollowsTheSgesAsOnRxe) {
  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = cq_a_;
  init.qp_type = IBV_QPT_RC;
  init.cap = {4, 4, 1, 1, 0};
  qp_a_ = ibv_create_qp(pd_, &init);
  ASSERT_NE(qp_a_, nullptr) << std::strerror(errno);
  EXPECT_EQ(init.cap.max_inline_data, 16u);
  EXPECT_EQ(init.cap.max_send_sge, 1u);
  ibv_qp_attr attr{};
  ibv_qp_init_attr queried{};
  ASSERT_EQ(ibv_query_qp(qp_a_, &attr, IBV_QP_CAP, &queried), 0);
  EXPECT_EQ(queried.cap.max_inline_data, 16u);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);

  ASSERT_EQ(post_recv_b(9, 0, 64), 0);
  std::array<uint8_t, 17> message{};  // not registered: inline bytes are read at post
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<uint8_t>(0xa0 + i);
  ibv_sge sge{reinterpret_cast<uint64_t>(message.data()), 16, 0};
  ibv_send_wr wr{};
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  message.fill(0);  // taken at post, as an HCA copies inline data into the WQE
  auto sent = poll_n(cq_a_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(received[0].byte_len, 16u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(buffer_b_[i], 0xa0 + i) << i;

  sge.length = 17;  // past the room
  EXPECT_EQ(ibv_post_send(qp_a_, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);

  init.cap = {4, 4, 1, 1, 100};
  ibv_qp* wide = ibv_create_qp(pd_, &init);
  ASSERT_NE(wide, nullptr) << std::strerror(errno);
  EXPECT_EQ(init.cap.max_inline_data, 100u);
  EXPECT_EQ(init.cap.max_send_sge, 6u);
  EXPECT_EQ(ibv_destroy_qp(wide), 0);
}

// Each atomic is executed once, whatever the link does to it (a lost
// response makes the requester ask again, and the responder answers that
// from the result it saved), and each completes, also right behind a WRITE
// whose ACK acknowledges past it. Run over UDP with loss and duplication by
// the ctest verbs_datapath_test_udp_atomic_write_faults.
TEST_F(RcDataPath, AtomicsBehindWritesAreExecutedOnceEach) {
  connect(IBV_QPT_RC);
  constexpr uint64_t kRounds = 40;
  std::memset(buffer_b_.data() + 64, 0, 8);
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data()), 8, mr_a_->lkey};
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.atomic.remote_addr = addr_b(64);
  wr.wr.atomic.rkey = mr_b_->rkey;
  ibv_send_wr* bad = nullptr;
  for (uint64_t round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 10, 1024, 4096, addr_b(1024), mr_b_->rkey), 0);
    // Adds 1, then swaps the sum for itself plus 100 if it is what it
    // must be: a FETCH_ADD done twice would fail the swap and the count.
    wr.wr_id = 11;
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.wr.atomic.compare_add = 1;
    ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
    auto done = poll_n(cq_a_, 2);
    ASSERT_EQ(done.size(), 2u);
    for (const ibv_wc& wc : done) ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    uint64_t original;
    std::memcpy(&original, buffer_a_.data(), 8);
    ASSERT_EQ(original, round * 101);
    wr.wr_id = 12;
    wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
    wr.wr.atomic.compare_add = round * 101 + 1;
    wr.wr.atomic.swap = (round + 1) * 101;
    ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
    done = poll_n(cq_a_, 1);
    ASSERT_EQ(done.size(), 1u);
    ASSERT_EQ(done[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(done[0].status);
    std::memcpy(&original, buffer_a_.data(), 8);
    ASSERT_EQ(original, round * 101 + 1) << "the swap saw the add once";
  }
  uint64_t value;
  std::memcpy(&value, buffer_b_.data() + 64, 8);
  EXPECT_EQ(value, kRounds * 101);
}

TEST_F(RcDataPath, AtomicsReturnTheOriginalValue) {
  connect(IBV_QPT_RC);
  uint64_t target = 40;
  std::memcpy(buffer_b_.data() + 64, &target, 8);
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data()), 8, mr_a_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.atomic.remote_addr = addr_b(64);
  wr.wr.atomic.rkey = mr_b_->rkey;
  wr.wr.atomic.compare_add = 2;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  auto done = poll_n(cq_a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(done[0].opcode, IBV_WC_FETCH_ADD);
  uint64_t value;
  std::memcpy(&value, buffer_a_.data(), 8);
  EXPECT_EQ(value, 40u);
  std::memcpy(&value, buffer_b_.data() + 64, 8);
  EXPECT_EQ(value, 42u);

  wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
  wr.wr.atomic.compare_add = 42;
  wr.wr.atomic.swap = 1000;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  done = poll_n(cq_a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].opcode, IBV_WC_COMP_SWAP);
  std::memcpy(&value, buffer_b_.data() + 64, 8);
  EXPECT_EQ(value, 1000u);
  wr.wr.atomic.compare_add = 7;  // no match: unchanged
  wr.wr.atomic.swap = 5;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  ASSERT_EQ(poll_n(cq_a_, 1).size(), 1u);
  std::memcpy(&value, buffer_b_.data() + 64, 8);
  EXPECT_EQ(value, 1000u);
  std::memcpy(&value, buffer_a_.data(), 8);
  EXPECT_EQ(value, 1000u) << "the original value comes back";
}

TEST_F(RcDataPath, BadRkeyIsARemoteAccessErrorAndTheRestIsFlushed) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_recv_b(99, 0, 64), 0);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 8, addr_b(0), mr_b_->rkey ^ 0x55), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 8), 0);
  auto done = poll_n(cq_a_, 2);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(done[0].wr_id, 1u);
  EXPECT_EQ(done[1].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(done[1].wr_id, 2u);
  ibv_qp_attr attr;
  ibv_qp_init_attr init;
  ASSERT_EQ(ibv_query_qp(qp_a_, &attr, IBV_QP_STATE, &init), 0);
  EXPECT_EQ(attr.qp_state, IBV_QPS_ERR);
}

// The NAK moves the QP to ERR on whichever thread reads it (over UDP, the
// io thread): a request posted while that happens is flushed like any other,
// never refused. Many rounds, so that some posts meet the transition.
TEST_F(RcDataPath, PostsThatMeetTheErrorTransitionAreFlushed) {
  connect(IBV_QPT_RC);
  for (int round = 0; round < 100; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 8, addr_b(0), mr_b_->rkey ^ 0x55), 0);
    int posted = 1;
    bool seen_error = false;
    while (posted < 14) {
      ASSERT_EQ(post_a(IBV_WR_SEND, static_cast<uint64_t>(posted) + 1, 0, 8), 0) << "send " << posted;
      ++posted;
      if (seen_error) break;  // one more, posted after ERR was visible
      ibv_qp_attr attr;
      ibv_qp_init_attr init;
      ASSERT_EQ(ibv_query_qp(qp_a_, &attr, IBV_QP_STATE, &init), 0);
      seen_error = attr.qp_state == IBV_QPS_ERR;
    }
    auto done = poll_n(cq_a_, posted);
    ASSERT_EQ(done.size(), static_cast<size_t>(posted));
    EXPECT_EQ(done[0].status, IBV_WC_REM_ACCESS_ERR);
    for (int i = 1; i < posted; ++i) {
      EXPECT_EQ(done[i].wr_id, static_cast<uint64_t>(i) + 1);
      EXPECT_EQ(done[i].status, IBV_WC_WR_FLUSH_ERR);
    }
    ibv_qp_attr reset{};
    reset.qp_state = IBV_QPS_RESET;
    ASSERT_EQ(ibv_modify_qp(qp_a_, &reset, IBV_QP_STATE), 0);
    ASSERT_EQ(ibv_modify_qp(qp_b_, &reset, IBV_QP_STATE), 0);
    bring_up(IBV_QPT_RC);
  }
}

TEST_F(RcDataPath, RemoteRangeAndRightsAreEnforced) {
  connect(IBV_QPT_RC, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);  // QP B allows no remote read
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 16, addr_b(8192 - 8), mr_b_->rkey), 0);
  auto done = poll_n(cq_a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, IBV_WC_REM_ACCESS_ERR) << "8 bytes past the region";
}

TEST_F(RcDataPath, ReadOnAQpWithoutRemoteReadAccess) {
  connect(IBV_QPT_RC, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ASSERT_EQ(post_a(IBV_WR_RDMA_READ, 1, 0, 16, addr_b(0), mr_b_->rkey), 0);
  auto done = poll_n(cq_a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, IBV_WC_REM_ACCESS_ERR);
}

// The FLUSH rights (rdma-core 45+, 1 << 8 and 1 << 9) are taken in a QP's
// access flags, as HCAs without FLUSH take them (rdma-core 56's pyverbs sets
// them on every extended RC QP); a bit no verbs release defines is refused.
TEST_F(RcDataPath, QpAccessFlagsTakeTheFlushRightsAndRefuseUnknownBits) {
  constexpr int kFlushGlobal = 1 << 8, kFlushPersistent = 1 << 9;
  qp_a_ = make_qp(IBV_QPT_RC, cq_a_);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  ASSERT_TRUE(qp_a_ && qp_b_);
  ASSERT_EQ(to_init(qp_a_, IBV_QPT_RC, kAllAccess | kFlushGlobal | kFlushPersistent), 0);
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(ibv_query_qp(qp_a_, &attr, IBV_QP_ACCESS_FLAGS, &init), 0);
  EXPECT_EQ(attr.qp_access_flags, kAllAccess | kFlushGlobal | kFlushPersistent);
  EXPECT_EQ(to_init(qp_b_, IBV_QPT_RC, kAllAccess | (1 << 12)), EINVAL);
}

TEST_F(RcDataPath, RegionWithoutRemoteWriteRefusesWrites) {
  connect(IBV_QPT_RC);
  ibv_mr* read_only = ibv_reg_mr(pd_, buffer_b_.data(), 4096, IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(read_only, nullptr);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 16, addr_b(0), read_only->rkey), 0);
  auto done = poll_n(cq_a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(ibv_dereg_mr(read_only), 0);
}

TEST_F(RcDataPath, ReceiveTooSmall) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_recv_b(5, 0, 16), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 6, 0, 64), 0);
  auto received = poll_n(cq_b_, 1);
  auto sent = poll_n(cq_a_, 1);
  ASSERT_EQ(received.size(), 1u);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(received[0].status, IBV_WC_LOC_LEN_ERR);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_INV_REQ_ERR);
}

TEST_F(RcDataPath, RnrRetryZeroFailsAtOnce) {
  connect(IBV_QPT_RC, kAllAccess, /*rnr_retry=*/0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 8), 0);
  auto sent = poll_n(cq_a_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
}

TEST_F(RcDataPath, InfiniteRnrRetryWaitsForTheReceive) {
  connect(IBV_QPT_RC, kAllAccess, /*rnr_retry=*/7);
  buffer_a_[0] = 0x42;
  ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 8), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 8), 0);  // queued behind the first: order is kept
  ibv_wc wc;
  EXPECT_EQ(ibv_poll_cq(cq_a_, 1, &wc), 0) << "still waiting for a receive";
  ASSERT_EQ(post_recv_b(10, 0, 8), 0);
  ASSERT_EQ(post_recv_b(11, 8, 8), 0);
  auto sent = poll_n(cq_a_, 2);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[0].wr_id, 1u);
  EXPECT_EQ(sent[1].wr_id, 2u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  auto received = poll_n(cq_b_, 2);
  ASSERT_EQ(received.size(), 2u);
  EXPECT_EQ(buffer_b_[0], 0x42);
}

TEST_F(RcDataPath, QueuedSendsKeepTheirOwnRnrBudget) {
  // rnr_retry 7 is infinite for every send, including those that waited in
  // the queue behind another and meet "receiver not ready" later.
  connect(IBV_QPT_RC, kAllAccess, /*rnr_retry=*/7);
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_EQ(post_a(IBV_WR_SEND, i, 0, 8), 0);
  ASSERT_EQ(post_recv_b(10, 0, 8), 0);
  auto first = poll_n(cq_a_, 1);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].status, IBV_WC_SUCCESS);
  EXPECT_TRUE(poll_n(cq_a_, 1, std::chrono::milliseconds(50)).empty()) << "the others wait, without error";
  ASSERT_EQ(post_recv_b(11, 8, 8), 0);
  ASSERT_EQ(post_recv_b(12, 16, 8), 0);
  auto rest = poll_n(cq_a_, 2);
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rest[1].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rest[1].wr_id, 3u);
}

TEST_F(RcDataPath, RnrDelayedSendCompletesWhileTheSenderSleepsOnItsChannel) {
  ibv_comp_channel* channel = ibv_create_comp_channel(context_);
  ASSERT_NE(channel, nullptr);
  ibv_cq* evented = ibv_create_cq(context_, 8, nullptr, channel, 0);
  ASSERT_NE(evented, nullptr);
  qp_a_ = make_qp(IBV_QPT_RC, evented);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  ASSERT_EQ(ibv_req_notify_cq(evented, 0), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 9, 0, 8), 0);  // no receive yet: RNR
  // The receive arrives later, from another thread, once this one sleeps
  // on its channel (ibv_get_cq_event reads it with recvmsg; over UDP it
  // waits in ppoll on the channel and the device's sockets first).
  const pid_t sender = gettid();
  std::thread late_receiver([&] {
    const auto asleep_in_recvmsg = [&] { return sleeps_in(sender, SYS_recvmsg); };
    EXPECT_TRUE(wait_until_sleeping_in(sender, SYS_ppoll, asleep_in_recvmsg) || asleep_in_recvmsg());
    EXPECT_EQ(post_recv_b(1, 0, 8), 0);
  });
  ibv_cq* event_cq = nullptr;
  void* event_context = nullptr;
  EXPECT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), 0);
  late_receiver.join();
  ibv_ack_cq_events(evented, 1);
  auto sent = poll_n(evented, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].wr_id, 9u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(evented), 0);
  EXPECT_EQ(ibv_destroy_comp_channel(channel), 0);
}

TEST_F(RcDataPath, ModifyQpEnforcesTheSpecRules) {
  qp_a_ = make_qp(IBV_QPT_RC, cq_a_);
  ASSERT_NE(qp_a_, nullptr);
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  EXPECT_EQ(ibv_modify_qp(qp_a_, &attr, IBV_QP_STATE), EINVAL) << "RESET->INIT needs pkey, port, access";
  attr.qp_state = IBV_QPS_RTS;
  EXPECT_EQ(ibv_modify_qp(qp_a_, &attr, IBV_QP_STATE), EINVAL) << "RESET->RTS does not exist";
  ASSERT_EQ(to_init(qp_a_, IBV_QPT_RC, 0), 0);
  attr = {};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 2;
  EXPECT_EQ(ibv_modify_qp(qp_a_, &attr, IBV_QP_STATE | IBV_QP_PORT), EINVAL) << "no port 2";
  ibv_qp_init_attr init;
  ASSERT_EQ(ibv_query_qp(qp_a_, &attr, IBV_QP_STATE, &init), 0);
  EXPECT_EQ(attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(init.cap.max_send_wr, 16u);
}

TEST_F(RcDataPath, ResetRemovesTheQpsCompletionsFromItsCqs) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 8, addr_b(0), mr_b_->rkey), 0);
  ibv_qp_attr reset{};
  reset.qp_state = IBV_QPS_RESET;
  ASSERT_EQ(ibv_modify_qp(qp_a_, &reset, IBV_QP_STATE), 0);
  EXPECT_TRUE(poll_n(cq_a_, 1, std::chrono::milliseconds(100)).empty());
  // The QP is usable again after a new connect sequence.
  ASSERT_EQ(to_init(qp_a_, IBV_QPT_RC, kAllAccess), 0);
  ASSERT_EQ(to_rtr(qp_a_, IBV_QPT_RC, qp_b_->qp_num), 0);
  ASSERT_EQ(to_rts(qp_a_, IBV_QPT_RC), 0);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 2, 0, 8, addr_b(0), mr_b_->rkey), 0);
  auto done = poll_n(cq_a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].wr_id, 2u);
}

// A datagram that finds no receive posted is dropped; the sender's
// completion is a success all the same, and the next datagram is taken.
// (Over UDP ud_no_receive_dropped counts it: udp_tools_test.)
TEST_F(DataPath, AUdDatagramThatFindsNoReceiveIsDroppedAndTheNextIsTaken) {
  connect(IBV_QPT_UD);
  ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 16), 0);
  auto sent = poll_n(cq_a_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  // The receiver takes it in (and drops it) while polling: over UDP the
  // sender's completion comes as the datagram is sent, not as it is taken.
  EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(100)).empty());
  ASSERT_EQ(post_recv_b(7, 0, 128), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 24), 0);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].wr_id, 7u);
  EXPECT_EQ(received[0].byte_len, 40u + 24u) << "the second datagram, not the first";
  EXPECT_EQ(poll_n(cq_a_, 1).size(), 1u);
  ibv_wc extra{};
  EXPECT_EQ(ibv_poll_cq(cq_b_, 1, &extra), 0);
}

TEST_F(DataPath, AddressHandleFromAWorkCompletion) {
  connect(IBV_QPT_UD);
  ASSERT_EQ(post_recv_b(1, 0, 128), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 16), 0);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  ASSERT_TRUE(received[0].wc_flags & IBV_WC_GRH);
  // What a RoCE HCA reports for a RoCE v2 packet over IPv4 (the GIDs here
  // are 127.0.0.1's): the packet type in wc.sl, as mlx5 does and UCX's UD
  // transport reads it, and the IPv4 header in the last 20 bytes of the
  // 40-byte GRH area (RoCE annex A17.4.5.1), its destination at the end.
  EXPECT_EQ(received[0].sl, 0xa) << "bit 3: RoCE v2 (UDP); 2: IPv4";
  EXPECT_EQ(buffer_b_[20], 0x45) << "an IPv4 header of 20 bytes";
  const uint8_t loopback[4] = {127, 0, 0, 1};
  EXPECT_EQ(std::memcmp(buffer_b_.data() + 36, loopback, 4), 0);
  ibv_ah* reply = ibv_create_ah_from_wc(pd_, &received[0], reinterpret_cast<ibv_grh*>(buffer_b_.data()), 1);
  ASSERT_NE(reply, nullptr) << std::strerror(errno);
  EXPECT_EQ(ibv_destroy_ah(reply), 0);
}

}  // namespace
