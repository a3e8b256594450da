// Latency with many idle QPs: a SEND ping-pong between two processes on one
// RC QP pair, busy-polling their CQs, while the first process also holds
// IDLE other RC QPs, connected in pairs to one another and in RTS, that
// carry nothing. A device whose per-operation work grows with the number of
// QPs in the process shows here; bench/scale.py compares IDLE=10000 with
// IDLE=0. With `rnr`, one of the idle QPs has a SEND posted that waits for
// a receive its peer never posts (RNR retried forever, every 491 ms), as a
// process with many QPs often has one. Linked with libibverbs only; run it
// under `softverbs run`.
//
// usage: idle_qps IDLE ITERATIONS [rnr]
// prints: idle_qps_one_way_us median=M idle=IDLE setup_s=S
#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kDepth = 16;
constexpr uint32_t kMessageBytes = 8;

struct Address {
  uint32_t qpn = 0;
  ibv_gid gid{};
};

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "idle_qps: %s: %s\n", what, std::strerror(errno));
  std::exit(1);
}

bool exchange(int fd, const Address& mine, Address& theirs) {
  if (write(fd, &mine, sizeof mine) != sizeof mine) return false;
  return read(fd, &theirs, sizeof theirs) == sizeof theirs;
}

class Side {
 public:
  Side() {
    int count = 0;
    ibv_device** list = ibv_get_device_list(&count);
    for (int i = 0; list && i < count; ++i)
      if (std::strcmp(ibv_get_device_name(list[i]), "softverbs0") == 0) context_ = ibv_open_device(list[i]);
    if (list) ibv_free_device_list(list);
    if (!context_) die("no softverbs0");
    static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    for (int index = 0; index < 32 && gid_index_ < 0; ++index) {
      ibv_gid_entry entry{};
      if (ibv_query_gid_ex(context_, 1, static_cast<uint32_t>(index), &entry, 0) != 0) continue;
      if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && std::memcmp(entry.gid.raw, kMapped, 12) == 0) {
        gid_index_ = index;
        gid_ = entry.gid;
      }
    }
    pd_ = ibv_alloc_pd(context_);
    cq_ = ibv_create_cq(context_, 4 * kDepth, nullptr, nullptr, 0);
    idle_cq_ = ibv_create_cq(context_, 16, nullptr, nullptr, 0);
    mr_ = ibv_reg_mr(pd_, buffer_, sizeof buffer_, IBV_ACCESS_LOCAL_WRITE);
    if (gid_index_ < 0 || !pd_ || !cq_ || !idle_cq_ || !mr_) die("device objects");
    probe_ = create(cq_);
  }

  // `count` more QPs, connected in pairs to one another, left idle.
  void add_idle(int count, bool one_waits) {
    for (int i = 0; i + 1 < count; i += 2) {
      ibv_qp* a = create(idle_cq_);
      ibv_qp* b = create(idle_cq_);
      connect(a, {b->qp_num, gid_});
      connect(b, {a->qp_num, gid_}, kLongestRnrTimer);
      idle_.push_back(a);
      idle_.push_back(b);
    }
    if (one_waits && !idle_.empty()) {
      ibv_sge sge{reinterpret_cast<uint64_t>(buffer_), kMessageBytes, mr_->lkey};
      ibv_send_wr wr{};
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_SEND;
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(idle_[0], &wr, &bad)) die("ibv_post_send");
    }
  }

  Address address() const { return {probe_->qp_num, gid_}; }

  void connect_probe(const Address& peer) {
    connect(probe_, peer);
    for (int i = 0; i < kDepth; ++i) post_receive();
  }

  // One SEND to the peer, then its answer: the round trip's duration.
  void send() {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_), kMessageBytes, mr_->lkey};
    ibv_send_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(probe_, &wr, &bad)) die("ibv_post_send");
    ++sends_outstanding_;
  }

  // Waits for the next received SEND (taking send completions on the way).
  void receive() {
    for (;;) {
      ibv_wc wc[4];
      const int got = ibv_poll_cq(cq_, 4, wc);
      if (got < 0) die("ibv_poll_cq");
      bool received = false;
      for (int k = 0; k < got; ++k) {
        if (wc[k].status != IBV_WC_SUCCESS) {
          std::fprintf(stderr, "idle_qps: %s\n", ibv_wc_status_str(wc[k].status));
          std::exit(1);
        }
        if (wc[k].opcode == IBV_WC_RECV) {
          post_receive();
          received = true;
        } else {
          --sends_outstanding_;
        }
      }
      if (received && sends_outstanding_ < kDepth / 2) return;
    }
  }

  ~Side() {
    ibv_destroy_qp(probe_);
    for (ibv_qp* qp : idle_) ibv_destroy_qp(qp);
    ibv_dereg_mr(mr_);
    ibv_destroy_cq(idle_cq_);
    ibv_destroy_cq(cq_);
    ibv_dealloc_pd(pd_);
    ibv_close_device(context_);
  }

 private:
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_cq* idle_cq_ = nullptr;
  ibv_mr* mr_ = nullptr;
  ibv_qp* probe_ = nullptr;
  std::vector<ibv_qp*> idle_;
  int gid_index_ = -1;
  ibv_gid gid_{};
  int sends_outstanding_ = 0;
  alignas(64) uint8_t buffer_[4096] = {};

  ibv_qp* create(ibv_cq* cq) {
    ibv_qp_init_attr init{};
    init.send_cq = init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap = {kDepth, kDepth, 1, 1, 64};
    ibv_qp* qp = ibv_create_qp(pd_, &init);
    if (!qp) die("ibv_create_qp");
    return qp;
  }

  static constexpr uint8_t kLongestRnrTimer = 31;  // 491 ms

  void connect(ibv_qp* qp, const Address& peer, uint8_t min_rnr_timer = 1) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.port_num = 1;
    attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE;
    if (ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) die("INIT");
    attr = {};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = IBV_MTU_4096;
    attr.dest_qp_num = peer.qpn;
    attr.ah_attr.port_num = 1;
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = peer.gid;
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
    attr.ah_attr.grh.hop_limit = 64;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = min_rnr_timer;
    if (ibv_modify_qp(qp, &attr,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      die("RTR");
    attr = {};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.max_rd_atomic = 1;
    if (ibv_modify_qp(qp, &attr,
                      IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_MAX_QP_RD_ATOMIC))
      die("RTS");
  }

  void post_receive() {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_ + 2048), kMessageBytes, mr_->lkey};
    ibv_recv_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_recv(probe_, &wr, &bad)) die("ibv_post_recv");
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4 || (argc == 4 && std::strcmp(argv[3], "rnr") != 0)) {
    std::fprintf(stderr, "usage: idle_qps IDLE ITERATIONS [rnr]\n");
    return 2;
  }
  const int idle = std::atoi(argv[1]);
  const int iterations = std::atoi(argv[2]);
  const int warmup = std::max(100, iterations / 10);
  int sockets[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sockets)) die("socketpair");
  const pid_t child = fork();
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    Side echo;
    Address peer;
    if (!exchange(sockets[1], echo.address(), peer)) _exit(1);
    echo.connect_probe(peer);
    char ready = 0;
    if (write(sockets[1], &ready, 1) != 1) _exit(1);
    for (int i = 0; i < warmup + iterations; ++i) {
      echo.receive();
      echo.send();
    }
    if (read(sockets[1], &ready, 1) != 1) _exit(1);  // the other side is done with the QP
    _exit(0);
  }
  Side probe;
  const auto setup_start = Clock::now();
  probe.add_idle(idle, argc == 4);
  const double setup = std::chrono::duration<double>(Clock::now() - setup_start).count();
  Address peer;
  char ready = 0;
  if (!exchange(sockets[0], probe.address(), peer)) die("exchange");
  probe.connect_probe(peer);
  if (read(sockets[0], &ready, 1) != 1) die("peer");
  std::vector<double> one_way;
  one_way.reserve(iterations);
  for (int i = 0; i < warmup + iterations; ++i) {
    const auto start = Clock::now();
    probe.send();
    probe.receive();
    if (i >= warmup) one_way.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() / 2);
  }
  if (write(sockets[0], &ready, 1) != 1) die("peer");
  int status = 0;
  waitpid(child, &status, 0);
  std::nth_element(one_way.begin(), one_way.begin() + one_way.size() / 2, one_way.end());
  std::printf("idle_qps_one_way_us median=%.3f idle=%d setup_s=%.2f\n", one_way[one_way.size() / 2], idle, setup);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
