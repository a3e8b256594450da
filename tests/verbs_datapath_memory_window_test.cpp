// Memory windows through the installed libibverbs: type 1 windows bound
// with ibv_bind_mw, type 2B windows bound with a BIND_MW work request (and
// the ibv_wr_* builders), invalidation by LOCAL_INV and by a SEND with
// invalidate, and every refusal as rxe and HCAs give it.
//
// Part of the verbs_datapath_test executable: run on a shared-memory
// device, over UDP, with kernel copies and with the copy agent.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "verbs_datapath.h"

namespace {

using namespace softverbs::test;

constexpr uint32_t kWindowOffset = 1024;
constexpr uint32_t kWindowLength = 2048;

class MemoryWindow : public DataPath {
 protected:
  void SetUp() override {
    DataPath::SetUp();
    if (HasFatalFailure()) return;
    // B's memory that windows open onto: registered with no remote rights
    // of its own, only the right to bind windows (as pyverbs' MWTest).
    window_buffer_.assign(8192, 0);
    window_mr_ =
        ibv_reg_mr(pd_, window_buffer_.data(), window_buffer_.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    ASSERT_NE(window_mr_, nullptr) << std::strerror(errno);
    connect(IBV_QPT_RC);
  }
  void TearDown() override {
    for (ibv_mw* mw : windows_) {
      EXPECT_EQ(ibv_dealloc_mw(mw), 0);
    }
    if (window_mr_) {
      EXPECT_EQ(ibv_dereg_mr(window_mr_), 0);
    }
    DataPath::TearDown();
  }

  ibv_mw* allocate(ibv_mw_type type) {
    ibv_mw* mw = ibv_alloc_mw(pd_, type);
    EXPECT_NE(mw, nullptr) << std::strerror(errno);
    if (mw) windows_.push_back(mw);
    return mw;
  }
  void forget(ibv_mw* mw) { std::erase(windows_, mw); }

  uint64_t window_address(uint32_t offset = 0) {
    return reinterpret_cast<uint64_t>(window_buffer_.data() + kWindowOffset + offset);
  }
  ibv_mw_bind_info bind_info(int access, ibv_mr* mr = nullptr, uint64_t address = 0, uint64_t length = kWindowLength) {
    return {mr ? mr : window_mr_, address ? address : window_address(), length, static_cast<unsigned>(access)};
  }

  // ibv_bind_mw on B's QP; the bind's completion status (or -errno if the
  // post fails).
  int bind_type1(ibv_mw* mw, const ibv_mw_bind_info& info) {
    ibv_mw_bind bind{};
    bind.wr_id = 0xb1;
    bind.send_flags = IBV_SEND_SIGNALED;
    bind.bind_info = info;
    if (int error = ibv_bind_mw(qp_b_, mw, &bind)) return -error;
    return completion_b(0xb1, IBV_WC_BIND_MW);
  }

  // A BIND_MW work request on `qp` (B's by default) giving the window
  // `rkey`; the bind's completion status, or -errno if the post fails.
  int bind_type2(ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info& info, ibv_qp* qp = nullptr, ibv_cq* cq = nullptr) {
    ibv_send_wr wr{};
    wr.wr_id = 0xb2;
    wr.opcode = IBV_WR_BIND_MW;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = rkey;
    wr.bind_mw.bind_info = info;
    ibv_send_wr* bad = nullptr;
    if (int error = ibv_post_send(qp ? qp : qp_b_, &wr, &bad)) return -error;
    return completion_on(cq ? cq : cq_b_, 0xb2, IBV_WC_BIND_MW);
  }

  int local_invalidate_b(uint32_t rkey) {
    ibv_send_wr wr{};
    wr.wr_id = 0x11;
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.invalidate_rkey = rkey;
    ibv_send_wr* bad = nullptr;
    if (int error = ibv_post_send(qp_b_, &wr, &bad)) return -error;
    return completion_b(0x11, IBV_WC_LOCAL_INV);
  }

  // The next completion of `cq` (one, where poll_n may take several).
  int completion_on(ibv_cq* cq, uint64_t wr_id, ibv_wc_opcode opcode) {
    ibv_wc wc{};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int got = 0;
    while ((got = ibv_poll_cq(cq, 1, &wc)) == 0 && std::chrono::steady_clock::now() < deadline) {
    }
    EXPECT_EQ(got, 1);
    if (got != 1) return -1;
    EXPECT_EQ(wc.wr_id, wr_id);
    if (wc.status == IBV_WC_SUCCESS) {
      EXPECT_EQ(wc.opcode, opcode);
    }
    return wc.status;
  }
  int completion_b(uint64_t wr_id, ibv_wc_opcode opcode) { return completion_on(cq_b_, wr_id, opcode); }

  // An RDMA operation from A into the window; its completion status.
  int from_a(ibv_wr_opcode opcode, uint32_t rkey, uint64_t remote, uint32_t length) {
    EXPECT_EQ(post_a(opcode, 0xa1, 0, length, remote, rkey), 0);
    auto wcs = poll_n(cq_a_, 1);
    EXPECT_EQ(wcs.size(), 1u);
    return wcs.empty() ? -1 : wcs[0].status;
  }

  std::vector<uint8_t> window_buffer_;
  ibv_mr* window_mr_ = nullptr;
  std::vector<ibv_mw*> windows_;
};

TEST_F(MemoryWindow, DeviceAdvertisesBothTypes) {
  ibv_device_attr attr{};
  ASSERT_EQ(ibv_query_device(context_, &attr), 0);
  EXPECT_TRUE(attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW);
  EXPECT_TRUE(attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B);
  EXPECT_GT(attr.max_mw, 0);
  ibv_mw* one = allocate(IBV_MW_TYPE_1);
  ibv_mw* two = allocate(IBV_MW_TYPE_2);
  ASSERT_TRUE(one && two);
  EXPECT_EQ(one->type, IBV_MW_TYPE_1);
  EXPECT_EQ(two->type, IBV_MW_TYPE_2);
  EXPECT_NE(one->rkey, two->rkey);
  // Window keys are of the region keys' space: none names a region.
  EXPECT_NE(one->rkey, window_mr_->rkey);
  errno = 0;
  EXPECT_EQ(ibv_alloc_mw(pd_, static_cast<ibv_mw_type>(3)), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(MemoryWindow, Type1WindowServesItsRangeAndRights) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  const uint32_t unbound = mw->rkey;
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)), IBV_WC_SUCCESS);
  // A bind changes the key's low 8 bits only (ibv_inc_rkey).
  EXPECT_EQ(mw->rkey, ibv_inc_rkey(unbound));
  std::memset(buffer_a_.data(), 0x5a, 64);
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, mw->rkey, window_address(100), 64), IBV_WC_SUCCESS);
  EXPECT_EQ(window_buffer_[kWindowOffset + 100], 0x5a);
  EXPECT_EQ(window_buffer_[kWindowOffset + 99], 0);
  window_buffer_[kWindowOffset + kWindowLength - 1] = 0x77;
  EXPECT_EQ(from_a(IBV_WR_RDMA_READ, mw->rkey, window_address(kWindowLength - 1), 1), IBV_WC_SUCCESS);
  EXPECT_EQ(buffer_a_[0], 0x77);
  // The old key names nothing; the region's own key grants no remote access.
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, unbound, window_address(), 8), IBV_WC_REM_ACCESS_ERR);
}

TEST_F(MemoryWindow, AccessBeyondTheWindowIsRefused) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  // In the region, one byte past the window.
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, mw->rkey, window_address(kWindowLength - 8), 9), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(window_buffer_[kWindowOffset + kWindowLength], 0);
  EXPECT_EQ(window_buffer_[kWindowOffset + kWindowLength - 8], 0);
}

TEST_F(MemoryWindow, RightsTheWindowLacksAreRefused) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_READ)), IBV_WC_SUCCESS);
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, mw->rkey, window_address(), 8), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(window_buffer_[kWindowOffset], 0);
}

TEST_F(MemoryWindow, UnbindingAType1WindowWithZeroLength) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  ASSERT_EQ(bind_type1(mw, bind_info(0, window_mr_, window_address(), 0)), IBV_WC_SUCCESS);
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, mw->rkey, window_address(), 8), IBV_WC_REM_ACCESS_ERR);
}

TEST_F(MemoryWindow, BindToARegionWithoutMwBindAccessFails) {
  ibv_mr* plain = ibv_reg_mr(pd_, buffer_b_.data(), buffer_b_.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(plain, nullptr);
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  EXPECT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE, plain, reinterpret_cast<uint64_t>(buffer_b_.data()), 64)),
            IBV_WC_MW_BIND_ERR);
  EXPECT_EQ(ibv_dereg_mr(plain), 0);
}

TEST_F(MemoryWindow, BindOutsideTheRegionFails) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  EXPECT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE, window_mr_,
                                     reinterpret_cast<uint64_t>(window_buffer_.data()) + 8192 - 64, 128)),
            IBV_WC_MW_BIND_ERR);
}

TEST_F(MemoryWindow, WritableWindowNeedsALocallyWritableRegion) {
  ibv_mr* read_only = ibv_reg_mr(pd_, buffer_b_.data(), buffer_b_.size(), IBV_ACCESS_MW_BIND);
  ASSERT_NE(read_only, nullptr);
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  EXPECT_EQ(
      bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE, read_only, reinterpret_cast<uint64_t>(buffer_b_.data()), 64)),
      IBV_WC_MW_BIND_ERR);
  EXPECT_EQ(ibv_dereg_mr(read_only), 0);
}

TEST_F(MemoryWindow, EachTypeIsBoundOnlyItsOwnWay) {
  ibv_mw* one = allocate(IBV_MW_TYPE_1);
  ibv_mw* two = allocate(IBV_MW_TYPE_2);
  ASSERT_TRUE(one && two);
  ibv_mw_bind bind{};
  bind.bind_info = bind_info(IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(ibv_bind_mw(qp_b_, two, &bind), EINVAL);
  EXPECT_EQ(bind_type2(one, ibv_inc_rkey(one->rkey), bind_info(IBV_ACCESS_REMOTE_WRITE)), -EINVAL);
  // Neither reached the device: the QP still works.
  EXPECT_EQ(bind_type2(two, ibv_inc_rkey(two->rkey), bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
}

TEST_F(MemoryWindow, Type2WindowInvalidatedLocally) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ASSERT_EQ(bind_type2(mw, rkey, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  buffer_a_[0] = 0x42;
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, rkey, window_address(), 1), IBV_WC_SUCCESS);
  EXPECT_EQ(window_buffer_[kWindowOffset], 0x42);
  ASSERT_EQ(local_invalidate_b(rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, rkey, window_address(8), 1), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(window_buffer_[kWindowOffset + 8], 0);
}

TEST_F(MemoryWindow, Type2WindowInvalidatedBySendWithInvalidate) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ASSERT_EQ(bind_type2(mw, rkey, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  ASSERT_EQ(post_recv_b(0xc0, 0, 64), 0);
  std::memcpy(buffer_a_.data(), "goodbye", 8);
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data()), 8, mr_a_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 0x5e;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND_WITH_INV;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.invalidate_rkey = rkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  // For udp_tools_test, which finds this packet's IETH in a capture.
  std::printf("send with invalidate of rkey %#x\n", rkey);
  auto sent = poll_n(cq_a_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(sent[0].opcode, IBV_WC_SEND);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(received[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(received[0].byte_len, 8u);
  EXPECT_TRUE(received[0].wc_flags & IBV_WC_WITH_INV);
  EXPECT_FALSE(received[0].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(received[0].invalidated_rkey, rkey);
  EXPECT_STREQ(reinterpret_cast<const char*>(buffer_b_.data()), "goodbye");
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, rkey, window_address(), 1), IBV_WC_REM_ACCESS_ERR);
}

TEST_F(MemoryWindow, Type2WindowCanBeBoundAgainOnceInvalidated) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t first = ibv_inc_rkey(mw->rkey), second = ibv_inc_rkey(first);
  ASSERT_EQ(bind_type2(mw, first, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  ASSERT_EQ(local_invalidate_b(first), IBV_WC_SUCCESS);
  ASSERT_EQ(bind_type2(mw, second, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  buffer_a_[0] = 0x24;
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, second, window_address(), 1), IBV_WC_SUCCESS);
  EXPECT_EQ(window_buffer_[kWindowOffset], 0x24);
}

TEST_F(MemoryWindow, BoundType2WindowCannotBeBoundAgain) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ASSERT_EQ(bind_type2(mw, rkey, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  EXPECT_EQ(bind_type2(mw, ibv_inc_rkey(rkey), bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_MW_BIND_ERR);
}

TEST_F(MemoryWindow, Type1WindowIsNotInvalidatedByWorkRequests) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  EXPECT_EQ(local_invalidate_b(mw->rkey), IBV_WC_LOC_QP_OP_ERR);
}

TEST_F(MemoryWindow, SendInvalidatingAType1WindowFailsBothSides) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  ASSERT_EQ(post_recv_b(0xc1, 0, 64), 0);
  ibv_send_wr wr{};
  wr.wr_id = 0x5f;
  wr.opcode = IBV_WR_SEND_WITH_INV;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.invalidate_rkey = mw->rkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].wr_id, 0xc1u);
  EXPECT_EQ(received[0].status, IBV_WC_REM_INV_REQ_ERR);
  auto sent = poll_n(cq_a_, 1);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].status, IBV_WC_REM_INV_REQ_ERR);
  // IBA class J: the responder's QP went to ERR.
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(ibv_query_qp(qp_b_, &attr, IBV_QP_STATE, &init), 0);
  EXPECT_EQ(attr.qp_state, IBV_QPS_ERR);
}

TEST_F(MemoryWindow, DeallocatedWindowNamesNothing) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ASSERT_EQ(bind_type2(mw, rkey, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  forget(mw);
  ASSERT_EQ(ibv_dealloc_mw(mw), 0);
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, rkey, window_address(), 1), IBV_WC_REM_ACCESS_ERR);
}

TEST_F(MemoryWindow, RegionWithBoundWindowsStays) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  EXPECT_EQ(ibv_dereg_mr(window_mr_), EBUSY);
  // Still registered and reachable through the window.
  buffer_a_[0] = 0x33;
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, mw->rkey, window_address(), 1), IBV_WC_SUCCESS);
  EXPECT_EQ(window_buffer_[kWindowOffset], 0x33);
  forget(mw);
  ASSERT_EQ(ibv_dealloc_mw(mw), 0);
  EXPECT_EQ(ibv_dereg_mr(window_mr_), 0);
  window_mr_ = nullptr;
}

TEST_F(MemoryWindow, Type2WindowServesOnlyItsQp) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ASSERT_EQ(bind_type2(mw, rkey, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  // A second connection in the same PD: C writes to D, which did not bind it.
  ibv_cq* cq = ibv_create_cq(context_, 16, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  ibv_qp* c = make_qp(IBV_QPT_RC, cq);
  ibv_qp* d = make_qp(IBV_QPT_RC, cq);
  ASSERT_TRUE(c && d);
  ASSERT_EQ(to_init(c, IBV_QPT_RC, kAllAccess), 0);
  ASSERT_EQ(to_init(d, IBV_QPT_RC, kAllAccess), 0);
  ASSERT_EQ(to_rtr(c, IBV_QPT_RC, d->qp_num), 0);
  ASSERT_EQ(to_rtr(d, IBV_QPT_RC, c->qp_num), 0);
  ASSERT_EQ(to_rts(c, IBV_QPT_RC, 0, RcTiming{}), 0);
  ASSERT_EQ(to_rts(d, IBV_QPT_RC, 0, RcTiming{}), 0);
  ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a_.data()), 1, mr_a_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 0xcd;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma = {window_address(), rkey};
  ibv_send_wr* bad = nullptr;
  buffer_a_[0] = 0x99;
  ASSERT_EQ(ibv_post_send(c, &wr, &bad), 0);
  auto wcs = poll_n(cq, 1);
  ASSERT_EQ(wcs.size(), 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(window_buffer_[kWindowOffset], 0);
  // Through the QP that bound it, the same write lands.
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, rkey, window_address(), 1), IBV_WC_SUCCESS);
  EXPECT_EQ(window_buffer_[kWindowOffset], 0x99);
  EXPECT_EQ(ibv_destroy_qp(c), 0);
  EXPECT_EQ(ibv_destroy_qp(d), 0);
  EXPECT_EQ(ibv_destroy_cq(cq), 0);
}

TEST_F(MemoryWindow, ExtendedBuildersBindSendInvalidateAndInvalidate) {
  // B's side as an extended QP with the three window operations.
  ASSERT_EQ(ibv_destroy_qp(qp_b_), 0);
  ASSERT_EQ(ibv_destroy_qp(qp_a_), 0);
  qp_a_ = qp_b_ = nullptr;
  auto make_ex = [&](ibv_cq* cq, uint64_t ops) {
    ibv_qp_init_attr_ex init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap = {16, 16, 4, 4, 64};
    init.pd = pd_;
    init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    init.send_ops_flags = ops;
    return ibv_create_qp_ex(context_, &init);
  };
  constexpr uint64_t kWindowOps = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_SEND_WITH_INV |
                                  IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND;
  qp_a_ = make_ex(cq_a_, kWindowOps);
  qp_b_ = make_ex(cq_b_, kWindowOps);
  ASSERT_TRUE(qp_a_ && qp_b_) << std::strerror(errno);
  bring_up(IBV_QPT_RC);
  ibv_qp_ex* a = ibv_qp_to_qp_ex(qp_a_);
  ibv_qp_ex* b = ibv_qp_to_qp_ex(qp_b_);
  ASSERT_TRUE(a && b);

  ibv_mw* first = allocate(IBV_MW_TYPE_2);
  ibv_mw* second = allocate(IBV_MW_TYPE_2);
  ASSERT_TRUE(first && second);
  const uint32_t first_rkey = ibv_inc_rkey(first->rkey), second_rkey = ibv_inc_rkey(second->rkey);
  const ibv_mw_bind_info info = bind_info(IBV_ACCESS_REMOTE_WRITE);
  ibv_wr_start(b);
  b->wr_id = 1;
  b->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_bind_mw(b, first, first_rkey, &info);
  b->wr_id = 2;
  ibv_wr_bind_mw(b, second, second_rkey, &info);
  ASSERT_EQ(ibv_wr_complete(b), 0);
  for (uint64_t wr_id : {1, 2}) EXPECT_EQ(completion_b(wr_id, IBV_WC_BIND_MW), IBV_WC_SUCCESS);

  // A invalidates the first remotely with a SEND; B the second locally.
  ASSERT_EQ(post_recv_b(0xc2, 0, 64), 0);
  ibv_wr_start(a);
  a->wr_id = 3;
  a->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send_inv(a, first_rkey);
  ibv_wr_set_sge(a, mr_a_->lkey, reinterpret_cast<uint64_t>(buffer_a_.data()), 4);
  ASSERT_EQ(ibv_wr_complete(a), 0);
  EXPECT_EQ(completion_on(cq_a_, 3, IBV_WC_SEND), IBV_WC_SUCCESS);
  auto received = poll_n(cq_b_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  EXPECT_TRUE(received[0].wc_flags & IBV_WC_WITH_INV);
  EXPECT_EQ(received[0].invalidated_rkey, first_rkey);
  ibv_wr_start(b);
  b->wr_id = 4;
  b->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_local_inv(b, second_rkey);
  ASSERT_EQ(ibv_wr_complete(b), 0);
  EXPECT_EQ(completion_b(4, IBV_WC_LOCAL_INV), IBV_WC_SUCCESS);

  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, second_rkey, window_address(), 1), IBV_WC_REM_ACCESS_ERR);
}

TEST_F(MemoryWindow, ExtendedQpRefusesWindowOpsNotAskedFor) {
  ibv_qp_init_attr_ex init{};
  init.send_cq = cq_a_;
  init.recv_cq = cq_a_;
  init.qp_type = IBV_QPT_RC;
  init.cap = {4, 4, 1, 1, 0};
  init.pd = pd_;
  init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  init.send_ops_flags = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_TSO;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(context_, &init), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

}  // namespace

namespace {

// A window over on-demand pages resolves them as its region does: one not
// there fails the access, it does not fault the owner.
TEST_F(MemoryWindow, WindowOverOnDemandPagesResolvesThemAtAccess) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* area = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(area, MAP_FAILED);
  auto* pages = static_cast<uint8_t*>(area);
  ibv_mr* odp =
      ibv_reg_mr(pd_, pages, 2 * page,
                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_MW_BIND | IBV_ACCESS_ON_DEMAND);
  ASSERT_NE(odp, nullptr) << std::strerror(errno);
  ibv_mw* mw = allocate(IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(pages);
  ASSERT_EQ(bind_type1(mw, bind_info(IBV_ACCESS_REMOTE_WRITE, odp, base, 2 * page)), IBV_WC_SUCCESS);
  // Taken away but kept reserved, so that no mapping made meanwhile lands there.
  ASSERT_EQ(mmap(pages + page, page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0),
            pages + page);
  buffer_a_[0] = 0x5a;
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, mw->rkey, base, 1), IBV_WC_SUCCESS);
  EXPECT_EQ(pages[0], 0x5a);
  EXPECT_EQ(from_a(IBV_WR_RDMA_WRITE, mw->rkey, base + page, 1), IBV_WC_REM_ACCESS_ERR);
  forget(mw);
  EXPECT_EQ(ibv_dealloc_mw(mw), 0);
  EXPECT_EQ(ibv_dereg_mr(odp), 0);
  munmap(pages, 2 * page);
}

// A type 2 window goes with the QP it is bound to: no later QP that draws
// the same number finds it bound, and its region is free to go.
TEST_F(MemoryWindow, DestroyingItsQpUnbindsAType2Window) {
  ibv_mw* mw = allocate(IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ASSERT_EQ(bind_type2(mw, rkey, bind_info(IBV_ACCESS_REMOTE_WRITE)), IBV_WC_SUCCESS);
  EXPECT_EQ(ibv_dereg_mr(window_mr_), EBUSY) << "bound";
  ASSERT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_dereg_mr(window_mr_), 0);
  window_mr_ = nullptr;
}

}  // namespace
