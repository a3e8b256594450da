// A correct program for the verbs checker's tests (check_tools_test): a
// receive from an SRQ completes for a QP that never posted anything (as
// some of UCX's do), or for one destroyed before the completion is polled;
// the program posts the same buffer to the SRQ again, and a second,
// shorter message lands in it through a QP that posts. The bytes past the
// second message are the first message's: the device wrote them before
// the repost, so `softverbs run --check=error` must report nothing. Exits
// 0 when every step went as expected, 3 if the first completion never
// came. Its argument: the GID index to address the QPs by (default 0).
#include <infiniband/verbs.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "loopback.h"  // examples/bugs: fail, connect

namespace {

using bugs::fail;

ibv_qp* make_qp(ibv_pd* pd, ibv_cq* send_cq, ibv_cq* recv_cq, ibv_srq* srq) {
  ibv_qp_init_attr attr{};
  attr.send_cq = send_cq;
  attr.recv_cq = recv_cq;
  attr.srq = srq;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = 1;
  attr.cap = {4, srq != nullptr ? 0u : 4u, 1, 1, 0};
  ibv_qp* qp = ibv_create_qp(pd, &attr);
  if (qp == nullptr) fail("ibv_create_qp");
  return qp;
}

// Connects `qp` afresh, whatever its state (the sender is connected to
// each new receiver in turn).
void connect(ibv_qp* qp, uint32_t peer_qpn, const ibv_gid& gid, uint8_t gid_index) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RESET;
  if (ibv_modify_qp(qp, &attr, IBV_QP_STATE)) fail("modify to RESET");
  bugs::connect(qp, peer_qpn, gid, gid_index);
}

// The next completion of `cq` within two seconds; false if none came.
bool next_completion(ibv_cq* cq, ibv_wc& wc) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < until) {
    const int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) fail("ibv_poll_cq");
    if (n == 1) return true;
  }
  return false;
}

void send(ibv_qp* qp, ibv_mr* mr, const char* bytes, uint32_t length, ibv_cq* cq) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(bytes), length, mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = length;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(qp, &wr, &bad)) fail("ibv_post_send");
  ibv_wc wc{};
  if (!next_completion(cq, wc) || wc.status != IBV_WC_SUCCESS) fail("the SEND's completion");
}

// `from` sends 8 bytes to `to`, whose receive completes on `cq` as the
// send does.
void answer(ibv_qp* from, ibv_qp* to, ibv_mr* mr, char* bytes, ibv_cq* cq) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(bytes), 8, mr->lkey};
  ibv_recv_wr receive{};
  receive.wr_id = 100;
  receive.sg_list = &sge;
  receive.num_sge = 1;
  ibv_recv_wr* bad_receive = nullptr;
  if (ibv_post_recv(to, &receive, &bad_receive)) fail("ibv_post_recv");
  ibv_send_wr wr{};
  wr.wr_id = 101;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(from, &wr, &bad)) fail("ibv_post_send");
  for (int i = 0; i < 2; ++i) {
    ibv_wc wc{};
    if (!next_completion(cq, wc) || wc.status != IBV_WC_SUCCESS) fail("the answer's completions");
  }
}

void post_srq_receive(ibv_srq* srq, ibv_mr* mr, char* buffer, uint32_t length) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(buffer), length, mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = 7;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (ibv_post_srq_recv(srq, &wr, &bad)) fail("ibv_post_srq_recv");
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  if (devices == nullptr || count == 0) fail("no RDMA device");
  ibv_context* context = ibv_open_device(devices[0]);
  ibv_free_device_list(devices);
  if (context == nullptr) fail("ibv_open_device");
  ibv_pd* pd = ibv_alloc_pd(context);
  ibv_cq* sends = ibv_create_cq(context, 16, nullptr, nullptr, 0);
  ibv_cq* receives = ibv_create_cq(context, 16, nullptr, nullptr, 0);
  ibv_cq* back = ibv_create_cq(context, 16, nullptr, nullptr, 0);
  ibv_srq_init_attr srq_attr{};
  srq_attr.attr.max_wr = 8;
  srq_attr.attr.max_sge = 1;
  ibv_srq* srq = ibv_create_srq(pd, &srq_attr);
  if (pd == nullptr || sends == nullptr || receives == nullptr || back == nullptr || srq == nullptr)
    fail("PD, CQs, SRQ");
  static char first[64], second[17], buffer[256], small[8];
  std::memset(first, 'A', sizeof first);
  std::memset(second, 'B', sizeof second);
  ibv_mr* mr_first = ibv_reg_mr(pd, first, sizeof first, 0);
  ibv_mr* mr_second = ibv_reg_mr(pd, second, sizeof second, 0);
  ibv_mr* mr_buffer = ibv_reg_mr(pd, buffer, sizeof buffer, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* mr_small = ibv_reg_mr(pd, small, sizeof small, IBV_ACCESS_LOCAL_WRITE);
  if (mr_first == nullptr || mr_second == nullptr || mr_buffer == nullptr || mr_small == nullptr) fail("ibv_reg_mr");
  ibv_gid gid;
  const auto gid_index = static_cast<uint8_t>(argc > 1 ? std::atoi(argv[1]) : 0);
  if (ibv_query_gid(context, 1, gid_index, &gid)) fail("ibv_query_gid");

  ibv_qp* sender = make_qp(pd, sends, back, nullptr);
  ibv_qp* receiver = nullptr;
  // A new receiver QP on the SRQ, connected with the sender; it posts a
  // SEND of its own if `posts`.
  auto new_receiver = [&](bool posts) {
    receiver = make_qp(pd, back, receives, srq);
    connect(sender, receiver->qp_num, gid, gid_index);
    connect(receiver, sender->qp_num, gid, gid_index);
    if (posts) answer(receiver, sender, mr_small, small, back);
  };
  for (const bool destroyed_first : {false, true}) {
    // The first message, into the buffer through a receiver that never
    // posts, or one destroyed before the completion is polled.
    new_receiver(/*posts=*/destroyed_first);
    post_srq_receive(srq, mr_buffer, buffer, sizeof buffer);
    send(sender, mr_first, first, sizeof first, sends);
    if (destroyed_first && ibv_destroy_qp(receiver)) fail("ibv_destroy_qp");
    ibv_wc wc{};
    if (!next_completion(receives, wc)) {
      std::fprintf(stderr, "no completion for the first receive\n");
      return 3;
    }
    if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 7 || wc.byte_len != sizeof first) fail("the first receive");
    if (!destroyed_first && ibv_destroy_qp(receiver)) fail("ibv_destroy_qp");

    // The same buffer again, and a shorter message through a receiver that
    // posts (which the checker follows).
    post_srq_receive(srq, mr_buffer, buffer, sizeof buffer);
    new_receiver(/*posts=*/true);
    send(sender, mr_second, second, sizeof second, sends);
    if (!next_completion(receives, wc) || wc.status != IBV_WC_SUCCESS || wc.wr_id != 7 || wc.byte_len != sizeof second)
      fail("the second receive");
    if (std::memcmp(buffer, second, sizeof second) != 0 || buffer[sizeof second] != 'A') fail("the buffer's bytes");
    if (ibv_destroy_qp(receiver)) fail("ibv_destroy_qp");
    std::printf("%s: second message placed over the first, checked\n",
                destroyed_first ? "first receiver destroyed before the poll" : "first receiver never posted");
  }

  ibv_destroy_qp(sender);
  ibv_destroy_srq(srq);
  ibv_dereg_mr(mr_first);
  ibv_dereg_mr(mr_second);
  ibv_dereg_mr(mr_buffer);
  ibv_dereg_mr(mr_small);
  ibv_destroy_cq(sends);
  ibv_destroy_cq(back);
  ibv_destroy_cq(receives);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  return 0;
}
