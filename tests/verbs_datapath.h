// The fixture of the data-path tests (verbs_datapath_*_test.cpp, one
// executable): two QPs of one process, A and B, each with a CQ and a
// registered buffer of its own, connected to each other.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/wait.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "device_fixture.h"
#include "qp_setup.h"

namespace softverbs::test {

inline std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// Polls until `n` completions arrived or `patience` passed. The data path
// completes within the posting call, so checks for absence use a short wait.
inline std::vector<ibv_wc> poll_n(ibv_cq* cq, int n, std::chrono::milliseconds patience = std::chrono::seconds(5)) {
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

class DataPath : public DeviceObjects<::testing::TestWithParam<ibv_qp_type>> {
 protected:
  void SetUp() override {
    DeviceObjects::SetUp();
    if (HasFatalFailure()) return;
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
    DeviceObjects::TearDown();
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

  ibv_qp* qp_a_ = nullptr;
  ibv_qp* qp_b_ = nullptr;
  ibv_ah* ah_ = nullptr;
  ibv_mr* mr_a_ = nullptr;
  ibv_mr* mr_b_ = nullptr;
  std::vector<uint8_t> buffer_a_, buffer_b_;
};

class RcDataPath : public DataPath {
 protected:
  // An RC pair whose B side completes its receives on a CQ of their own
  // with a completion channel, armed; A sends as in every other test.
  struct EventedReceives {
    ibv_comp_channel* channel = nullptr;
    ibv_cq* cq = nullptr;
  };
  EventedReceives connect_with_evented_receives() {
    EventedReceives evented;
    evented.channel = ibv_create_comp_channel(context_);
    EXPECT_NE(evented.channel, nullptr) << std::strerror(errno);
    if (evented.channel == nullptr) return evented;
    evented.cq = ibv_create_cq(context_, 8, nullptr, evented.channel, 0);
    EXPECT_NE(evented.cq, nullptr);
    if (evented.cq == nullptr) return evented;
    ibv_qp_init_attr init{};
    init.send_cq = cq_b_;
    init.recv_cq = evented.cq;
    init.cap = {4, 4, 1, 1, 0};
    connect_rc_with(init);
    EXPECT_EQ(ibv_req_notify_cq(evented.cq, 0), 0);
    return evented;
  }
  // The receive `wr_id` is the one completion on the evented CQ.
  void expect_one_receive(const EventedReceives& evented, uint64_t wr_id) {
    auto received = poll_n(evented.cq, 1);
    ASSERT_EQ(received.size(), 1u);
    EXPECT_EQ(received[0].wr_id, wr_id);
    EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  }
  // B's QP first (it completes on the CQ), then the CQ and the channel.
  void destroy(EventedReceives& evented) {
    EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
    qp_b_ = nullptr;
    EXPECT_EQ(ibv_destroy_cq(evented.cq), 0);
    EXPECT_EQ(ibv_destroy_comp_channel(evented.channel), 0);
  }
};

}  // namespace softverbs::test
