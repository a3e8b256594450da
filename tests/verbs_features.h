// The fixture of verbs_features_test (domains, completion timestamps,
// address handles): softverbs0 opened with a PD and two CQs, and an RC pair
// of QPs of one process, connected to each other through the device's IPv4
// GID, so that the same tests run on a shared-memory and on a UDP device.
#pragma once

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "device_fixture.h"
#include "qp_setup.h"

namespace softverbs::test {

class DeviceFixture : public DeviceObjects<::testing::Test> {};

// Polls `cq` until one completion arrives (false after 5 s).
inline bool poll_one(ibv_cq* cq, ibv_wc& wc) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    if (ibv_poll_cq(cq, 1, &wc) == 1) return true;
    std::this_thread::yield();
  }
  return false;
}

// Two RC QPs, A and B, each with a 4 KiB registered buffer. A is made in
// `pd_a` and its buffer in `pd_b`, B the other way round: a QP of either
// domain uses an MR of the other.
struct Pair {
  ibv_qp* qp_a = nullptr;
  ibv_qp* qp_b = nullptr;
  ibv_cq* cq_a = nullptr;
  ibv_cq* cq_b = nullptr;
  ibv_mr* mr_a = nullptr;
  ibv_mr* mr_b = nullptr;
  std::vector<uint8_t> buffer_a = std::vector<uint8_t>(4096), buffer_b = std::vector<uint8_t>(4096);

  ~Pair() { destroy(); }

  bool create(ibv_pd* pd_a, ibv_pd* pd_b, ibv_cq* a_cq, ibv_cq* b_cq) {
    cq_a = a_cq;
    cq_b = b_cq;
    qp_a = make_qp(pd_a, cq_a);
    qp_b = make_qp(pd_b, cq_b);
    mr_a = ibv_reg_mr(pd_b, buffer_a.data(), buffer_a.size(), kAllAccess);
    mr_b = ibv_reg_mr(pd_a, buffer_b.data(), buffer_b.size(), kAllAccess);
    return qp_a && qp_b && mr_a && mr_b;
  }

  bool connect() {
    return to_init(qp_a, IBV_QPT_RC, kAllAccess) == 0 && to_init(qp_b, IBV_QPT_RC, kAllAccess) == 0 &&
           to_rtr(qp_a, IBV_QPT_RC, qp_b->qp_num) == 0 && to_rtr(qp_b, IBV_QPT_RC, qp_a->qp_num) == 0 &&
           to_rts(qp_a, IBV_QPT_RC) == 0 && to_rts(qp_b, IBV_QPT_RC) == 0;
  }

  // An RDMA WRITE of 64 bytes from A into B's buffer, then a SEND of 32
  // bytes into a receive of B's at offset 1024: both complete successfully
  // and the bytes arrive.
  ::testing::AssertionResult write_and_send() {
    for (size_t i = 0; i < 64; ++i) buffer_a[i] = static_cast<uint8_t>(i + 1);
    ibv_sge recv_sge{reinterpret_cast<uint64_t>(buffer_b.data() + 1024), 32, mr_b->lkey};
    ibv_recv_wr recv{};
    recv.wr_id = 2;
    recv.sg_list = &recv_sge;
    recv.num_sge = 1;
    ibv_recv_wr* bad_recv = nullptr;
    if (ibv_post_recv(qp_b, &recv, &bad_recv) != 0) return ::testing::AssertionFailure() << "post_recv";
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_a.data()), 64, mr_a->lkey};
    ibv_send_wr write{};
    write.wr_id = 1;
    write.sg_list = &sge;
    write.num_sge = 1;
    write.opcode = IBV_WR_RDMA_WRITE;
    write.send_flags = IBV_SEND_SIGNALED;
    write.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(buffer_b.data());
    write.wr.rdma.rkey = mr_b->rkey;
    ibv_sge send_sge{reinterpret_cast<uint64_t>(buffer_a.data()), 32, mr_a->lkey};
    ibv_send_wr send{};
    send.wr_id = 3;
    send.sg_list = &send_sge;
    send.num_sge = 1;
    send.opcode = IBV_WR_SEND;
    send.send_flags = IBV_SEND_SIGNALED;
    write.next = &send;
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp_a, &write, &bad) != 0) return ::testing::AssertionFailure() << "post_send";
    int sends = 0, receives = 0;
    ibv_wc wc{};
    while (sends < 2 || receives < 1) {
      ibv_cq* cq = (sends < 2) ? cq_a : cq_b;
      if (!poll_one(cq, wc)) return ::testing::AssertionFailure() << "no completion";
      if (wc.status != IBV_WC_SUCCESS) return ::testing::AssertionFailure() << ibv_wc_status_str(wc.status);
      (wc.opcode == IBV_WC_RECV ? receives : sends) += 1;
    }
    if (std::memcmp(buffer_b.data(), buffer_a.data(), 64) != 0 ||
        std::memcmp(buffer_b.data() + 1024, buffer_a.data(), 32) != 0)
      return ::testing::AssertionFailure() << "the bytes did not arrive";
    return ::testing::AssertionSuccess();
  }

  void destroy() {
    for (ibv_qp** qp : {&qp_a, &qp_b})
      if (*qp) {
        EXPECT_EQ(ibv_destroy_qp(*qp), 0);
        *qp = nullptr;
      }
    for (ibv_mr** mr : {&mr_a, &mr_b})
      if (*mr) {
        EXPECT_EQ(ibv_dereg_mr(*mr), 0);
        *mr = nullptr;
      }
  }

 private:
  static ibv_qp* make_qp(ibv_pd* pd, ibv_cq* cq) {
    ibv_qp_init_attr init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap = {16, 16, 1, 1, 0};
    return ibv_create_qp(pd, &init);
  }
};

}  // namespace softverbs::test
