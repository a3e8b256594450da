// ATOMIC WRITE (IBA 1.5, Memory Placement Extensions) through the installed
// libibverbs: ibv_post_send's IBV_WR_ATOMIC_WRITE and ibv_wr_atomic_write,
// the device capability, and every error a responder or the provider gives
// (as rxe gives them). Part of verbs_datapath_test, so it runs on shared
// memory, over UDP, with kernel copies and with the copy agent.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>

#include "verbs_datapath.h"

namespace {

using namespace softverbs::test;

// IB_UVERBS_DEVICE_ATOMIC_WRITE: rdma-core 44's verbs.h has no name for it.
constexpr uint64_t kDeviceAtomicWrite = uint64_t{1} << 40;

class AtomicWrite : public RcDataPath {
 protected:
  // An ATOMIC WRITE of the 8 bytes at buffer_a_[offset] (through the lkey,
  // or inline) to `remote`.
  int post_atomic_write(uint64_t wr_id, uint32_t offset, uint64_t remote, uint32_t rkey, uint32_t length = 8,
                        unsigned extra_flags = 0) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data() + offset), length, mr_a_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_ATOMIC_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED | extra_flags;
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(qp_a_, &wr, &bad);
  }

  void set_a(uint32_t offset, uint64_t value) { std::memcpy(buffer_a_.data() + offset, &value, 8); }
  uint64_t b_at(uint32_t offset) const {
    uint64_t value;
    std::memcpy(&value, buffer_b_.data() + offset, 8);
    return value;
  }

  // One completion on A's CQ; its status.
  ibv_wc one_completion() {
    auto done = poll_n(cq_a_, 1);
    EXPECT_EQ(done.size(), 1u);
    return done.empty() ? ibv_wc{} : done[0];
  }

  // After an error the requester's QP is in ERR.
  void expect_a_in_error() {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    ASSERT_EQ(ibv_query_qp(qp_a_, &attr, IBV_QP_STATE, &init), 0);
    EXPECT_EQ(attr.qp_state, IBV_QPS_ERR);
  }

  // A QP made with ibv_create_qp_ex that offers `ops`; null with errno.
  ibv_qp* make_qp_ex(ibv_qp_type type, ibv_cq* cq, uint64_t ops) {
    ibv_qp_init_attr_ex init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = type;
    init.cap = {16, 16, 4, 4, 0};
    init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    init.pd = pd_;
    init.send_ops_flags = ops;
    return ibv_create_qp_ex(context_, &init);
  }
};

TEST_F(AtomicWrite, TheDeviceSaysItHasAtomicWrite) {
  ibv_device_attr_ex attr{};
  ASSERT_EQ(ibv_query_device_ex(context_, nullptr, &attr), 0);
  EXPECT_NE(attr.device_cap_flags_ex & kDeviceAtomicWrite, 0u);
  EXPECT_EQ(attr.device_cap_flags_ex & 0xffffffffu, attr.orig_attr.device_cap_flags)
      << "the extended flags hold the basic ones too";
}

TEST_F(AtomicWrite, PlacesEightBytesAndCompletesAsAtomicWrite) {
  connect(IBV_QPT_RC);
  std::memset(buffer_b_.data(), 0x5a, 32);
  set_a(0, 0x0123456789abcdefULL);
  ASSERT_EQ(post_atomic_write(1, 0, addr_b(8), mr_b_->rkey), 0);
  ibv_wc wc = one_completion();
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_ATOMIC_WRITE);
  EXPECT_EQ(wc.byte_len, 8u);
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(b_at(8), 0x0123456789abcdefULL);
  EXPECT_EQ(b_at(0), 0x5a5a5a5a5a5a5a5aULL) << "the bytes before are untouched";
  EXPECT_EQ(b_at(16), 0x5a5a5a5a5a5a5a5aULL) << "the bytes after are untouched";
  EXPECT_TRUE(poll_n(cq_b_, 1, std::chrono::milliseconds(50)).empty()) << "the target completes nothing";
}

TEST_F(AtomicWrite, InlineBytesAreTakenAtPost) {
  connect(IBV_QPT_RC);
  set_a(0, 77);
  ASSERT_EQ(post_atomic_write(1, 0, addr_b(0), mr_b_->rkey, 8, IBV_SEND_INLINE), 0);
  set_a(0, 78);  // after the post: not what goes out
  EXPECT_EQ(one_completion().status, IBV_WC_SUCCESS);
  EXPECT_EQ(b_at(0), 77u);
}

TEST_F(AtomicWrite, TheExtendedApiWritesTheCallersValue) {
  qp_a_ = make_qp_ex(IBV_QPT_RC, cq_a_, IBV_QP_EX_WITH_ATOMIC_WRITE | IBV_QP_EX_WITH_RDMA_WRITE);
  ASSERT_NE(qp_a_, nullptr) << std::strerror(errno);
  qp_b_ = make_qp(IBV_QPT_RC, cq_b_);
  bring_up(IBV_QPT_RC);
  ibv_qp_ex* ex = ibv_qp_to_qp_ex(qp_a_);
  ASSERT_NE(ex, nullptr);
  uint64_t values[2] = {0x1111222233334444ULL, 0xaaaabbbbccccddddULL};
  ibv_wr_start(ex);
  ex->wr_id = 5;
  ex->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_atomic_write(ex, mr_b_->rkey, addr_b(0), &values[0]);
  ex->wr_id = 6;
  ibv_wr_atomic_write(ex, mr_b_->rkey, addr_b(64), &values[1]);
  values[0] = values[1] = 0;  // copied when each was started
  ASSERT_EQ(ibv_wr_complete(ex), 0);
  auto done = poll_n(cq_a_, 2);
  ASSERT_EQ(done.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(done[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(done[i].opcode, IBV_WC_ATOMIC_WRITE);
    EXPECT_EQ(done[i].wr_id, 5u + i);
  }
  EXPECT_EQ(b_at(0), 0x1111222233334444ULL);
  EXPECT_EQ(b_at(64), 0xaaaabbbbccccddddULL);
}

// ATOMIC WRITE is placed after the WRITEs posted before it (IBA 1.5's
// ordering: it is not executed ahead of earlier requests), so a reader that
// sees the flag sees the data: the flag-after-data idiom it exists for.
TEST_F(AtomicWrite, FollowsTheWritesPostedBeforeIt) {
  connect(IBV_QPT_RC);
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::memset(buffer_a_.data() + 64, 0x30 + round, 4096);
    ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 64, 4096, addr_b(64), mr_b_->rkey), 0);
    set_a(0, static_cast<uint64_t>(round) + 1);
    ASSERT_EQ(post_atomic_write(2, 0, addr_b(0), mr_b_->rkey), 0);
    // Watch the flag as the target's CPU would, before any completion.
    uint64_t flag = 0;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      flag = __atomic_load_n(reinterpret_cast<uint64_t*>(buffer_b_.data()), __ATOMIC_ACQUIRE);
      if (flag == static_cast<uint64_t>(round) + 1) break;
      ibv_wc wc[2];
      (void)ibv_poll_cq(cq_b_, 2, wc);  // keeps a polling-driven transport moving
    }
    ASSERT_EQ(flag, static_cast<uint64_t>(round) + 1);
    EXPECT_EQ(buffer_b_[64], 0x30 + round);
    EXPECT_EQ(buffer_b_[64 + 4095], 0x30 + round);
    auto done = poll_n(cq_a_, 2);
    ASSERT_EQ(done.size(), 2u);
    ASSERT_EQ(done[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(done[0].status);
    ASSERT_EQ(done[1].status, IBV_WC_SUCCESS) << ibv_wc_status_str(done[1].status);
    EXPECT_EQ(done[1].opcode, IBV_WC_ATOMIC_WRITE);
  }
}

TEST_F(AtomicWrite, ALengthOtherThanEightIsRefusedAtPost) {
  connect(IBV_QPT_RC);
  EXPECT_EQ(post_atomic_write(1, 0, addr_b(0), mr_b_->rkey, 4), EINVAL);
  EXPECT_EQ(post_atomic_write(1, 0, addr_b(0), mr_b_->rkey, 16), EINVAL);
  EXPECT_EQ(post_atomic_write(1, 0, addr_b(0), mr_b_->rkey, 0), EINVAL);
  EXPECT_TRUE(poll_n(cq_a_, 1, std::chrono::milliseconds(50)).empty());
}

TEST_F(AtomicWrite, UcAndUdQpsCannotPostOrOfferIt) {
  for (ibv_qp_type type : {IBV_QPT_UC, IBV_QPT_UD}) {
    SCOPED_TRACE(type == IBV_QPT_UC ? "UC" : "UD");
    errno = 0;
    ibv_qp* ex = make_qp_ex(type, cq_a_, IBV_QP_EX_WITH_ATOMIC_WRITE | IBV_QP_EX_WITH_SEND);
    EXPECT_EQ(ex, nullptr);
    EXPECT_EQ(errno, EOPNOTSUPP);
    if (ex) ibv_destroy_qp(ex);
  }
  connect(IBV_QPT_UC);
  EXPECT_EQ(post_atomic_write(1, 0, addr_b(0), mr_b_->rkey), EINVAL);
}

TEST_F(AtomicWrite, BadRkeyIsARemoteAccessErrorAndTheRestIsFlushed) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_atomic_write(1, 0, addr_b(0), mr_b_->rkey ^ 0x55), 0);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 2, 0, 8, addr_b(0), mr_b_->rkey), 0);
  auto done = poll_n(cq_a_, 2);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(done[1].status, IBV_WC_WR_FLUSH_ERR);
  expect_a_in_error();
}

TEST_F(AtomicWrite, ARegionWithoutRemoteWriteRefusesIt) {
  connect(IBV_QPT_RC);
  ibv_mr* read_only = ibv_reg_mr(pd_, buffer_b_.data(), 4096,
                                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
  ASSERT_NE(read_only, nullptr);
  set_a(0, 9);
  ASSERT_EQ(post_atomic_write(1, 0, addr_b(0), read_only->rkey), 0);
  EXPECT_EQ(one_completion().status, IBV_WC_REM_ACCESS_ERR) << "remote atomic access is not remote write";
  EXPECT_EQ(b_at(0), 0u);
  EXPECT_EQ(ibv_dereg_mr(read_only), 0);
}

TEST_F(AtomicWrite, AQpWithoutRemoteWriteRefusesIt) {
  connect(IBV_QPT_RC, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
  set_a(0, 9);
  ASSERT_EQ(post_atomic_write(1, 0, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(one_completion().status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(b_at(0), 0u);
}

TEST_F(AtomicWrite, PastTheRegionsEndIsARemoteAccessError) {
  connect(IBV_QPT_RC);
  set_a(0, 9);
  ASSERT_EQ(post_atomic_write(1, 0, addr_b(8192 - 4), mr_b_->rkey), 0);
  EXPECT_EQ(one_completion().status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(b_at(8192 - 8), 0u);
}

TEST_F(AtomicWrite, AMisalignedAddressIsAnInvalidRequest) {
  connect(IBV_QPT_RC);
  set_a(0, ~uint64_t{0});
  ASSERT_EQ(post_atomic_write(1, 0, addr_b(4), mr_b_->rkey), 0);
  ibv_wc wc = one_completion();
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(b_at(0), 0u);
  EXPECT_EQ(b_at(8), 0u);
  expect_a_in_error();
}

TEST_F(AtomicWrite, ABadLkeyIsALocalProtectionError) {
  connect(IBV_QPT_RC);
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data()), 8, mr_a_->lkey ^ 0x33};
  ibv_send_wr wr{};
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_ATOMIC_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = addr_b(0);
  wr.wr.rdma.rkey = mr_b_->rkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  EXPECT_EQ(one_completion().status, IBV_WC_LOC_PROT_ERR);
}

}  // namespace
