// The data path through the installed libibverbs: every opcode and error
// status on real QPs. Started through `softverbs run` by ctest.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "qp_setup.h"
#include "rc_endpoint.h"

namespace {

using namespace softverbs::test;

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// Polls until `n` completions arrived or `patience` passed. The data path
// completes within the posting call, so checks for absence use a short wait.
std::vector<ibv_wc> poll_n(ibv_cq* cq, int n, std::chrono::milliseconds patience = std::chrono::seconds(5)) {
  std::vector<ibv_wc> out;
  auto deadline = std::chrono::steady_clock::now() + patience;
  while (static_cast<int>(out.size()) < n && std::chrono::steady_clock::now() < deadline) {
    ibv_wc wc[8];
    int got = ibv_poll_cq(cq, 8, wc);
    for (int i = 0; i < got; ++i) out.push_back(wc[i]);
    if (got == 0) std::this_thread::yield();
  }
  return out;
}

class DataPath : public ::testing::TestWithParam<ibv_qp_type> {
 protected:
  void SetUp() override {
    context_ = open_softverbs0();
    ASSERT_NE(context_, nullptr);
    pd_ = ibv_alloc_pd(context_);
    ASSERT_NE(pd_, nullptr);
    cq_a_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    cq_b_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    ASSERT_TRUE(cq_a_ && cq_b_);
    buffer_a_.assign(8192, 0);
    buffer_b_.assign(8192, 0);
    mr_a_ = ibv_reg_mr(pd_, buffer_a_.data(), buffer_a_.size(), kAllAccess);
    mr_b_ = ibv_reg_mr(pd_, buffer_b_.data(), buffer_b_.size(), kAllAccess);
    ASSERT_TRUE(mr_a_ && mr_b_);
  }
  void TearDown() override {
    for (ibv_qp* qp : {qp_a_, qp_b_})
      if (qp) {
        EXPECT_EQ(ibv_destroy_qp(qp), 0);
      }
    if (ah_) ibv_destroy_ah(ah_);
    for (ibv_mr* mr : {mr_a_, mr_b_})
      if (mr) {
        EXPECT_EQ(ibv_dereg_mr(mr), 0);
      }
    for (ibv_cq* cq : {cq_a_, cq_b_})
      if (cq) {
        EXPECT_EQ(ibv_destroy_cq(cq), 0);
      }
    if (pd_) {
      EXPECT_EQ(ibv_dealloc_pd(pd_), 0);
    }
    if (context_) {
      EXPECT_EQ(ibv_close_device(context_), 0);
    }
  }

  ibv_qp* make_qp(ibv_qp_type type, ibv_cq* cq) {
    ibv_qp_init_attr init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = type;
    init.cap = {16, 16, 4, 4, 64};
    return ibv_create_qp(pd_, &init);
  }

  // Takes qp_a_ and qp_b_ (already created) through INIT, RTR and RTS,
  // connected to each other.
  void bring_up(ibv_qp_type type, int access_b = kAllAccess, uint8_t rnr_retry = 7) {
    ASSERT_TRUE(qp_a_ && qp_b_);
    ASSERT_EQ(to_init(qp_a_, type, kAllAccess), 0);
    ASSERT_EQ(to_init(qp_b_, type, access_b), 0);
    ASSERT_EQ(to_rtr(qp_a_, type, qp_b_->qp_num), 0);
    ASSERT_EQ(to_rtr(qp_b_, type, qp_a_->qp_num), 0);
    RcTiming timing;
    timing.rnr_retry = rnr_retry;
    ASSERT_EQ(to_rts(qp_a_, type, 0, timing), 0);
    ASSERT_EQ(to_rts(qp_b_, type, 0, timing), 0);
  }

  // An RC pair whose B side is created from `b_init` (its own CQs or SRQ).
  void connect_rc_with(ibv_qp_init_attr b_init, ibv_cq* a_cq = nullptr) {
    qp_a_ = make_qp(IBV_QPT_RC, a_cq ? a_cq : cq_a_);
    b_init.qp_type = IBV_QPT_RC;
    qp_b_ = ibv_create_qp(pd_, &b_init);
    bring_up(IBV_QPT_RC);
  }

  // Two QPs of `type` connected to each other, both in RTS.
  void connect(ibv_qp_type type, int access_b = kAllAccess, uint8_t rnr_retry = 7) {
    qp_a_ = make_qp(type, cq_a_);
    qp_b_ = make_qp(type, cq_b_);
    bring_up(type, access_b, rnr_retry);
    if (type == IBV_QPT_UD) {
      ibv_ah_attr ah{};
      ah.port_num = 1;
      ah.is_global = 1;
      int gid_index = ipv4_gid_index(context_, &ah.grh.dgid);
      ASSERT_GE(gid_index, 0);
      ah.grh.sgid_index = static_cast<uint8_t>(gid_index);
      ah_ = ibv_create_ah(pd_, &ah);
      ASSERT_NE(ah_, nullptr);
    }
  }

  // A receive into buffer_b_, on qp_b_'s own queue or on `srq`.
  int post_recv_b(uint64_t wr_id, uint32_t offset, uint32_t length, ibv_srq* srq = nullptr) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_b_.data() + offset), length, mr_b_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return srq != nullptr ? ibv_post_srq_recv(srq, &wr, &bad) : ibv_post_recv(qp_b_, &wr, &bad);
  }

  int post_a(ibv_wr_opcode opcode, uint64_t wr_id, uint32_t offset, uint32_t length, uint64_t remote = 0,
             uint32_t rkey = 0, uint32_t lkey = 0, uint32_t immediate = 0xabcd0123) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data() + offset), length, lkey ? lkey : mr_a_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(immediate);
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = rkey;
    if (qp_a_->qp_type == IBV_QPT_UD) {
      wr.wr.ud.ah = ah_;
      wr.wr.ud.remote_qpn = qp_b_->qp_num;
      wr.wr.ud.remote_qkey = kTestQkey;
    }
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(qp_a_, &wr, &bad);
  }

  uint64_t addr_b(uint32_t offset) { return reinterpret_cast<uint64_t>(buffer_b_.data() + offset); }

  // An SRQ of `max_wr` WQEs and an RC pair whose B side takes its receives
  // from it; null (with a failure recorded) if either cannot be made.
  ibv_srq* connect_rc_on_srq(uint32_t max_wr) {
    ibv_srq_init_attr srq_init{};
    srq_init.attr = {max_wr, 1, 0};
    ibv_srq* srq = ibv_create_srq(pd_, &srq_init);
    EXPECT_NE(srq, nullptr) << std::strerror(errno);
    if (srq == nullptr) return nullptr;
    ibv_qp_init_attr init{};
    init.send_cq = cq_b_;
    init.recv_cq = cq_b_;
    init.srq = srq;
    init.cap = {4, 0, 1, 0, 0};
    connect_rc_with(init);
    return srq;
  }

  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_a_ = nullptr;
  ibv_cq* cq_b_ = nullptr;
  ibv_qp* qp_a_ = nullptr;
  ibv_qp* qp_b_ = nullptr;
  ibv_ah* ah_ = nullptr;
  ibv_mr* mr_a_ = nullptr;
  ibv_mr* mr_b_ = nullptr;
  std::vector<uint8_t> buffer_a_, buffer_b_;
};

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

class RcDataPath : public DataPath {};

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
  // The receive arrives later, from another thread; this one only sleeps.
  std::thread late_receiver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
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

TEST_F(RcDataPath, RegistrationRules) {
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, buffer_a_.data(), 64, IBV_ACCESS_REMOTE_WRITE), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, buffer_a_.data(), 64, IBV_ACCESS_REMOTE_ATOMIC), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_mr* ok = ibv_reg_mr(pd_, buffer_a_.data(), 64, IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(ok, nullptr);
  EXPECT_NE(ok->lkey, mr_a_->lkey);
  EXPECT_EQ(ibv_dereg_mr(ok), 0);
}

// An HCA pins the pages with the access asked for, so memory it could not
// pin is refused at registration (EFAULT; EINVAL for a range that wraps)
// rather than found out when a peer's WRITE lands on it.
TEST_F(RcDataPath, RegistrationRefusesMemoryAnHcaCouldNotPin) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* area = mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(area, MAP_FAILED);
  auto* bytes = static_cast<uint8_t*>(area);
  ASSERT_EQ(munmap(bytes + 2 * page, page), 0);           // a hole after two pages
  ASSERT_EQ(mprotect(bytes + page, page, PROT_READ), 0);  // the second page read-only
  struct Case {
    const char* what;
    void* address;
    size_t length;
    int access;
    int error;  // 0: accepted
  };
  const Case cases[] = {
      {"unmapped memory", bytes + 2 * page, page, 0, EFAULT},
      {"a range running into unmapped memory", bytes + page, 2 * page, IBV_ACCESS_REMOTE_READ, EFAULT},
      {"read-only memory with local write", bytes + page, page, IBV_ACCESS_LOCAL_WRITE, EFAULT},
      {"read-only memory with remote write", bytes + page, page, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
       EFAULT},
      {"writable and read-only pages with remote atomic", bytes, 2 * page,
       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC, EFAULT},
      {"a range that wraps past 2^64", reinterpret_cast<void*>(UINTPTR_MAX - page + 1), 2 * page, 0, EINVAL},
      {"read-only memory for remote reads", bytes + page, page, IBV_ACCESS_REMOTE_READ, 0},
      {"read-only memory for local reads", bytes + page, page, 0, 0},
      {"writable memory with every right", bytes, page, kAllAccess, 0},
  };
  for (const Case& c : cases) {
    errno = 0;
    ibv_mr* mr = ibv_reg_mr(pd_, c.address, c.length, c.access);
    if (c.error == 0) {
      EXPECT_NE(mr, nullptr) << c.what << ": " << std::strerror(errno);
      if (mr) {
        EXPECT_EQ(ibv_dereg_mr(mr), 0);
      }
    } else {
      EXPECT_EQ(mr, nullptr) << c.what;
      EXPECT_EQ(errno, c.error) << c.what;
      if (mr) ibv_dereg_mr(mr);
    }
  }
  munmap(bytes, 2 * page);
}

// An HCA refuses to free a PD that still has MRs, QPs, SRQs or AHs (EBUSY),
// and the PD stays usable.
TEST_F(RcDataPath, AProtectionDomainInUseIsBusyAndStaysUsable) {
  ibv_pd* pd = ibv_alloc_pd(context_);
  ASSERT_NE(pd, nullptr);
  ibv_mr* mr = ibv_reg_mr(pd, buffer_a_.data(), 64, 0);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with an MR";
  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = cq_a_;
  init.qp_type = IBV_QPT_RC;
  init.cap = {1, 1, 1, 1, 0};
  ibv_qp* qp = ibv_create_qp(pd, &init);
  ASSERT_NE(qp, nullptr) << "the PD is still usable";
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with a QP";
  ASSERT_EQ(ibv_destroy_qp(qp), 0);
  ibv_srq_init_attr srq_init{};
  srq_init.attr = {4, 1, 0};
  ibv_srq* srq = ibv_create_srq(pd, &srq_init);
  ASSERT_NE(srq, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with an SRQ";
  ASSERT_EQ(ibv_destroy_srq(srq), 0);
  ibv_ah_attr ah_attr{};
  ah_attr.port_num = 1;
  ah_attr.is_global = 1;
  const int gid_index = ipv4_gid_index(context_, &ah_attr.grh.dgid);
  ASSERT_GE(gid_index, 0);
  ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
  ibv_ah* ah = ibv_create_ah(pd, &ah_attr);
  ASSERT_NE(ah, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with an AH";
  ASSERT_EQ(ibv_destroy_ah(ah), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0) << "once nothing uses it";
}

// As large a CQ as mlx5 allows (libfabric's ofi_rxm asks for universe size
// times queue depth), without committing memory for entries not yet used.
TEST_F(RcDataPath, TheLargestCqCommitsMemoryOnlyAsCompletionsArrive) {
  ibv_device_attr attr{};
  ASSERT_EQ(ibv_query_device(context_, &attr), 0);
  EXPECT_EQ(attr.max_cqe, (1 << 22) - 1);
  const char* runtime = std::getenv("SOFTVERBS_RUNTIME_DIR");
  ASSERT_NE(runtime, nullptr);
  const std::string device_file = std::string(runtime) + "/softverbs0.mem";
  const auto committed = [&] {
    struct stat info {};
    return stat(device_file.c_str(), &info) == 0 ? static_cast<uint64_t>(info.st_blocks) * 512 : UINT64_MAX;
  };
  for (int round = 0; round < 2; ++round) {  // the second reuses the first's freed ring
    const uint64_t before = committed();
    ibv_cq* big = ibv_create_cq(context_, attr.max_cqe, nullptr, nullptr, 0);
    ASSERT_NE(big, nullptr) << std::strerror(errno);
    EXPECT_GE(big->cqe, attr.max_cqe);
    const uint64_t after = committed();
    EXPECT_LT(after > before ? after - before : 0, uint64_t{1} << 20)
        << "round " << round << ": a 256 MiB ring committed";
    EXPECT_EQ(ibv_destroy_cq(big), 0);
  }
  errno = 0;
  EXPECT_EQ(ibv_create_cq(context_, attr.max_cqe + 1, nullptr, nullptr, 0), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(RcDataPath, CqInUseCannotBeDestroyed) {
  connect(IBV_QPT_RC);
  EXPECT_EQ(ibv_destroy_cq(cq_a_), EBUSY);
}

TEST_F(RcDataPath, SolicitedOnlyArmingWaitsForASolicitedMessage) {
  ibv_comp_channel* channel = ibv_create_comp_channel(context_);
  ASSERT_NE(channel, nullptr);
  ibv_cq* evented = ibv_create_cq(context_, 8, nullptr, channel, 0);
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = evented;
  init.cap = {4, 4, 1, 1, 0};
  connect_rc_with(init);
  ASSERT_EQ(ibv_req_notify_cq(evented, /*solicited_only=*/1), 0);
  ASSERT_EQ(post_recv_b(1, 0, 64), 0);
  ASSERT_EQ(post_recv_b(2, 64, 64), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 10, 0, 8), 0);  // not solicited: no event
  int flags = fcntl(channel->fd, F_GETFL);
  ASSERT_EQ(fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK), 0);
  ibv_cq* event_cq = nullptr;
  void* event_context = nullptr;
  EXPECT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), -1) << "no event for an unsolicited message";
  ibv_send_wr wr{};
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data()), 8, mr_a_->lkey};
  wr.wr_id = 11;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  ASSERT_EQ(fcntl(channel->fd, F_SETFL, flags), 0);
  ASSERT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), 0);
  EXPECT_EQ(event_cq, evented);
  ibv_ack_cq_events(evented, 1);
  EXPECT_EQ(poll_n(evented, 2).size(), 2u);
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(evented), 0);
  EXPECT_EQ(ibv_destroy_comp_channel(channel), 0);
}

TEST_F(RcDataPath, CompletionChannelWakesTheWaiter) {
  ibv_comp_channel* channel = ibv_create_comp_channel(context_);
  ASSERT_NE(channel, nullptr) << std::strerror(errno);
  ibv_cq* evented = ibv_create_cq(context_, 8, nullptr, channel, 0);
  ASSERT_NE(evented, nullptr);
  // B's receive completions go to the evented CQ.
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = evented;
  init.cap = {4, 4, 1, 1, 0};
  connect_rc_with(init);
  ASSERT_EQ(ibv_req_notify_cq(evented, 0), 0);
  ASSERT_EQ(post_recv_b(3, 0, 64), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 4, 0, 16), 0);
  ibv_cq* event_cq = nullptr;
  void* event_context = nullptr;
  ASSERT_EQ(ibv_get_cq_event(channel, &event_cq, &event_context), 0);
  EXPECT_EQ(event_cq, evented);
  ibv_ack_cq_events(event_cq, 1);
  auto received = poll_n(evented, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].wr_id, 3u);
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(evented), 0);
  EXPECT_EQ(ibv_destroy_comp_channel(channel), 0);
}

TEST_F(RcDataPath, SharedReceiveQueueFeedsSeveralQpsAndRaisesItsLimitEvent) {
  ibv_srq* srq = connect_rc_on_srq(8);
  ASSERT_NE(srq, nullptr);
  EXPECT_EQ(post_recv_b(1, 0, 8), EINVAL) << "a QP on an SRQ takes no receives of its own";
  for (uint32_t i = 0; i < 3; ++i) ASSERT_EQ(post_recv_b(100 + i, 64 * i, 64, srq), 0);
  ibv_srq_attr limit{};
  limit.srq_limit = 2;
  ASSERT_EQ(ibv_modify_srq(srq, &limit, IBV_SRQ_LIMIT), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 16), 0);  // 2 left: not below the limit
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 16), 0);  // 1 left: below
  auto received = poll_n(cq_b_, 2);
  ASSERT_EQ(received.size(), 2u);
  EXPECT_EQ(received[0].wr_id, 100u);
  EXPECT_EQ(received[1].wr_id, 101u);
  ibv_async_event event;
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
  EXPECT_EQ(event.element.srq, srq);
  ibv_ack_async_event(&event);
  ibv_srq_attr now{};
  ASSERT_EQ(ibv_query_srq(srq, &now), 0);
  EXPECT_EQ(now.srq_limit, 0u) << "the limit disarms when it fires";
  EXPECT_EQ(now.max_wr, 8u);
  EXPECT_EQ(ibv_destroy_srq(srq), EBUSY) << "a QP still uses it";
  // Moving the QP to ERR reports its last WQE.
  ibv_qp_attr error{};
  error.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(ibv_modify_qp(qp_b_, &error, IBV_QP_STATE), 0);
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_QP_LAST_WQE_REACHED);
  EXPECT_EQ(event.element.qp, qp_b_);
  ibv_ack_async_event(&event);
  // Once per move to ERR: not again from the UDP transport as it flushes
  // (UCX asserts on a second one), nor for a move from ERR to ERR.
  ASSERT_EQ(ibv_modify_qp(qp_b_, &error, IBV_QP_STATE), 0);
  pollfd more{context_->async_fd, POLLIN, 0};
  EXPECT_EQ(poll(&more, 1, 200), 0) << "a second asynchronous event";
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
}

TEST_F(RcDataPath, ResizingAnSrqKeepsItsQueuedReceivesInOrder) {
  ibv_srq* srq = connect_rc_on_srq(4);
  ASSERT_NE(srq, nullptr);
  auto post_srq = [&](uint64_t wr_id) { return post_recv_b(wr_id, static_cast<uint32_t>(64 * (wr_id % 16)), 64, srq); };
  // Three taken and three posted again first, so that the queue's head is
  // not at the start of its ring when it moves.
  for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(post_srq(100 + i), 0);
  EXPECT_EQ(post_srq(999), ENOMEM);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_a(IBV_WR_SEND, i, 0, 16), 0);
  ASSERT_EQ(poll_n(cq_b_, 3).size(), 3u);
  ASSERT_EQ(poll_n(cq_a_, 3).size(), 3u);
  for (uint64_t i = 4; i < 7; ++i) ASSERT_EQ(post_srq(100 + i), 0);
  ibv_srq_attr grow{};
  grow.max_wr = 16;
  ASSERT_EQ(ibv_modify_srq(srq, &grow, IBV_SRQ_MAX_WR), 0);
  for (uint64_t i = 7; i < 15; ++i) ASSERT_EQ(post_srq(100 + i), 0);
  for (uint64_t i = 0; i < 12; ++i) ASSERT_EQ(post_a(IBV_WR_SEND, 3 + i, 0, 16), 0) << i;
  auto received = poll_n(cq_b_, 12);
  ASSERT_EQ(received.size(), 12u);
  for (uint64_t i = 0; i < 12; ++i) {
    EXPECT_EQ(received[i].status, IBV_WC_SUCCESS) << i;
    EXPECT_EQ(received[i].wr_id, 103 + i) << "the moved receives first, in order, then the new ones";
  }
  EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(50)).empty());
  ASSERT_EQ(poll_n(cq_a_, 12).size(), 12u);
  ASSERT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
}

TEST_F(RcDataPath, ReceivesPostedFromTwoThreadsAreEachTakenOnceInOrder) {
  // ibv_post_recv is thread-safe: two threads fill one receive queue at the
  // same time, then SENDs drain it; twice, so that the ring wraps. Every
  // SEND lands in exactly one WQE, in the order they were sent, and each
  // thread's WQEs are used in the order it posted them.
  constexpr uint64_t kPerThread = 1000;
  ibv_cq* receive_cq = ibv_create_cq(context_, 2 * kPerThread, nullptr, nullptr, 0);
  ASSERT_NE(receive_cq, nullptr);
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = receive_cq;
  init.cap = {4, 3 * kPerThread / 2, 1, 1, 0};  // the second round wraps the ring
  connect_rc_with(init);
  uint64_t next_of[2] = {0, 0};
  for (uint32_t round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::atomic<int> ready{0};
    std::atomic<bool> failed{false};
    auto poster = [&](uint64_t thread) {
      ++ready;
      while (ready < 2) {
      }
      for (uint64_t i = round * kPerThread / 2; i < (round + 1) * kPerThread / 2; ++i)
        if (post_recv_b(thread << 32 | i, static_cast<uint32_t>(8 * thread), 8) != 0) failed = true;
    };
    std::thread first(poster, 0), second(poster, 1);
    first.join();
    second.join();
    ASSERT_FALSE(failed) << "a post failed";
    std::vector<ibv_wc> received;
    uint32_t sent = 0, send_completions = 0;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (received.size() < kPerThread && std::chrono::steady_clock::now() < deadline) {
      if (sent < kPerThread && sent - send_completions < 4) {
        ASSERT_EQ(post_a(IBV_WR_SEND_WITH_IMM, sent, 0, 8, 0, 0, 0, sent), 0);  // its number as immediate data
        ++sent;
      }
      ibv_wc wc[16];
      int got = ibv_poll_cq(cq_a_, 16, wc);
      for (int i = 0; i < got; ++i) EXPECT_EQ(wc[i].status, IBV_WC_SUCCESS);
      send_completions += static_cast<uint32_t>(std::max(got, 0));
      got = ibv_poll_cq(receive_cq, 16, wc);
      for (int i = 0; i < got; ++i) received.push_back(wc[i]);
    }
    ASSERT_EQ(received.size(), kPerThread);
    for (size_t k = 0; k < received.size(); ++k) {
      const ibv_wc& wc = received[k];
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << k;
      EXPECT_EQ(ntohl(wc.imm_data), k) << "SENDs land in the order they were sent";
      EXPECT_EQ(wc.byte_len, 8u);
      const uint64_t thread = wc.wr_id >> 32;
      ASSERT_LT(thread, 2u);
      EXPECT_EQ(wc.wr_id & 0xffffffffu, next_of[thread]++) << "each thread's WQEs once each, in its order";
    }
    EXPECT_EQ(next_of[0], (round + 1) * kPerThread / 2);
    EXPECT_EQ(next_of[1], (round + 1) * kPerThread / 2);
    while (send_completions < sent) {
      auto done = poll_n(cq_a_, 1);
      ASSERT_EQ(done.size(), 1u);
      ++send_completions;
    }
  }
  ASSERT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(receive_cq), 0);
}

TEST_F(RcDataPath, ReceivesPostedAcrossTheMoveToErrorOrResetAreFlushedOrGone) {
  // A thread posts receives while the QP moves to ERR (every WQE that was
  // accepted completes once, flushed) or to RESET (every one is gone: the
  // first SEND after the QP is connected again takes a WQE posted after).
  ibv_qp_init_attr init{};
  init.send_cq = cq_b_;
  init.recv_cq = cq_b_;
  init.cap = {4, 64, 1, 1, 0};  // room for every receive of a round
  connect_rc_with(init);
  constexpr uint64_t kPosts = 48;  // cq_b_ holds 64
  for (uint64_t round = 0; round < 40; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const bool to_error = round % 2 == 0;
    std::atomic<uint64_t> attempted{0};
    std::vector<uint64_t> accepted;
    std::thread poster([&] {
      for (uint64_t i = 0; i < kPosts; ++i) {
        if (post_recv_b(round << 32 | i, 0, 8) == 0) accepted.push_back(round << 32 | i);
        attempted = i + 1;
      }
    });
    // The move lands at a different point of the posts in each round.
    while (attempted < (round * 7) % kPosts) {
    }
    ibv_qp_attr attr{};
    attr.qp_state = to_error ? IBV_QPS_ERR : IBV_QPS_RESET;
    ASSERT_EQ(ibv_modify_qp(qp_b_, &attr, IBV_QP_STATE), 0);
    poster.join();
    if (to_error) {
      EXPECT_EQ(accepted.size(), kPosts) << "a QP in ERR takes receives and flushes them";
      auto flushed = poll_n(cq_b_, static_cast<int>(accepted.size()));
      ASSERT_EQ(flushed.size(), accepted.size());
      for (size_t k = 0; k < flushed.size(); ++k) {
        EXPECT_EQ(flushed[k].status, IBV_WC_WR_FLUSH_ERR);
        EXPECT_EQ(flushed[k].wr_id, accepted[k]) << "each accepted WQE once, in order";
      }
      attr.qp_state = IBV_QPS_RESET;
      ASSERT_EQ(ibv_modify_qp(qp_b_, &attr, IBV_QP_STATE), 0);
    }
    EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(1)).empty()) << "nothing more, nothing from RESET";
    // Connected again: the queue starts empty.
    attr.qp_state = IBV_QPS_RESET;
    ASSERT_EQ(ibv_modify_qp(qp_a_, &attr, IBV_QP_STATE), 0);
    poll_n(cq_a_, 64, std::chrono::milliseconds(1));
    bring_up(IBV_QPT_RC);
    ASSERT_EQ(post_recv_b(0xfeed, 0, 8), 0);
    ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 8), 0);
    auto received = poll_n(cq_b_, 1);
    ASSERT_EQ(received.size(), 1u);
    EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(received[0].wr_id, 0xfeedu) << "a WQE from before the reset took the SEND";
    ASSERT_EQ(poll_n(cq_a_, 1).size(), 1u);
  }
}

TEST_F(RcDataPath, SrqLimitsAreValidated) {
  ibv_srq_init_attr init{};
  init.attr = {0, 1, 0};
  EXPECT_EQ(ibv_create_srq(pd_, &init), nullptr);
  init.attr = {1u << 20, 1, 0};
  EXPECT_EQ(ibv_create_srq(pd_, &init), nullptr);
  init.attr = {4, 1, 5};
  EXPECT_EQ(ibv_create_srq(pd_, &init), nullptr) << "limit above max_wr";
}

TEST_F(RcDataPath, ExtendedQpAndCqApis) {
  ibv_cq_init_attr_ex cq_attr{};
  cq_attr.cqe = 16;
  cq_attr.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_IMM;
  ibv_cq_ex* cq_ex = ibv_create_cq_ex(context_, &cq_attr);
  ASSERT_NE(cq_ex, nullptr) << std::strerror(errno);
  ibv_cq_init_attr_ex timestamped = cq_attr;
  timestamped.wc_flags |= IBV_WC_EX_WITH_COMPLETION_TIMESTAMP;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(context_, &timestamped), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP) << "timestamps are not emulated";

  ibv_qp_init_attr_ex init{};
  init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  init.pd = pd_;
  init.send_cq = ibv_cq_ex_to_cq(cq_ex);
  init.recv_cq = ibv_cq_ex_to_cq(cq_ex);
  init.qp_type = IBV_QPT_RC;
  init.cap = {8, 8, 2, 2, 64};
  init.send_ops_flags = IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;
  qp_a_ = ibv_create_qp_ex(context_, &init);
  ASSERT_NE(qp_a_, nullptr) << std::strerror(errno);
  ibv_qp_ex* ex = ibv_qp_to_qp_ex(qp_a_);
  ASSERT_NE(ex, nullptr);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  ASSERT_EQ(post_recv_b(50, 0, 64), 0);

  const char text[] = "inline hello";
  ibv_wr_start(ex);
  ex->wr_id = 1;
  ex->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_write(ex, mr_b_->rkey, addr_b(1000));
  ibv_wr_set_sge(ex, mr_a_->lkey, reinterpret_cast<uint64_t>(buffer_a_.data()), 32);
  ex->wr_id = 2;
  ibv_wr_send_imm(ex, htonl(7));
  ibv_wr_set_inline_data(ex, const_cast<char*>(text), sizeof text);
  ASSERT_EQ(ibv_wr_complete(ex), 0);

  ibv_poll_cq_attr poll{};
  std::vector<std::pair<uint64_t, ibv_wc_status>> seen;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (seen.size() < 2 && std::chrono::steady_clock::now() < deadline) {
    if (ibv_start_poll(cq_ex, &poll) != 0) continue;
    do {
      seen.emplace_back(cq_ex->wr_id, cq_ex->status);
      EXPECT_EQ(ibv_wc_read_qp_num(cq_ex), qp_a_->qp_num);
    } while (ibv_next_poll(cq_ex) == 0);
    ibv_end_poll(cq_ex);
  }
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], std::make_pair(uint64_t{1}, IBV_WC_SUCCESS));
  EXPECT_EQ(seen[1], std::make_pair(uint64_t{2}, IBV_WC_SUCCESS));
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(buffer_b_.data())), text);
  EXPECT_EQ(ntohl(received[0].imm_data), 7u);

  // A setter with no work request open fails the batch at completion.
  ibv_wr_start(ex);
  ibv_wr_set_sge(ex, mr_a_->lkey, reinterpret_cast<uint64_t>(buffer_a_.data()), 8);
  EXPECT_EQ(ibv_wr_complete(ex), EINVAL);

  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(cq_ex)), 0);
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

TEST_F(RcDataPath, ResizeCqKeepsWaitingCompletions) {
  connect(IBV_QPT_RC);
  for (uint64_t i = 0; i < 5; ++i) ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, i, 0, 8, addr_b(0), mr_b_->rkey), 0);
  // Over UDP the completions come with the ACKs, from the background thread.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_EQ(ibv_resize_cq(cq_a_, 4), EINVAL) << "5 completions wait: they would not fit";
  ASSERT_EQ(ibv_resize_cq(cq_a_, 1000), 0);
  EXPECT_GE(cq_a_->cqe, 1000);
  auto done = poll_n(cq_a_, 5);
  ASSERT_EQ(done.size(), 5u);
  for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(done[i].wr_id, i);
}

TEST_F(RcDataPath, CqOverrunRaisesACqErrorEvent) {
  ibv_cq* tiny = ibv_create_cq(context_, 1, nullptr, nullptr, 0);
  ASSERT_NE(tiny, nullptr);
  qp_a_ = make_qp(IBV_QPT_RC, tiny);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, i, 0, 8, addr_b(0), mr_b_->rkey), 0);
  ibv_async_event event;
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_CQ_ERR);
  EXPECT_EQ(event.element.cq, tiny);
  ibv_ack_async_event(&event);
  ASSERT_EQ(ibv_get_async_event(context_, &event), 0);
  EXPECT_EQ(event.event_type, IBV_EVENT_QP_FATAL) << "the QP whose completion was lost";
  EXPECT_EQ(event.element.qp, qp_a_);
  ibv_ack_async_event(&event);
  EXPECT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = nullptr;
  EXPECT_EQ(ibv_destroy_cq(tiny), 0);
}

TEST_F(RcDataPath, ReregisteringChangesWhatTheKeyAllows) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 8, addr_b(0), mr_b_->rkey), 0);
  ASSERT_EQ(poll_n(cq_a_, 1).at(0).status, IBV_WC_SUCCESS);
  ASSERT_EQ(ibv_rereg_mr(mr_b_, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ),
            0);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 2, 0, 8, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(poll_n(cq_a_, 1).at(0).status, IBV_WC_REM_ACCESS_ERR) << "remote write was taken away";
  EXPECT_EQ(ibv_rereg_mr(mr_b_, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_REMOTE_WRITE),
            IBV_REREG_MR_ERR_CMD)
      << "remote write without local write";
}

TEST_F(RcDataPath, DeregisteringASourceUnderTrafficNeverReadsItAfterwards) {
  // 32 MiB of WRITEs (more than a UDP QP's window) from a region that is
  // deregistered and unmapped right after they are posted: whatever was not
  // sent by then must fail (LOC_PROT_ERR, then flushes) rather than read the
  // unmapped pages, which would kill this process. Several rounds, since
  // the deregistration races with the sending.
  constexpr size_t kChunk = 1 << 20;
  constexpr int kWrites = 32;
  const size_t bytes = kChunk * kWrites;
  void* target = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(target, MAP_FAILED);
  ibv_mr* target_mr = ibv_reg_mr(pd_, target, bytes, kAllAccess);
  ASSERT_NE(target_mr, nullptr);
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    for (ibv_qp** qp : {&qp_a_, &qp_b_})
      if (*qp) {
        ASSERT_EQ(ibv_destroy_qp(*qp), 0);
        *qp = nullptr;
      }
    connect(IBV_QPT_RC);
    void* source = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(source, MAP_FAILED);
    std::memset(source, 0x50 + round, bytes);
    ibv_mr* source_mr = ibv_reg_mr(pd_, source, bytes, kAllAccess);
    ASSERT_NE(source_mr, nullptr);
    for (int i = 0; i < kWrites; ++i) {
      ibv_sge sge{reinterpret_cast<uint64_t>(source) + i * kChunk, static_cast<uint32_t>(kChunk), source_mr->lkey};
      ibv_send_wr wr{};
      wr.wr_id = 100 + i;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(target) + i * kChunk;
      wr.wr.rdma.rkey = target_mr->rkey;
      ibv_send_wr* bad = nullptr;
      ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
    }
    // Idle for a while, so that the background thread (if the transport
    // has one) is the one sending when the region goes.
    std::this_thread::sleep_for(std::chrono::microseconds(300 * (round + 1)));
    ASSERT_EQ(ibv_dereg_mr(source_mr), 0);
    ASSERT_EQ(munmap(source, bytes), 0);
    auto done = poll_n(cq_a_, kWrites, std::chrono::seconds(20));
    ASSERT_EQ(done.size(), static_cast<size_t>(kWrites));
    int succeeded = 0;
    for (int i = 0; i < kWrites; ++i) {
      EXPECT_EQ(done[i].wr_id, 100u + i) << "in order";
      if (done[i].status == IBV_WC_SUCCESS) {
        EXPECT_EQ(succeeded, i) << "no success after a failure";
        ++succeeded;
        const auto* landed = static_cast<const uint8_t*>(target) + i * kChunk;
        EXPECT_TRUE(landed[0] == 0x50 + round && landed[kChunk - 1] == 0x50 + round) << "WRITE " << i;
      } else if (i == succeeded) {
        EXPECT_EQ(done[i].status, IBV_WC_LOC_PROT_ERR) << "the first failure";
      } else {
        EXPECT_EQ(done[i].status, IBV_WC_WR_FLUSH_ERR) << "the rest";
      }
    }
  }
  EXPECT_EQ(ibv_dereg_mr(target_mr), 0);
  munmap(target, bytes);
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

// A forked child gets its own copy of memory, registered or not, as with
// rdma-core and an HCA on a kernel that copies pinned pages at fork (5.13+).
// Registration may move a page-aligned buffer's pages into a memfd that
// peers map; neither the child's writes nor a later fork after
// deregistration (when the allocator hands the memory out again) may see
// anything else.
TEST(Fork, RegisteredAndDeregisteredMemoryIsAForkedChildsOwnCopy) {
  ibv_context* context = open_softverbs0();
  ASSERT_NE(context, nullptr);
  ibv_pd* pd = ibv_alloc_pd(context);
  ASSERT_NE(pd, nullptr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t length = 8 * page;
  void* raw = nullptr;
  ASSERT_EQ(posix_memalign(&raw, page, length), 0);
  auto* bytes = static_cast<uint8_t*>(raw);
  std::memset(bytes, 0x5a, length);
  ibv_mr* mr = ibv_reg_mr(pd, bytes, length, kAllAccess);
  ASSERT_NE(mr, nullptr);
  bytes[page + 1] = 0x11;  // written while registered
  auto fork_and_check = [&](const char* when) {
    pid_t child = fork();
    if (child == 0) {
      bool intact = bytes[0] == 0x5a && bytes[page + 1] == 0x11 && bytes[length - 1] == 0x5a;
      std::memset(bytes, 0x77, length);  // the child's own copy
      _exit(intact ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << when << ": " << describe_exit(status);
    EXPECT_EQ(bytes[0], 0x5a) << "the child wrote into the parent's memory " << when;
    EXPECT_EQ(bytes[length - 1], 0x5a) << "the child wrote into the parent's memory " << when;
  };
  fork_and_check("while registered");
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(bytes[0], 0x5a);
  EXPECT_EQ(bytes[page + 1], 0x11);
  EXPECT_EQ(bytes[length - 1], 0x5a);
  fork_and_check("after deregistration");
  // Registering the same buffer again works as the first time.
  mr = ibv_reg_mr(pd, bytes, length, kAllAccess);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  std::free(raw);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
  EXPECT_EQ(ibv_close_device(context), 0);
}

// The endpoints of the cross-process tests: an RC QP with a CQ of 8 and
// the caller's memory registered.
constexpr int kCrossProcessDepth = 4;
constexpr uint8_t kCrossProcessTimeout = 14;
constexpr uint8_t kCrossProcessRetries = 7;

// Posts one signaled work request of `length` bytes at `sink` (in the
// endpoint's memory) and waits for it.
ibv_wc_status run(Endpoint& endpoint, ibv_wr_opcode opcode, void* sink, uint32_t length, uint64_t remote, uint32_t rkey,
                  uint64_t compare_add = 0, uint64_t swap = 0) {
  ibv_sge sge{reinterpret_cast<uint64_t>(sink), length, endpoint.mr()->lkey};
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
    wr.wr.atomic = {remote, compare_add, swap, rkey};
  } else {
    wr.wr.rdma = {remote, rkey};
  }
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(endpoint.qp(), &wr, &bad) != 0) return IBV_WC_GENERAL_ERR;
  auto done = poll_n(endpoint.cq(), 1);
  return done.empty() ? IBV_WC_GENERAL_ERR : done[0].status;
}

// A child process with an Endpoint over `memory`: it sends its ConnectInfo,
// takes the parent's, connects, says 'r', then runs `body` (an exit code) once
// the parent's 'd' is readable or right away, as `body` wants (it gets the
// pipe to read from). Each side closes the pipe ends it does not use, so
// that a child that exits early is an end of file for the parent, not a
// hang; a child that hangs dies of SIGALRM, which the parent reports.
class ChildEndpoint {
 public:
  template <typename Body>
  ChildEndpoint(void* memory, size_t bytes, Body body) {
    int to_child[2], to_parent[2];
    if (pipe(to_child) != 0 || pipe(to_parent) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(to_child[1]);
      close(to_parent[0]);
      alarm(60);
      int code;
      {
        Endpoint self;
        if (!self.open(memory, bytes, kCrossProcessDepth)) _exit(10);
        ConnectInfo mine = self.info(), theirs{};
        if (write(to_parent[1], &mine, sizeof mine) != sizeof mine ||
            read(to_child[0], &theirs, sizeof theirs) != sizeof theirs)
          _exit(11);
        if (!self.connect(theirs, kCrossProcessTimeout, kCrossProcessRetries)) _exit(12);
        char ready = 'r';
        if (write(to_parent[1], &ready, 1) != 1) _exit(13);
        code = body(self, to_child[0]);
      }
      _exit(code);
    }
    close(to_child[0]);
    close(to_parent[1]);
    to_child_ = to_child[1];
    from_child_ = to_parent[0];
  }
  // On an early return, the child's fate explains it.
  ~ChildEndpoint() {
    if (to_child_ >= 0) close(to_child_);  // a child waiting for the parent reads an end of file
    if (from_child_ >= 0) close(from_child_);
    if (reaped_ || pid_ <= 0) return;
    int status = 0;
    if (waitpid(pid_, &status, 0) == pid_) ADD_FAILURE() << "child ended early: " << describe_exit(status);
  }
  // Exchanges ConnectInfos and connects `parent`; true once the child is ready.
  bool connect(Endpoint& parent, ConnectInfo& child) {
    ConnectInfo mine = parent.info();
    char ready;
    return pid_ > 0 && read(from_child_, &child, sizeof child) == sizeof child &&
           write(to_child_, &mine, sizeof mine) == sizeof mine &&
           parent.connect(child, kCrossProcessTimeout, kCrossProcessRetries) && read(from_child_, &ready, 1) == 1;
  }
  // Tells the child it may finish, and returns how it exited.
  int finish() {
    char done = 'd';
    if (write(to_child_, &done, 1) != 1) return -1;
    int status = 0;
    if (waitpid(pid_, &status, 0) != pid_) return -1;
    reaped_ = true;
    return status;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  bool reaped_ = false;
};

// Two processes: the child registers memory and waits; the parent writes,
// reads and runs atomics on it, and the child checks what arrived.
TEST(CrossProcess, OneSidedOperationsNeedNothingFromTheTarget) {
  std::vector<uint64_t> memory(64, 7);
  ChildEndpoint child(memory.data(), memory.size() * 8, [&](Endpoint&, int from_parent) {
    char done;
    if (read(from_parent, &done, 1) != 1) return 14;  // the parent worked meanwhile
    return memory[0] == 0x1122334455667788ull && memory[1] == 7 + 5 && memory[2] == 99 ? 0 : 20;
  });
  std::vector<uint64_t> local(8, 0);
  Endpoint parent;
  ASSERT_TRUE(parent.open(local.data(), local.size() * 8, kCrossProcessDepth));
  ConnectInfo theirs{};
  ASSERT_TRUE(child.connect(parent, theirs));

  local[0] = 0x1122334455667788ull;
  EXPECT_EQ(run(parent, IBV_WR_RDMA_WRITE, &local[0], 8, theirs.address, theirs.rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(run(parent, IBV_WR_RDMA_READ, &local[1], 8, theirs.address + 8 * 3, theirs.rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(local[1], 7u) << "read the child's memory";
  EXPECT_EQ(run(parent, IBV_WR_ATOMIC_FETCH_AND_ADD, &local[2], 8, theirs.address + 8, theirs.rkey, 5), IBV_WC_SUCCESS);
  EXPECT_EQ(local[2], 7u);
  EXPECT_EQ(run(parent, IBV_WR_ATOMIC_CMP_AND_SWP, &local[3], 8, theirs.address + 16, theirs.rkey, 7, 99),
            IBV_WC_SUCCESS);
  EXPECT_EQ(run(parent, IBV_WR_RDMA_WRITE, &local[0], 8, theirs.address + 64 * 8, theirs.rkey), IBV_WC_REM_ACCESS_ERR)
      << "one past the child's region";
  const int status = child.finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << describe_exit(status);
}

// Registrations change the MR table under the lock that every copy holds
// (a slot of it per process, all of them for a change): WRITEs from one
// process into another must go on, each landing whole, while a thread of
// each process registers and deregisters memory of its own as fast as it
// can.
TEST(CrossProcess, WritesFlowWhileBothProcessesRegisterAndDeregister) {
  constexpr size_t kBytes = 64 * 1024;
  constexpr int kWrites = 2000;
  auto churn = [](ibv_pd* pd, const std::atomic<bool>& stop) {
    std::vector<char> scratch(kBytes);
    int registrations = 0;
    while (!stop.load()) {
      ibv_mr* mr = ibv_reg_mr(pd, scratch.data(), scratch.size(), kAllAccess);
      if (mr == nullptr || ibv_dereg_mr(mr) != 0) return -1;
      ++registrations;
    }
    return registrations;
  };
  std::vector<uint8_t> target(kBytes, 0);
  ChildEndpoint child(target.data(), target.size(), [&](Endpoint& self, int from_parent) {
    std::atomic<bool> stop{false};
    int registrations = 0;
    std::thread registering([&] { registrations = churn(self.pd(), stop); });
    char done;
    const bool told = read(from_parent, &done, 1) == 1;
    stop = true;
    registering.join();
    if (!told) return 14;
    if (registrations <= 0) return 21;
    // The last WRITE's pattern, whole.
    for (size_t i = 0; i < target.size(); ++i)
      if (target[i] != static_cast<uint8_t>((kWrites - 1) * 7 + i % 251)) return 22;
    return 0;
  });
  std::vector<uint8_t> source(kBytes);
  Endpoint parent;
  ASSERT_TRUE(parent.open(source.data(), source.size(), kCrossProcessDepth));
  ConnectInfo theirs{};
  ASSERT_TRUE(child.connect(parent, theirs));
  std::atomic<bool> stop{false};
  int registrations = 0;
  std::thread registering([&] { registrations = churn(parent.pd(), stop); });
  int failed = 0;
  for (int write = 0; write < kWrites; ++write) {
    for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint8_t>(write * 7 + i % 251);
    if (run(parent, IBV_WR_RDMA_WRITE, source.data(), kBytes, theirs.address, theirs.rkey) != IBV_WC_SUCCESS) ++failed;
  }
  stop = true;
  registering.join();
  EXPECT_EQ(failed, 0);
  EXPECT_GT(registrations, 0);
  const int status = child.finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << describe_exit(status);
}

}  // namespace
