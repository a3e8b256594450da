// XRC through the installed libibverbs: domains (anonymous and shared by
// inode, also with another process), XRC SRQs, XRC_SEND and XRC_RECV QPs,
// every opcode into an XRC SRQ, ibv_open_qp, and the error paths. Run on
// shared memory and (verbs_xrc_test_udp) over UDP.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "qp_setup.h"

namespace softverbs::test {
namespace {

std::vector<ibv_wc> poll_n(ibv_cq* cq, int n, std::chrono::milliseconds patience = std::chrono::seconds(5)) {
  std::vector<ibv_wc> out;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (static_cast<int>(out.size()) < n && std::chrono::steady_clock::now() < deadline) {
    ibv_wc wc[8];
    const int got = ibv_poll_cq(cq, 8, wc);
    for (int i = 0; i < got; ++i) out.push_back(wc[i]);
    if (got == 0) std::this_thread::yield();
  }
  return out;
}

ibv_qp_state state_of(ibv_qp* qp) {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (ibv_query_qp(qp, &attr, IBV_QP_STATE, &init) != 0) return static_cast<ibv_qp_state>(-1);
  return attr.qp_state;
}

// A temporary file whose inode names a shared XRC domain.
class DomainFile {
 public:
  DomainFile() {
    char name[] = "/tmp/softverbs-xrcd-XXXXXX";
    fd_ = mkstemp(name);
    path_ = name;
  }
  ~DomainFile() {
    if (fd_ >= 0) close(fd_);
    unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

ibv_xrcd* open_domain(ibv_context* context, int fd, int oflags = O_CREAT) {
  ibv_xrcd_init_attr attr{};
  attr.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
  attr.fd = fd;
  attr.oflags = oflags;
  return ibv_open_xrcd(context, &attr);
}

class Xrc : public ::testing::Test {
 protected:
  void SetUp() override {
    context_ = open_softverbs0();
    ASSERT_NE(context_, nullptr);
    pd_ = ibv_alloc_pd(context_);
    send_cq_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    recv_cq_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    ASSERT_TRUE(pd_ && send_cq_ && recv_cq_);
    local_.assign(8192, 0);
    remote_.assign(8192, 0);
    local_mr_ = ibv_reg_mr(pd_, local_.data(), local_.size(), kAllAccess);
    remote_mr_ = ibv_reg_mr(pd_, remote_.data(), remote_.size(), kAllAccess);
    ASSERT_TRUE(local_mr_ && remote_mr_);
    xrcd_ = open_domain(context_, -1);
    ASSERT_NE(xrcd_, nullptr) << std::strerror(errno);
    srq_ = make_srq(xrcd_, recv_cq_);
    ASSERT_NE(srq_, nullptr) << std::strerror(errno);
  }
  void TearDown() override {
    for (ibv_qp* qp : {send_qp_, recv_qp_})
      if (qp) {
        EXPECT_EQ(ibv_destroy_qp(qp), 0);
      }
    if (srq_) {
      EXPECT_EQ(ibv_destroy_srq(srq_), 0);
    }
    if (xrcd_) {
      EXPECT_EQ(ibv_close_xrcd(xrcd_), 0);
    }
    for (ibv_mr* mr : {local_mr_, remote_mr_})
      if (mr) ibv_dereg_mr(mr);
    for (ibv_cq* cq : {send_cq_, recv_cq_})
      if (cq) {
        EXPECT_EQ(ibv_destroy_cq(cq), 0);
      }
    if (pd_) {
      EXPECT_EQ(ibv_dealloc_pd(pd_), 0);
    }
    if (context_) ibv_close_device(context_);
  }

  ibv_srq* make_srq(ibv_xrcd* xrcd, ibv_cq* cq,
                    uint32_t mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD |
                                    IBV_SRQ_INIT_ATTR_CQ) {
    ibv_srq_init_attr_ex attr{};
    attr.attr.max_wr = 16;
    attr.attr.max_sge = 1;
    attr.comp_mask = mask;
    attr.srq_type = IBV_SRQT_XRC;
    attr.pd = pd_;
    attr.xrcd = xrcd;
    attr.cq = cq;
    return ibv_create_srq_ex(context_, &attr);
  }

  ibv_qp* make_recv_qp(ibv_xrcd* xrcd) {
    ibv_qp_init_attr_ex init{};
    init.qp_type = IBV_QPT_XRC_RECV;
    init.comp_mask = IBV_QP_INIT_ATTR_XRCD;
    init.xrcd = xrcd;
    return ibv_create_qp_ex(context_, &init);
  }

  ibv_qp* make_send_qp(uint64_t send_ops = 0) {
    ibv_qp_init_attr_ex init{};
    init.qp_type = IBV_QPT_XRC_SEND;
    init.send_cq = send_cq_;
    init.cap.max_send_wr = 16;
    init.cap.max_send_sge = 1;
    init.comp_mask = IBV_QP_INIT_ATTR_PD;
    init.pd = pd_;
    if (send_ops != 0) {
      init.comp_mask |= IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
      init.send_ops_flags = send_ops;
    }
    return ibv_create_qp_ex(context_, &init);
  }

  // RTR towards `dest_qpn` through the IPv4 GID, with the attributes of the
  // QP's XRC role (the kernel's rules: xsrq_pingpong's masks).
  static int xrc_to_rtr(ibv_qp* qp, uint32_t dest_qpn, int extra_mask = 0) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = IBV_MTU_1024;
    attr.dest_qp_num = dest_qpn;
    attr.ah_attr.port_num = 1;
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.hop_limit = 1;
    const int gid_index = ipv4_gid_index(qp->context, &attr.ah_attr.grh.dgid);
    if (gid_index < 0) return ENOENT;
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
    attr.max_dest_rd_atomic = 4;
    attr.min_rnr_timer = 1;
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | extra_mask;
    if (qp->qp_type == IBV_QPT_XRC_RECV) mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    return ibv_modify_qp(qp, &attr, mask);
  }
  static int xrc_to_rts(ibv_qp* qp, int extra_mask = 0) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.max_rd_atomic = 4;
    int mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN | extra_mask;
    if (qp->qp_type == IBV_QPT_XRC_SEND) mask |= IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    return ibv_modify_qp(qp, &attr, mask);
  }

  // send_qp_ -> recv_qp_ (in `xrcd`), both in RTS.
  void connect(ibv_xrcd* xrcd = nullptr, uint64_t send_ops = 0) {
    recv_qp_ = make_recv_qp(xrcd ? xrcd : xrcd_);
    ASSERT_NE(recv_qp_, nullptr) << std::strerror(errno);
    send_qp_ = make_send_qp(send_ops);
    ASSERT_NE(send_qp_, nullptr) << std::strerror(errno);
    ASSERT_EQ(to_init(recv_qp_, IBV_QPT_RC, kAllAccess), 0);
    ASSERT_EQ(to_init(send_qp_, IBV_QPT_RC, 0), 0);
    ASSERT_EQ(xrc_to_rtr(recv_qp_, send_qp_->qp_num), 0);
    ASSERT_EQ(xrc_to_rts(recv_qp_), 0);
    ASSERT_EQ(xrc_to_rtr(send_qp_, recv_qp_->qp_num), 0);
    ASSERT_EQ(xrc_to_rts(send_qp_), 0);
  }

  uint32_t srqn(ibv_srq* srq) {
    uint32_t number = 0;
    EXPECT_EQ(ibv_get_srq_num(srq, &number), 0);
    return number;
  }

  int post_srq_recv(ibv_srq* srq, uint64_t wr_id, uint32_t offset, uint32_t length) {
    ibv_sge sge{reinterpret_cast<uint64_t>(remote_.data() + offset), length, remote_mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_srq_recv(srq, &wr, &bad);
  }

  int post(ibv_wr_opcode opcode, uint64_t wr_id, uint32_t remote_srqn, uint32_t offset, uint32_t length,
           uint64_t remote_offset = 0) {
    ibv_sge sge{reinterpret_cast<uint64_t>(local_.data() + offset), length, local_mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(0x1234abcd);
    wr.qp_type.xrc.remote_srqn = remote_srqn;
    const uint64_t remote = reinterpret_cast<uint64_t>(remote_.data() + remote_offset);
    if (opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
      wr.wr.atomic.remote_addr = remote;
      wr.wr.atomic.rkey = remote_mr_->rkey;
      wr.wr.atomic.compare_add = opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ? 5 : 0x1111;
      wr.wr.atomic.swap = 0x2222;
    } else {
      wr.wr.rdma.remote_addr = remote;
      wr.wr.rdma.rkey = remote_mr_->rkey;
    }
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(send_qp_, &wr, &bad);
  }

  ibv_wc send_completion() {
    auto wcs = poll_n(send_cq_, 1);
    EXPECT_EQ(wcs.size(), 1u);
    return wcs.empty() ? ibv_wc{} : wcs[0];
  }

  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* send_cq_ = nullptr;
  ibv_cq* recv_cq_ = nullptr;
  ibv_xrcd* xrcd_ = nullptr;
  ibv_srq* srq_ = nullptr;
  ibv_qp* send_qp_ = nullptr;
  ibv_qp* recv_qp_ = nullptr;
  ibv_mr* local_mr_ = nullptr;
  ibv_mr* remote_mr_ = nullptr;
  std::vector<uint8_t> local_, remote_;
};

TEST_F(Xrc, DeviceReportsXrc) {
  ibv_device_attr attr{};
  ASSERT_EQ(ibv_query_device(context_, &attr), 0);
  EXPECT_TRUE(attr.device_cap_flags & IBV_DEVICE_XRC);
}

TEST_F(Xrc, SendsCompleteOnTheSrqCqWithTheRecvQpNumber) {
  connect();
  ASSERT_EQ(post_srq_recv(srq_, 11, 0, 4096), 0);
  ASSERT_EQ(post_srq_recv(srq_, 12, 4096, 4096), 0);
  std::memset(local_.data(), 0x5a, 3000);
  ASSERT_EQ(post(IBV_WR_SEND, 1, srqn(srq_), 0, 3000), 0);  // three packets at MTU 1024
  ASSERT_EQ(post(IBV_WR_SEND_WITH_IMM, 2, srqn(srq_), 0, 16), 0);
  auto sends = poll_n(send_cq_, 2);
  ASSERT_EQ(sends.size(), 2u);
  for (const ibv_wc& wc : sends) {
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    EXPECT_EQ(wc.qp_num, send_qp_->qp_num);
  }
  auto received = poll_n(recv_cq_, 2);
  ASSERT_EQ(received.size(), 2u);
  EXPECT_EQ(received[0].wr_id, 11u);
  EXPECT_EQ(received[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(received[0].opcode, IBV_WC_RECV);
  EXPECT_EQ(received[0].byte_len, 3000u);
  EXPECT_EQ(received[0].qp_num, recv_qp_->qp_num);  // the XRC_RECV QP, as HCAs report it
  EXPECT_EQ(received[0].src_qp, send_qp_->qp_num);
  EXPECT_EQ(received[1].wr_id, 12u);
  EXPECT_TRUE(received[1].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(received[1].imm_data, htonl(0x1234abcd));
  EXPECT_EQ(received[1].qp_num, recv_qp_->qp_num);
  EXPECT_EQ(std::memcmp(remote_.data(), local_.data(), 3000), 0);
}

TEST_F(Xrc, RdmaAndAtomicsUseTheSrqsProtectionDomain) {
  connect();
  for (int i = 0; i < 2048; ++i) local_[i] = static_cast<uint8_t>(i);
  ASSERT_EQ(post(IBV_WR_RDMA_WRITE, 1, srqn(srq_), 0, 2048, 0), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(remote_.data(), local_.data(), 2048), 0);

  std::memset(remote_.data() + 4096, 0x77, 1500);
  ASSERT_EQ(post(IBV_WR_RDMA_READ, 2, srqn(srq_), 2048, 1500, 4096), 0);
  ibv_wc read = send_completion();
  EXPECT_EQ(read.status, IBV_WC_SUCCESS);
  EXPECT_EQ(read.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(local_[2048], 0x77);
  EXPECT_EQ(local_[2048 + 1499], 0x77);

  uint64_t value = 0x1111;
  std::memcpy(remote_.data() + 8000, &value, 8);
  ASSERT_EQ(post(IBV_WR_ATOMIC_CMP_AND_SWP, 3, srqn(srq_), 4096, 8, 8000), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_SUCCESS);
  ASSERT_EQ(post(IBV_WR_ATOMIC_FETCH_AND_ADD, 4, srqn(srq_), 4104, 8, 8000), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_SUCCESS);
  uint64_t swapped_from = 0, added_to = 0, now = 0;
  std::memcpy(&swapped_from, local_.data() + 4096, 8);
  std::memcpy(&added_to, local_.data() + 4104, 8);
  std::memcpy(&now, remote_.data() + 8000, 8);
  EXPECT_EQ(swapped_from, 0x1111u);
  EXPECT_EQ(added_to, 0x2222u);
  EXPECT_EQ(now, 0x2227u);

  // A write with immediate consumes a receive of the SRQ, on its CQ.
  ASSERT_EQ(post_srq_recv(srq_, 21, 0, 64), 0);
  ASSERT_EQ(post(IBV_WR_RDMA_WRITE_WITH_IMM, 5, srqn(srq_), 0, 32, 256), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_SUCCESS);
  auto received = poll_n(recv_cq_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(received[0].qp_num, recv_qp_->qp_num);
}

// ATOMIC WRITE is a reliable-connection operation: on XRC too, in the XRC
// opcodes over UDP (0xBD, with the XRCETH), its rkey checked in the SRQ's PD.
TEST_F(Xrc, AtomicWriteLandsThroughTheSrqsDomain) {
  connect();
  const uint64_t value = 0x0123456789abcdefull;
  std::memcpy(local_.data() + 512, &value, 8);
  ASSERT_EQ(post(IBV_WR_ATOMIC_WRITE, 6, srqn(srq_), 512, 8, 6000), 0);
  ibv_wc done = send_completion();
  EXPECT_EQ(done.status, IBV_WC_SUCCESS) << ibv_wc_status_str(done.status);
  EXPECT_EQ(done.opcode, IBV_WC_ATOMIC_WRITE);
  uint64_t landed = 0;
  std::memcpy(&landed, remote_.data() + 6000, 8);
  EXPECT_EQ(landed, value);
}

TEST_F(Xrc, ExtendedSendApiSetsTheSrqNumber) {
  connect(nullptr, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM);
  ASSERT_EQ(post_srq_recv(srq_, 31, 0, 64), 0);
  ibv_qp_ex* ex = ibv_qp_to_qp_ex(send_qp_);
  ASSERT_NE(ex, nullptr);
  ibv_wr_start(ex);
  ex->wr_id = 7;
  ex->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send_imm(ex, htonl(99));
  ibv_wr_set_xrc_srqn(ex, srqn(srq_));
  ibv_wr_set_sge(ex, local_mr_->lkey, reinterpret_cast<uint64_t>(local_.data()), 40);
  ASSERT_EQ(ibv_wr_complete(ex), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_SUCCESS);
  auto received = poll_n(recv_cq_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].wr_id, 31u);
  EXPECT_EQ(received[0].byte_len, 40u);
  EXPECT_EQ(received[0].imm_data, htonl(99));
}

TEST_F(Xrc, SrqOfAnotherDomainIsAnInvalidRequest) {
  ibv_xrcd* other = open_domain(context_, -1);
  ASSERT_NE(other, nullptr);
  ibv_srq* foreign = make_srq(other, recv_cq_);
  ASSERT_NE(foreign, nullptr);
  connect();
  ASSERT_EQ(post_srq_recv(foreign, 41, 0, 64), 0);
  ASSERT_EQ(post(IBV_WR_SEND, 1, srqn(foreign), 0, 16), 0);
  ibv_wc wc = send_completion();
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_TRUE(poll_n(recv_cq_, 1, std::chrono::milliseconds(50)).empty());  // nothing landed in the foreign SRQ
  EXPECT_EQ(state_of(send_qp_), IBV_QPS_ERR);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (state_of(recv_qp_) != IBV_QPS_ERR && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(state_of(recv_qp_), IBV_QPS_ERR);  // a class C error fails the responder too
  EXPECT_EQ(ibv_destroy_srq(foreign), 0);
  EXPECT_EQ(ibv_close_xrcd(other), 0);
}

TEST_F(Xrc, SrqNumberThatNamesNoSrqIsAnInvalidRequest) {
  connect();
  const uint32_t missing = srqn(srq_) ^ 0x800000;  // another tag: no SRQ
  ASSERT_EQ(post(IBV_WR_RDMA_WRITE, 1, missing, 0, 16), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_REM_INV_REQ_ERR);
}

TEST_F(Xrc, XrcQpsHaveNoReceiveQueueAndXrcRecvNoSendQueue) {
  connect();
  ibv_sge sge{reinterpret_cast<uint64_t>(remote_.data()), 16, remote_mr_->lkey};
  ibv_recv_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_recv(recv_qp_, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);
  EXPECT_EQ(ibv_post_recv(send_qp_, &wr, &bad), EINVAL);
  ibv_sge send_sge{reinterpret_cast<uint64_t>(local_.data()), 16, local_mr_->lkey};
  ibv_send_wr send{};
  send.sg_list = &send_sge;
  send.num_sge = 1;
  send.opcode = IBV_WR_SEND;
  ibv_send_wr* bad_send = nullptr;
  EXPECT_EQ(ibv_post_send(recv_qp_, &send, &bad_send), EINVAL);
}

TEST_F(Xrc, XrcSrqNeedsItsDomainAndCq) {
  errno = 0;
  EXPECT_EQ(make_srq(xrcd_, recv_cq_, IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(make_srq(xrcd_, recv_cq_, IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_srq* second = make_srq(xrcd_, recv_cq_);
  ASSERT_NE(second, nullptr);
  EXPECT_NE(srqn(second), srqn(srq_));
  EXPECT_EQ(ibv_destroy_cq(recv_cq_), EBUSY);  // the SRQs complete on it
  EXPECT_EQ(ibv_destroy_srq(second), 0);
}

TEST_F(Xrc, ClosingADomainInUseIsBusy) {
  EXPECT_EQ(ibv_close_xrcd(xrcd_), EBUSY);  // its SRQ
  ASSERT_EQ(ibv_destroy_srq(srq_), 0);
  srq_ = nullptr;
  recv_qp_ = make_recv_qp(xrcd_);
  ASSERT_NE(recv_qp_, nullptr);
  EXPECT_EQ(ibv_close_xrcd(xrcd_), EBUSY);  // its XRC_RECV QP
  ASSERT_EQ(ibv_destroy_qp(recv_qp_), 0);
  recv_qp_ = nullptr;
  EXPECT_EQ(ibv_close_xrcd(xrcd_), 0);
  xrcd_ = nullptr;
}

TEST_F(Xrc, TransitionsFollowTheXrcRules) {
  recv_qp_ = make_recv_qp(xrcd_);
  send_qp_ = make_send_qp();
  ASSERT_TRUE(recv_qp_ && send_qp_);
  ASSERT_EQ(to_init(recv_qp_, IBV_QPT_RC, kAllAccess), 0);
  ASSERT_EQ(to_init(send_qp_, IBV_QPT_RC, 0), 0);
  // XRC_SEND has no responder and needs no incoming READ depth or RNR timer
  // at RTR; given (perftest -c XRC gives them), they are ignored, as the
  // kernel's uverbs takes them out of the mask. Others are still refused.
  EXPECT_EQ(xrc_to_rtr(send_qp_, recv_qp_->qp_num, IBV_QP_QKEY), EINVAL);
  ASSERT_EQ(xrc_to_rtr(send_qp_, recv_qp_->qp_num, IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER), 0);
  ASSERT_EQ(xrc_to_rtr(recv_qp_, send_qp_->qp_num), 0);
  // XRC_RECV has no requester: it needs no retry counts or READ depth at
  // RTS, and those given are ignored.
  EXPECT_EQ(xrc_to_rts(recv_qp_, IBV_QP_DEST_QPN), EINVAL);
  ASSERT_EQ(xrc_to_rts(recv_qp_, IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC), 0);
  EXPECT_EQ(state_of(recv_qp_), IBV_QPS_RTS);
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(ibv_query_qp(recv_qp_, &attr, IBV_QP_STATE, &init), 0);
  EXPECT_EQ(init.qp_type, IBV_QPT_XRC_RECV);
  EXPECT_EQ(attr.dest_qp_num, send_qp_->qp_num);
  EXPECT_EQ(attr.retry_cnt, 0) << "ignored";
  EXPECT_EQ(attr.max_rd_atomic, 0) << "ignored";
  ASSERT_EQ(ibv_query_qp(send_qp_, &attr, IBV_QP_STATE, &init), 0);
  EXPECT_EQ(attr.max_dest_rd_atomic, 0) << "ignored";
  EXPECT_EQ(attr.min_rnr_timer, 0) << "ignored";
}

TEST_F(Xrc, OpenedRecvQpOutlivesItsCreatingHandle) {
  connect();
  ibv_qp_open_attr open{};
  open.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  open.qp_num = recv_qp_->qp_num;
  open.xrcd = xrcd_;
  open.qp_type = IBV_QPT_XRC_RECV;
  ibv_qp* opened = ibv_open_qp(context_, &open);
  ASSERT_NE(opened, nullptr) << std::strerror(errno);
  EXPECT_EQ(opened->qp_num, recv_qp_->qp_num);
  EXPECT_EQ(state_of(opened), IBV_QPS_RTS);
  EXPECT_EQ(ibv_close_xrcd(xrcd_), EBUSY);
  ASSERT_EQ(ibv_destroy_qp(recv_qp_), 0);
  recv_qp_ = opened;  // the QP lives on
  ASSERT_EQ(post_srq_recv(srq_, 51, 0, 64), 0);
  ASSERT_EQ(post(IBV_WR_SEND, 1, srqn(srq_), 0, 8), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_SUCCESS);
  auto received = poll_n(recv_cq_, 1);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].qp_num, opened->qp_num);

  // Only XRC_RECV QPs of the same domain can be opened.
  ibv_xrcd* other = open_domain(context_, -1);
  ASSERT_NE(other, nullptr);
  open.xrcd = other;
  errno = 0;
  EXPECT_EQ(ibv_open_qp(context_, &open), nullptr);
  EXPECT_EQ(errno, EINVAL);
  open.xrcd = xrcd_;
  open.qp_num = send_qp_->qp_num;
  EXPECT_EQ(ibv_open_qp(context_, &open), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_close_xrcd(other), 0);
}

TEST_F(Xrc, DomainsOfOneInodeAreOneDomain) {
  DomainFile file;
  ASSERT_GE(file.fd(), 0);
  errno = 0;
  EXPECT_EQ(open_domain(context_, file.fd(), 0), nullptr);  // no domain yet, and no O_CREAT
  EXPECT_EQ(errno, EAGAIN);
  ibv_xrcd* first = open_domain(context_, file.fd());
  ASSERT_NE(first, nullptr);
  errno = 0;
  EXPECT_EQ(open_domain(context_, file.fd(), O_CREAT | O_EXCL), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // Another descriptor of the same file: the same domain, so an XRC_RECV
  // QP made through one delivers into an SRQ made through the other.
  int again = open(file.path().c_str(), O_RDONLY);
  ASSERT_GE(again, 0);
  ibv_xrcd* second = open_domain(context_, again);
  ASSERT_NE(second, nullptr);
  ibv_srq* shared_srq = make_srq(first, recv_cq_);
  ASSERT_NE(shared_srq, nullptr);
  connect(second);
  ASSERT_EQ(post_srq_recv(shared_srq, 61, 0, 64), 0);
  ASSERT_EQ(post(IBV_WR_SEND, 1, srqn(shared_srq), 0, 8), 0);
  EXPECT_EQ(send_completion().status, IBV_WC_SUCCESS);
  EXPECT_EQ(poll_n(recv_cq_, 1).size(), 1u);

  // Another process that opens the inode is in the domain too: it can open
  // the XRC_RECV QP made here; with another file it cannot.
  DomainFile unrelated;
  const uint32_t qpn = recv_qp_->qp_num;
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ibv_context* context = open_softverbs0();
    if (context == nullptr) _exit(10);
    ibv_xrcd* mine = open_domain(context, unrelated.fd());
    ibv_xrcd* theirs = open_domain(context, again, 0);
    if (mine == nullptr || theirs == nullptr) _exit(11);
    ibv_qp_open_attr open{};
    open.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
    open.qp_num = qpn;
    open.qp_type = IBV_QPT_XRC_RECV;
    open.xrcd = mine;
    if (ibv_open_qp(context, &open) != nullptr || errno != EINVAL) _exit(12);
    open.xrcd = theirs;
    ibv_qp* opened = ibv_open_qp(context, &open);
    if (opened == nullptr) _exit(13);
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    if (ibv_query_qp(opened, &attr, IBV_QP_STATE, &init) != 0 || attr.qp_state != IBV_QPS_RTS) _exit(14);
    if (ibv_close_xrcd(theirs) != EBUSY || ibv_destroy_qp(opened) != 0) _exit(15);
    if (ibv_close_xrcd(theirs) != 0 || ibv_close_xrcd(mine) != 0) _exit(16);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;

  ASSERT_EQ(ibv_destroy_qp(recv_qp_), 0);
  recv_qp_ = nullptr;
  EXPECT_EQ(ibv_destroy_srq(shared_srq), 0);
  EXPECT_EQ(ibv_close_xrcd(second), 0);
  EXPECT_EQ(ibv_close_xrcd(first), 0);
  close(again);
}

// The SRQ and the memory its PD's keys name may belong to another process
// of the domain than the XRC_RECV QP: WRITE, READ, atomics, ATOMIC WRITE
// and WRITE with immediate reach that process's memory (over UDP the
// XRC_RECV QP's process places them, by process_vm_writev or the other
// process's copy agent: SOFTVERBS_COPY=agent runs this test again).
TEST_F(Xrc, RdmaAndAtomicsReachAnotherProcessOfTheDomain) {
  DomainFile file;
  ASSERT_GE(file.fd(), 0);
  ibv_xrcd* shared = open_domain(context_, file.fd());
  ASSERT_NE(shared, nullptr);
  connect(shared);

  struct Target {
    uint32_t srqn, rkey;
    uint64_t address;
  };
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Its own context, PD, CQ, XRC SRQ and memory; it checks what landed.
    ibv_context* context = open_softverbs0();
    if (context == nullptr) _exit(10);
    ibv_xrcd* xrcd = open_domain(context, file.fd(), 0);
    ibv_pd* pd = ibv_alloc_pd(context);
    ibv_cq* cq = ibv_create_cq(context, 16, nullptr, nullptr, 0);
    if (xrcd == nullptr || pd == nullptr || cq == nullptr) _exit(11);
    ibv_srq_init_attr_ex attr{};
    attr.attr.max_wr = 16;
    attr.attr.max_sge = 1;
    attr.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
    attr.srq_type = IBV_SRQT_XRC;
    attr.pd = pd;
    attr.xrcd = xrcd;
    attr.cq = cq;
    ibv_srq* srq = ibv_create_srq_ex(context, &attr);
    std::vector<uint8_t> memory(16384, 0);
    for (int i = 0; i < 3000; ++i) memory[8192 + i] = static_cast<uint8_t>(i * 7);
    const uint64_t start = 0x1111;
    std::memcpy(memory.data() + 12000, &start, 8);
    ibv_mr* mr = ibv_reg_mr(pd, memory.data(), memory.size(), kAllAccess);
    if (srq == nullptr || mr == nullptr) _exit(12);
    ibv_sge sge{reinterpret_cast<uint64_t>(memory.data() + 14000), 64, mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = 77;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_srq_recv(srq, &wr, &bad) != 0) _exit(13);
    Target target{0, mr->rkey, reinterpret_cast<uint64_t>(memory.data())};
    if (ibv_get_srq_num(srq, &target.srqn) != 0) _exit(14);
    if (write(to_parent[1], &target, sizeof target) != sizeof target) _exit(15);
    char done = 0;
    if (read(to_child[0], &done, 1) != 1) _exit(16);
    // The WRITE of 5000 bytes (over five 1024-byte packets), the atomics'
    // result, the ATOMIC WRITE, and the WRITE with immediate's completion.
    for (int i = 0; i < 5000; ++i)
      if (memory[i] != static_cast<uint8_t>(i * 3 + 1)) _exit(20);
    uint64_t word = 0;
    std::memcpy(&word, memory.data() + 12000, 8);
    if (word != 0x2227) _exit(21);
    std::memcpy(&word, memory.data() + 12008, 8);
    if (word != 0x0123456789abcdefull) _exit(22);
    if (std::memcmp(memory.data() + 13000, memory.data(), 32) != 0) _exit(23);
    ibv_wc wc{};
    for (int tries = 0; tries < 5000 && ibv_poll_cq(cq, 1, &wc) == 0; ++tries) usleep(1000);
    if (wc.wr_id != 77 || wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM) _exit(24);
    ibv_dereg_mr(mr);
    ibv_destroy_srq(srq);
    ibv_destroy_cq(cq);
    ibv_dealloc_pd(pd);
    ibv_close_xrcd(xrcd);
    ibv_close_device(context);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  // A failed assertion returns early: the child must not wait for ever.
  struct Reaper {
    pid_t child;
    int fds[2];
    ~Reaper() {
      for (int fd : fds) close(fd);
      if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, nullptr, 0);
      }
    }
  } reaper{child, {to_parent[0], to_child[1]}};
  Target target{};
  ASSERT_EQ(read(to_parent[0], &target, sizeof target), static_cast<ssize_t>(sizeof target));

  auto post_to = [&](ibv_wr_opcode opcode, uint32_t offset, uint32_t length, uint64_t remote_offset) {
    ibv_sge sge{reinterpret_cast<uint64_t>(local_.data() + offset), length, local_mr_->lkey};
    ibv_send_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(7);
    wr.qp_type.xrc.remote_srqn = target.srqn;
    if (opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
      wr.wr.atomic.remote_addr = target.address + remote_offset;
      wr.wr.atomic.rkey = target.rkey;
      wr.wr.atomic.compare_add = opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ? 5 : 0x1111;
      wr.wr.atomic.swap = 0x2222;
    } else {
      wr.wr.rdma.remote_addr = target.address + remote_offset;
      wr.wr.rdma.rkey = target.rkey;
    }
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(ibv_post_send(send_qp_, &wr, &bad), 0);
    ibv_wc done = send_completion();
    EXPECT_EQ(done.status, IBV_WC_SUCCESS) << "opcode " << opcode << ": " << ibv_wc_status_str(done.status);
  };
  for (int i = 0; i < 5000; ++i) local_[i] = static_cast<uint8_t>(i * 3 + 1);
  post_to(IBV_WR_RDMA_WRITE, 0, 5000, 0);
  post_to(IBV_WR_RDMA_READ, 5000, 3000, 8192);
  int read_mismatches = 0;
  for (int i = 0; i < 3000; ++i) read_mismatches += local_[5000 + i] != static_cast<uint8_t>(i * 7);
  EXPECT_EQ(read_mismatches, 0);
  post_to(IBV_WR_ATOMIC_CMP_AND_SWP, 8000, 8, 12000);
  post_to(IBV_WR_ATOMIC_FETCH_AND_ADD, 8008, 8, 12000);
  uint64_t swapped_from = 0, added_to = 0;
  std::memcpy(&swapped_from, local_.data() + 8000, 8);
  std::memcpy(&added_to, local_.data() + 8008, 8);
  EXPECT_EQ(swapped_from, 0x1111u);
  EXPECT_EQ(added_to, 0x2222u);
  const uint64_t value = 0x0123456789abcdefull;
  std::memcpy(local_.data() + 8016, &value, 8);
  post_to(IBV_WR_ATOMIC_WRITE, 8016, 8, 12008);
  post_to(IBV_WR_RDMA_WRITE_WITH_IMM, 0, 32, 13000);

  const char done = 1;
  ASSERT_EQ(write(to_child[1], &done, 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  reaper.child = 0;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ASSERT_EQ(ibv_destroy_qp(recv_qp_), 0);
  recv_qp_ = nullptr;
  EXPECT_EQ(ibv_close_xrcd(shared), 0);
}

}  // namespace
}  // namespace softverbs::test
