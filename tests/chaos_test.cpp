// Several processes with RC QPs to one another, all doing WRITEs, READs and
// SENDs at once, and kill -9 for random ones among them (ctest runs this
// binary through `softverbs run` on a shm device and on a udp device). What
// an HCA would give every survivor: an error completion (RETRY_EXC_ERR) on
// each QP to a dead peer within timeout x (retry_cnt + 1), no success for
// work posted once the peer was dead, no error on a QP to a live peer, every
// SEND that succeeded received once and in order, and no hang. Once all
// have exited, the device holds what it held before. SOFTVERBS_CHAOS_SECONDS
// sets the length (default 30); SOFTVERBS_CHAOS_SEED the victims.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device_status.h"
#include "process_runner.h"
#include "qp_setup.h"
#include "rc_peer.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWorkers = 6;
constexpr int kVictims = 4;
// 67 ms per try: a live peer starved that long on 2 cores (the sanitizer
// build's six busy processes) would look dead.
constexpr uint8_t kTimeout = 14;
constexpr uint8_t kRetries = 3;
constexpr uint32_t kSlot = 4096;      // each peer's WRITE/READ area in a worker's buffer
constexpr uint32_t kSendBytes = 64;   // a SEND carries its sequence number
constexpr int kSendDepth = 8;         // outstanding send work requests per QP
constexpr int kReceiveDepth = 32;     // receives posted per QP
constexpr double kBoundMargin = 1.0;  // seconds: 6 busy processes on 2 cores
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

struct QpInfo {
  uint32_t qpn = 0;
  uint32_t rkey = 0;
  uint64_t address = 0;  // the worker's buffer
  ibv_gid gid{};
};

// Shared by the test and its workers (an anonymous shared mapping made
// before the fork). [i][j]: worker i's view of its QP to worker j.
struct Board {
  std::atomic<int> ready[kWorkers];
  std::atomic<int> failed_setup[kWorkers];
  QpInfo info[kWorkers][kWorkers];
  std::atomic<int> go;
  std::atomic<int> stop;
  std::atomic<int> drained[kWorkers];
  std::atomic<int64_t> dead_at[kWorkers];  // when the test knew worker j dead (reaped); 0: alive
  std::atomic<int64_t> error_at[kWorkers][kWorkers];
  std::atomic<int> first_error[kWorkers][kWorkers];
  std::atomic<uint64_t> success_after_death[kWorkers][kWorkers];
  std::atomic<uint64_t> completed[kWorkers][kWorkers];
  std::atomic<uint64_t> sends_ok[kWorkers][kWorkers];
  std::atomic<uint64_t> received[kWorkers][kWorkers];  // [i][j]: SENDs from j that i took in
  std::atomic<uint64_t> out_of_order[kWorkers][kWorkers];
};

// wr_id: peer in bits 56..63, kind in 48..55, a count below.
enum Kind : uint64_t { kWrite = 1, kRead = 2, kSend = 3, kRecv = 4 };
uint64_t wr_id(int peer, Kind kind, uint64_t count) { return uint64_t(peer) << 56 | uint64_t(kind) << 48 | count; }
int peer_of(uint64_t id) { return static_cast<int>(id >> 56); }
Kind kind_of(uint64_t id) { return static_cast<Kind>((id >> 48) & 0xff); }

class Worker {
 public:
  Worker(Board& board, int me) : board_(board), me_(me) {}

  int run() {
    if (!setup()) {
      board_.failed_setup[me_] = 1;
      return 10;
    }
    board_.ready[me_] = 1;
    while (!board_.go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!connect_all()) return 11;
    std::mt19937 random(static_cast<unsigned>(me_ * 7919 + 1));
    while (!board_.stop.load()) {
      for (int j = 0; j < kWorkers; ++j)
        if (j != me_ && !failed_[j]) top_up(j, random);
      poll_some();
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // leave the 2 cores to the others too
    }
    // Drain what is outstanding, then wait for every live peer's SENDs.
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (outstanding() > 0 && Clock::now() < deadline) poll_some();
    if (outstanding() > 0) return 12;  // a hang: work that never completed
    board_.drained[me_] = 1;
    while (Clock::now() < deadline) {
      poll_some();
      bool all_in = true;
      for (int j = 0; j < kWorkers; ++j)
        if (j != me_ && board_.dead_at[j] == 0 && board_.drained[j] &&
            board_.received[me_][j] < board_.sends_ok[j][me_])
          all_in = false;
      bool peers_drained = true;
      for (int j = 0; j < kWorkers; ++j)
        if (j != me_ && board_.dead_at[j] == 0 && !board_.drained[j]) peers_drained = false;
      if (all_in && peers_drained) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    teardown();
    return 0;
  }

 private:
  bool setup() {
    context_ = softverbs::test::open_softverbs0(gid_index_, gid_);
    if (!context_) return false;
    pd_ = ibv_alloc_pd(context_);
    cq_ = ibv_create_cq(context_, kWorkers * (kSendDepth + kReceiveDepth) * 2, nullptr, nullptr, 0);
    buffer_.assign(kWorkers * kSlot + kWorkers * kReceiveDepth * kSendBytes + kWorkers * kSlot, 0);
    if (!pd_ || !cq_ || gid_index_ < 0) return false;
    mr_ = ibv_reg_mr(pd_, buffer_.data(), buffer_.size(), kAccess);
    if (!mr_) return false;
    for (int j = 0; j < kWorkers; ++j) {
      if (j == me_) continue;
      ibv_qp_init_attr init{};
      init.send_cq = init.recv_cq = cq_;
      init.qp_type = IBV_QPT_RC;
      init.cap = {kSendDepth, kReceiveDepth, 1, 1, kSendBytes};
      qps_[j] = ibv_create_qp(pd_, &init);
      if (!qps_[j]) return false;
      board_.info[me_][j] = {qps_[j]->qp_num, mr_->rkey, reinterpret_cast<uint64_t>(buffer_.data()), gid_};
    }
    return true;
  }

  bool connect_all() {
    for (int j = 0; j < kWorkers; ++j) {
      if (j == me_) continue;
      const QpInfo& peer = board_.info[j][me_];
      softverbs::test::PeerPath path;
      path.qpn = peer.qpn;
      path.gid = peer.gid;
      path.sgid_index = static_cast<uint8_t>(gid_index_);
      softverbs::test::RcTiming timing;
      timing.timeout = kTimeout;
      timing.retry_count = kRetries;
      if (softverbs::test::to_init(qps_[j], IBV_QPT_RC, kAccess) != 0 ||
          softverbs::test::to_rtr(qps_[j], IBV_QPT_RC, path) != 0 ||
          softverbs::test::to_rts(qps_[j], IBV_QPT_RC, 0, timing) != 0)
        return false;
      for (int r = 0; r < kReceiveDepth; ++r) post_receive(j, static_cast<uint32_t>(r));
    }
    return true;
  }

  uint8_t* receive_slot(int peer, uint32_t index) {
    return buffer_.data() + kWorkers * kSlot + (peer * kReceiveDepth + index) * kSendBytes;
  }
  uint8_t* read_area(int peer) {
    return buffer_.data() + kWorkers * kSlot + kWorkers * kReceiveDepth * kSendBytes + peer * kSlot;
  }

  void post_receive(int peer, uint32_t index) {
    ibv_sge sge{reinterpret_cast<uint64_t>(receive_slot(peer, index)), kSendBytes, mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id(peer, kRecv, index);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ibv_post_recv(qps_[peer], &wr, &bad);
  }

  struct Posted {
    uint64_t id;
    bool after_death;
  };

  void top_up(int peer, std::mt19937& random) {
    while (posted_[peer].size() < kSendDepth) {
      const QpInfo& remote = board_.info[peer][me_];
      const Kind kind = static_cast<Kind>(1 + random() % 3);
      const uint64_t id = wr_id(peer, kind, ++counts_[peer]);
      ibv_sge sge{};
      ibv_send_wr wr{};
      wr.wr_id = id;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.send_flags = IBV_SEND_SIGNALED;
      if (kind == kSend) {
        std::memcpy(send_bytes_[peer], &next_send_[peer], sizeof next_send_[peer]);
        sge = {reinterpret_cast<uint64_t>(send_bytes_[peer]), kSendBytes, 0};
        wr.opcode = IBV_WR_SEND;
        wr.send_flags |= IBV_SEND_INLINE;
      } else {
        sge = {reinterpret_cast<uint64_t>(kind == kWrite ? buffer_.data() + peer * kSlot : read_area(peer)), kSlot,
               mr_->lkey};
        wr.opcode = kind == kWrite ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
        wr.wr.rdma.remote_addr = remote.address + me_ * kSlot;  // the peer's area for me
        wr.wr.rdma.rkey = remote.rkey;
      }
      const bool after_death = board_.dead_at[peer].load() != 0;
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(qps_[peer], &wr, &bad) != 0) {
        failed_[peer] = true;  // the QP is already in ERR and was flushed
        return;
      }
      if (kind == kSend) ++next_send_[peer];
      posted_[peer].push_back({id, after_death});
    }
  }

  size_t outstanding() const {
    size_t total = 0;
    for (const auto& queue : posted_) total += queue.size();
    return total;
  }

  void poll_some() {
    ibv_wc wc[32];
    const int got = ibv_poll_cq(cq_, 32, wc);
    for (int k = 0; k < got; ++k) take(wc[k]);
  }

  void take(const ibv_wc& wc) {
    const int peer = peer_of(wc.wr_id);
    if (peer < 0 || peer >= kWorkers || peer == me_) return;
    if (kind_of(wc.wr_id) == kRecv) {
      if (wc.status != IBV_WC_SUCCESS) return;  // flushed at the move to ERR
      const uint32_t index = static_cast<uint32_t>(wc.wr_id & 0xffffffff);
      uint64_t sequence = 0;
      std::memcpy(&sequence, receive_slot(peer, index), sizeof sequence);
      if (sequence != board_.received[me_][peer]) board_.out_of_order[me_][peer]++;
      board_.received[me_][peer]++;
      if (!failed_[peer]) post_receive(peer, index);
      return;
    }
    auto& queue = posted_[peer];
    if (queue.empty() || queue.front().id != wc.wr_id) {
      board_.out_of_order[me_][peer]++;  // completions of one QP come in posting order
      return;
    }
    const Posted posted = queue.front();
    queue.pop_front();
    board_.completed[me_][peer]++;
    if (wc.status == IBV_WC_SUCCESS) {
      if (posted.after_death) board_.success_after_death[me_][peer]++;
      if (kind_of(wc.wr_id) == kSend) board_.sends_ok[me_][peer]++;
      return;
    }
    if (board_.error_at[me_][peer].load() == 0) {
      board_.first_error[me_][peer] = wc.status;
      board_.error_at[me_][peer] = now_ns();
    }
    failed_[peer] = true;
  }

  void teardown() {
    for (ibv_qp* qp : qps_)
      if (qp) ibv_destroy_qp(qp);
    if (mr_) ibv_dereg_mr(mr_);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (context_) ibv_close_device(context_);
  }

  Board& board_;
  const int me_;
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_mr* mr_ = nullptr;
  int gid_index_ = -1;
  ibv_gid gid_{};
  std::vector<uint8_t> buffer_;
  ibv_qp* qps_[kWorkers] = {};
  bool failed_[kWorkers] = {};
  std::deque<Posted> posted_[kWorkers];
  uint64_t counts_[kWorkers] = {};
  uint64_t next_send_[kWorkers] = {};
  alignas(8) uint8_t send_bytes_[kWorkers][kSendBytes] = {};
};

// The device's objects and processes, as `softverbs stat` shows them.
std::map<std::string, uint64_t> device_usage() {
  const char* cli = std::getenv("SOFTVERBS_CLI");
  if (cli == nullptr) return {};
  return softverbs::test::parse_counters(softverbs::test::run_process({cli, "stat", "softverbs0"}).out);
}

// Until every worker has set up (its QPs made, their numbers on the board).
void wait_until_ready(const Board& board) {
  const auto setup_deadline = Clock::now() + std::chrono::seconds(30);
  bool all_ready = false;
  while (!all_ready && Clock::now() < setup_deadline) {
    all_ready = true;
    for (int i = 0; i < kWorkers; ++i) {
      ASSERT_EQ(board.failed_setup[i].load(), 0) << "worker " << i << " could not set up";
      all_ready = all_ready && board.ready[i].load();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(all_ready);
}

// Kills the first kVictims workers of `order`, spread over `seconds`, then
// stops the rest at the end and reaps them.
void kill_victims_then_stop(Board& board, const pid_t (&workers)[kWorkers], const std::vector<int>& order,
                            double seconds) {
  const auto start = Clock::now();
  for (int k = 0; k < kVictims; ++k) {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(seconds * (k + 1) / (kVictims + 1))));
    const int victim = order[k];
    kill(workers[victim], SIGKILL);
    int status = 0;
    waitpid(workers[victim], &status, 0);
    board.dead_at[victim] = now_ns();
    std::printf("chaos: worker %d killed at %.1f s\n", victim,
                std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::this_thread::sleep_until(start +
                                std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
  board.stop = 1;
  for (int k = kVictims; k < kWorkers; ++k) {
    const int survivor = order[k];
    int status = 0;
    waitpid(workers[survivor], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "survivor " << survivor << ": status " << status << " (12: work that never completed)";
  }
}

// What the survivors saw of each peer: errors only from dead ones, each
// RETRY_EXC_ERR within the bound of the death, every SEND in once.
void check_survivors(const Board& board, const std::vector<int>& order) {
  const double bound = (kRetries + 1) * 4.096e-6 * (1 << kTimeout) + kBoundMargin;
  double slowest = 0;
  uint64_t total = 0;
  for (int k = kVictims; k < kWorkers; ++k) {
    const int i = order[k];
    for (int j = 0; j < kWorkers; ++j) {
      if (j == i) continue;
      total += board.completed[i][j];
      EXPECT_EQ(board.out_of_order[i][j].load(), 0u) << i << " from " << j;
      EXPECT_EQ(board.success_after_death[i][j].load(), 0u)
          << i << " -> " << j << ": success for work posted to a dead peer";
      if (board.dead_at[j] == 0) {
        EXPECT_EQ(board.error_at[i][j].load(), 0) << i << " -> live " << j << ": error " << board.first_error[i][j];
        EXPECT_EQ(board.received[j][i].load(), board.sends_ok[i][j].load()) << i << " -> " << j << ": SENDs lost";
        continue;
      }
      ASSERT_NE(board.error_at[i][j].load(), 0) << i << " -> dead " << j << ": no error completion";
      EXPECT_EQ(board.first_error[i][j].load(), IBV_WC_RETRY_EXC_ERR)
          << i << " -> dead " << j << ": "
          << ibv_wc_status_str(static_cast<ibv_wc_status>(board.first_error[i][j].load()));
      const double after = (board.error_at[i][j] - board.dead_at[j]) / 1e9;
      slowest = std::max(slowest, after);
      EXPECT_LE(after, bound) << i << " -> dead " << j;
    }
  }
  std::printf("chaos: %llu completions at the survivors; slowest error after a death: %.3f s (bound %.3f s)\n",
              static_cast<unsigned long long>(total), slowest, bound);
  EXPECT_GT(total, 1000u) << "the workers did little work";
}

TEST(Chaos, KilledPeersFailTheirSurvivorsWorkInTimeAndNothingElse) {
  const char* seconds_text = std::getenv("SOFTVERBS_CHAOS_SECONDS");
  const double seconds = seconds_text ? std::atof(seconds_text) : 30.0;
  const char* seed_text = std::getenv("SOFTVERBS_CHAOS_SEED");
  const unsigned seed = seed_text ? static_cast<unsigned>(std::atol(seed_text)) : std::random_device{}();
  std::printf("chaos: %d workers, %d killed over %.0f s, seed %u (SOFTVERBS_CHAOS_SEED)\n", kWorkers, kVictims, seconds,
              seed);
  const auto before = device_usage();
  ASSERT_FALSE(before.empty()) << "SOFTVERBS_CLI names the softverbs command";

  void* shared = mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  Board& board = *new (shared) Board{};
  pid_t workers[kWorkers];
  for (int i = 0; i < kWorkers; ++i) {
    workers[i] = fork();
    if (workers[i] == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      Worker worker(board, i);
      _exit(worker.run());
    }
  }
  ASSERT_NO_FATAL_FAILURE(wait_until_ready(board));
  board.go = 1;

  std::mt19937 random(seed);
  std::vector<int> order(kWorkers);
  for (int i = 0; i < kWorkers; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), random);
  kill_victims_then_stop(board, workers, order, seconds);

  ASSERT_NO_FATAL_FAILURE(check_survivors(board, order));

  // Everything the workers held is gone, once their records are reclaimed
  // (stat reclaims them).
  const auto after = device_usage();
  for (const char* name : {"processes", "qps", "cqs", "srqs", "mrs", "heap_bytes"})
    EXPECT_EQ(after.at(name), before.at(name)) << name;
  const char* runtime = std::getenv("SOFTVERBS_RUNTIME_DIR");
  ASSERT_NE(runtime, nullptr);
  std::error_code error;
  EXPECT_TRUE(std::filesystem::is_empty(std::string(runtime) + "/users/softverbs0", error) || error)
      << "user records left behind";
  munmap(shared, sizeof(Board));
}

}  // namespace
