// N processes, each with an RC QP to every other, all sending at once: to
// each peer an RDMA WRITE and a SEND of every size in kSizes (up to 1 MiB),
// posted round-robin over the peers so that every QP is busy together. Each
// process then checks every byte it received, and that the bytes around
// each message are still zero. What MPI jobs and storage clients do when
// they connect N x N. Linked with libibverbs only; run it under `softverbs
// run` (it forks its N workers before any of them opens the device).
//
// usage: all_to_all [processes (default 8)] [largest message in bytes
// (default 1048576)]. Exit status 0 when every byte arrived as sent.
#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxProcesses = 64;
constexpr uint32_t kSizes[] = {1, 100, 4095, 4096, 4097, 65536, 300001, 1 << 20};
constexpr int kMessages = sizeof kSizes / sizeof kSizes[0];
// Bytes after each message's place that must stay zero.
constexpr uint32_t kGuard = 64;
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

struct Endpoint {
  uint32_t qpn = 0;
  uint32_t rkey = 0;
  uint64_t address = 0;  // where the peer's WRITEs to this process go
  ibv_gid gid{};
};

// Shared by the launcher and its workers (an anonymous shared mapping made
// before the fork). endpoints[i][j]: worker i's QP towards worker j.
struct Board {
  Endpoint endpoints[kMaxProcesses][kMaxProcesses];
  std::atomic<int> created;
  std::atomic<int> connected;
  std::atomic<int> checked;
  std::atomic<int> failed;
};

// The byte at `offset` of message `message` from worker `from` to `to`:
// different for every message, sender and receiver, and along the message.
uint8_t pattern(int from, int to, int message, size_t offset) {
  const uint32_t mixed = static_cast<uint32_t>(offset) * 2654435761u;
  return static_cast<uint8_t>((mixed >> 13) ^ (offset >> 8) ^
                              static_cast<uint32_t>(from * 37 + to * 11 + message * 101));
}

// Each message's offset within a peer's area, kGuard bytes apart.
struct Layout {
  uint32_t largest;
  std::vector<size_t> offsets;
  size_t per_peer = 0;

  explicit Layout(uint32_t largest_bytes) : largest(largest_bytes) {
    for (uint32_t size : kSizes) {
      offsets.push_back(per_peer);
      per_peer += std::min(size, largest) + kGuard;
    }
  }
  uint32_t size(int message) const { return std::min(kSizes[message], largest); }
};

int gid_index_of_ipv4(ibv_context* context, ibv_gid& gid) {
  static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  for (int index = 0; index < 32; ++index) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, 1, static_cast<uint32_t>(index), &entry, 0) != 0) continue;
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && std::memcmp(entry.gid.raw, kMapped, 12) == 0) {
      gid = entry.gid;
      return index;
    }
  }
  return -1;
}

void wait_for(const std::atomic<int>& counter, int value, const std::atomic<int>& failed) {
  while (counter.load() < value && failed.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

class Worker {
 public:
  Worker(Board& board, int me, int processes, uint32_t largest)
      : board_(board), me_(me), processes_(processes), layout_(largest), qps_(processes, nullptr) {}

  ~Worker() {
    for (ibv_qp* qp : qps_)
      if (qp) ibv_destroy_qp(qp);
    for (ibv_mr* mr : {source_mr_, inbox_mr_})
      if (mr) ibv_dereg_mr(mr);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (context_) ibv_close_device(context_);
  }

  // 0 when everything arrived byte-exact; else what failed, on stderr.
  int run() {
    if (!create()) return fail("setting up the device objects");
    board_.created++;
    wait_for(board_.created, processes_, board_.failed);
    if (board_.failed) return 1;
    if (!connect()) return fail("connecting the QPs");
    board_.connected++;
    wait_for(board_.connected, processes_, board_.failed);
    if (board_.failed) return 1;
    if (!post_all()) return fail("posting");
    if (!complete_all()) return 1;
    if (!check_all()) return 1;
    board_.checked++;
    // Every QP stays until every peer has checked: a QP destroyed early
    // would leave a peer's last ACK nowhere to go.
    wait_for(board_.checked, processes_, board_.failed);
    return board_.failed ? 1 : 0;
  }

 private:
  Board& board_;
  const int me_;
  const int processes_;
  const Layout layout_;
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::vector<ibv_qp*> qps_;
  // What this worker sends: per peer, each message's bytes at its layout offset.
  std::vector<uint8_t> source_;
  // What peers WRITE into (first half) and SEND into (second half), one area per peer.
  std::vector<uint8_t> inbox_;
  ibv_mr* source_mr_ = nullptr;
  ibv_mr* inbox_mr_ = nullptr;
  int gid_index_ = -1;
  ibv_gid gid_{};

  int fail(const char* what) {
    std::fprintf(stderr, "all_to_all worker %d: %s failed: %s\n", me_, what, std::strerror(errno));
    board_.failed = 1;
    return 1;
  }

  uint8_t* written_by(int peer) { return inbox_.data() + peer * layout_.per_peer; }
  uint8_t* sent_by(int peer) { return inbox_.data() + (processes_ + peer) * layout_.per_peer; }

  bool create() {
    int count = 0;
    ibv_device** list = ibv_get_device_list(&count);
    for (int i = 0; list && i < count; ++i)
      if (std::strcmp(ibv_get_device_name(list[i]), "softverbs0") == 0) context_ = ibv_open_device(list[i]);
    if (list) ibv_free_device_list(list);
    if (!context_) return false;
    gid_index_ = gid_index_of_ipv4(context_, gid_);
    pd_ = ibv_alloc_pd(context_);
    const int depth = 2 * kMessages;
    cq_ = ibv_create_cq(context_, processes_ * depth * 2, nullptr, nullptr, 0);
    if (gid_index_ < 0 || !pd_ || !cq_) return false;
    source_.resize(processes_ * layout_.per_peer);
    for (int peer = 0; peer < processes_; ++peer)
      for (int m = 0; m < kMessages; ++m)
        for (size_t k = 0; k < layout_.size(m); ++k)
          source_[peer * layout_.per_peer + layout_.offsets[m] + k] = pattern(me_, peer, m, k);
    inbox_.assign(2 * processes_ * layout_.per_peer, 0);
    source_mr_ = ibv_reg_mr(pd_, source_.data(), source_.size(), IBV_ACCESS_LOCAL_WRITE);
    inbox_mr_ = ibv_reg_mr(pd_, inbox_.data(), inbox_.size(), kAccess);
    if (!source_mr_ || !inbox_mr_) return false;
    for (int peer = 0; peer < processes_; ++peer) {
      if (peer == me_) continue;
      ibv_qp_init_attr init{};
      init.send_cq = init.recv_cq = cq_;
      init.qp_type = IBV_QPT_RC;
      init.cap = {static_cast<uint32_t>(depth), static_cast<uint32_t>(kMessages), 1, 1, 0};
      qps_[peer] = ibv_create_qp(pd_, &init);
      if (!qps_[peer]) return false;
      board_.endpoints[me_][peer] = {qps_[peer]->qp_num, inbox_mr_->rkey, reinterpret_cast<uint64_t>(written_by(peer)),
                                     gid_};
    }
    return true;
  }

  bool connect() {
    for (int peer = 0; peer < processes_; ++peer) {
      if (peer == me_) continue;
      ibv_qp* qp = qps_[peer];
      const Endpoint& remote = board_.endpoints[peer][me_];
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_INIT;
      attr.port_num = 1;
      attr.qp_access_flags = kAccess;
      if (ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) return false;
      attr = {};
      attr.qp_state = IBV_QPS_RTR;
      attr.path_mtu = IBV_MTU_4096;
      attr.dest_qp_num = remote.qpn;
      attr.ah_attr.port_num = 1;
      attr.ah_attr.is_global = 1;
      attr.ah_attr.grh.dgid = remote.gid;
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
      attr.ah_attr.grh.hop_limit = 64;
      attr.max_dest_rd_atomic = 1;
      attr.min_rnr_timer = 1;
      if (ibv_modify_qp(qp, &attr,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return false;
      attr = {};
      attr.qp_state = IBV_QPS_RTS;
      attr.timeout = 14;  // 67 ms: N busy processes share 2 cores
      attr.retry_cnt = 7;
      attr.rnr_retry = 7;
      attr.max_rd_atomic = 1;
      if (ibv_modify_qp(qp, &attr,
                        IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                            IBV_QP_MAX_QP_RD_ATOMIC))
        return false;
      // The receives for the peer's SENDs, each kGuard longer than the
      // SEND, so that a SEND delivered too long would show.
      for (int m = 0; m < kMessages; ++m) {
        ibv_sge sge{reinterpret_cast<uint64_t>(sent_by(peer) + layout_.offsets[m]), layout_.size(m) + kGuard,
                    inbox_mr_->lkey};
        ibv_recv_wr wr{};
        wr.wr_id = static_cast<uint64_t>(peer) << 8 | static_cast<uint64_t>(m);
        wr.sg_list = &sge;
        wr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        if (ibv_post_recv(qp, &wr, &bad)) return false;
      }
    }
    return true;
  }

  // Message by message, peer by peer: every QP has work at once.
  bool post_all() {
    for (int m = 0; m < kMessages; ++m)
      for (int step = 1; step < processes_; ++step) {
        const int peer = (me_ + step) % processes_;
        const Endpoint& remote = board_.endpoints[peer][me_];
        uint8_t* bytes = source_.data() + peer * layout_.per_peer + layout_.offsets[m];
        ibv_sge sge{reinterpret_cast<uint64_t>(bytes), layout_.size(m), source_mr_->lkey};
        ibv_send_wr write{};
        write.wr_id = static_cast<uint64_t>(peer) << 8 | static_cast<uint64_t>(m);
        write.sg_list = &sge;
        write.num_sge = 1;
        write.opcode = IBV_WR_RDMA_WRITE;
        write.send_flags = IBV_SEND_SIGNALED;
        write.wr.rdma.remote_addr = remote.address + layout_.offsets[m];
        write.wr.rdma.rkey = remote.rkey;
        ibv_send_wr send = write;
        send.opcode = IBV_WR_SEND;
        send.wr = {};
        write.next = &send;
        ibv_send_wr* bad = nullptr;
        if (ibv_post_send(qps_[peer], &write, &bad)) return false;
      }
    return true;
  }

  // Every WRITE and SEND this worker posted, and every SEND its peers sent
  // it, completed successfully.
  bool complete_all() {
    const int peers = processes_ - 1;
    int sends_left = 2 * kMessages * peers;
    int receives_left = kMessages * peers;
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    ibv_wc wc[32];
    while (sends_left + receives_left > 0) {
      if (board_.failed) return false;
      if (Clock::now() > deadline) {
        std::fprintf(stderr, "all_to_all worker %d: %d sends and %d receives never completed\n", me_, sends_left,
                     receives_left);
        board_.failed = 1;
        return false;
      }
      const int got = ibv_poll_cq(cq_, 32, wc);
      if (got < 0) return fail("ibv_poll_cq");
      if (got == 0) std::this_thread::yield();  // N workers share the cores
      for (int k = 0; k < got; ++k) {
        const int peer = static_cast<int>(wc[k].wr_id >> 8);
        const int m = static_cast<int>(wc[k].wr_id & 0xff);
        if (wc[k].status != IBV_WC_SUCCESS) {
          std::fprintf(stderr, "all_to_all worker %d: peer %d message %d (%u B, opcode %d): %s\n", me_, peer, m,
                       layout_.size(m), wc[k].opcode, ibv_wc_status_str(wc[k].status));
          board_.failed = 1;
          return false;
        }
        if (wc[k].opcode == IBV_WC_RECV) {
          if (wc[k].byte_len != layout_.size(m) || wc[k].qp_num != qps_[peer]->qp_num) {
            std::fprintf(stderr, "all_to_all worker %d: SEND %d from %d: %u B on QP %u, expected %u B on QP %u\n", me_,
                         m, peer, wc[k].byte_len, wc[k].qp_num, layout_.size(m), qps_[peer]->qp_num);
            board_.failed = 1;
            return false;
          }
          --receives_left;
        } else {
          --sends_left;
        }
      }
    }
    return true;
  }

  bool check_area(const uint8_t* area, int peer, const char* how) {
    for (int m = 0; m < kMessages; ++m) {
      const uint8_t* at = area + layout_.offsets[m];
      for (size_t k = 0; k < layout_.size(m) + kGuard; ++k) {
        const uint8_t expected = k < layout_.size(m) ? pattern(peer, me_, m, k) : 0;
        if (at[k] != expected) {
          std::fprintf(stderr, "all_to_all worker %d: %s %d from %d (%u B): byte %zu is 0x%02x, expected 0x%02x\n", me_,
                       how, m, peer, layout_.size(m), k, at[k], expected);
          board_.failed = 1;
          return false;
        }
      }
    }
    return true;
  }

  bool check_all() {
    for (int peer = 0; peer < processes_; ++peer) {
      if (peer == me_) continue;
      if (!check_area(written_by(peer), peer, "WRITE") || !check_area(sent_by(peer), peer, "SEND")) return false;
    }
    return true;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int processes = argc > 1 ? std::atoi(argv[1]) : 8;
  const long largest = argc > 2 ? std::atol(argv[2]) : 1 << 20;
  if (processes < 2 || processes > kMaxProcesses || largest < 1 || largest > (1 << 20)) {
    std::fprintf(stderr, "usage: all_to_all [processes 2..%d] [largest message 1..1048576]\n", kMaxProcesses);
    return 2;
  }
  void* shared = mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return 2;
  Board& board = *new (shared) Board{};
  const auto started = Clock::now();
  std::vector<pid_t> workers;
  for (int i = 0; i < processes; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      int code;
      {
        Worker worker(board, i, processes, static_cast<uint32_t>(largest));
        code = worker.run();
      }
      _exit(code);
    }
    if (pid < 0) {
      board.failed = 1;
      break;
    }
    workers.push_back(pid);
  }
  int failures = 0;
  for (pid_t pid : workers) {
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  if (workers.size() != static_cast<size_t>(processes)) ++failures;
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  Layout layout(static_cast<uint32_t>(largest));
  size_t message_bytes = 0;
  for (int m = 0; m < kMessages; ++m) message_bytes += layout.size(m);
  const size_t total = 2 * message_bytes * processes * (processes - 1);
  if (failures) {
    std::printf("all_to_all: %d of %d processes failed\n", failures, processes);
    return 1;
  }
  std::printf(
      "all_to_all: %d processes, %d QPs, %d WRITEs and %d SENDs of %d sizes up to %ld B, %.1f MB, all "
      "byte-exact in %.2f s\n",
      processes, processes * (processes - 1), kMessages * processes * (processes - 1),
      kMessages * processes * (processes - 1), kMessages, largest, total / 1e6, seconds);
  return 0;
}
