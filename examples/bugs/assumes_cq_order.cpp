// BUG (on purpose): two QPs share one CQ; the program posts a WRITE on the
// first, then one on the second, and takes the first completion it polls
// for the first QP's. The IB spec orders completions within one work queue
// only: an HCA may complete the second QP's WRITE first. It passes on a
// device that happens to complete in posting order, and fails under
// `softverbs run --adversarial`.
#include <cstdio>
#include <vector>

#include "loopback_qps.h"

int main() {
  bugs::Device device;
  ibv_cq* cq = ibv_create_cq(device.context, 64, nullptr, nullptr, 0);
  if (cq == nullptr) bugs::fail("ibv_create_cq");
  bugs::QpPair first(device, cq), second(device, cq);
  std::vector<char> source(256, 'x'), target(2 * 256);
  ibv_mr* source_mr = ibv_reg_mr(device.pd, source.data(), source.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* target_mr =
      ibv_reg_mr(device.pd, target.data(), target.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (source_mr == nullptr || target_mr == nullptr) bugs::fail("ibv_reg_mr");
  const auto remote = reinterpret_cast<uint64_t>(target.data());
  for (int round = 0; round < 200; ++round) {
    bugs::post_write(first.a, source_mr, 256, remote, target_mr->rkey, 1);
    bugs::post_write(second.a, source_mr, 256, remote + 256, target_mr->rkey, 2);
    const ibv_wc earlier = bugs::wait_success(cq);
    if (earlier.wr_id != 1 || earlier.qp_num != first.a->qp_num) {
      std::fprintf(stderr, "BUG: round %d: expected the first QP's WRITE to complete first, got wr_id %llu of QP %#x\n",
                   round, static_cast<unsigned long long>(earlier.wr_id), earlier.qp_num);
      return 1;
    }
    bugs::wait_success(cq);
  }
  std::printf("completions came in posting order\n");
  return 0;
}
