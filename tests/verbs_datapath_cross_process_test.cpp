// RC QPs of two processes through the installed libibverbs: one-sided
// operations on an idle target, and WRITEs while both sides register and
// deregister memory.
//
// Started through `softverbs run` by ctest, on a shared-memory device, over
// UDP, with kernel copies and with the copy agent: the verbs_datapath_*_test
// files make one executable.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "rc_endpoint.h"
#include "verbs_datapath.h"

namespace {

using namespace softverbs::test;

// The endpoints of the cross-process tests: an RC QP with a CQ of 8 and
// the caller's memory registered.
constexpr int kCrossProcessDepth = 4;
constexpr uint8_t kCrossProcessTimeout = 14;
constexpr uint8_t kCrossProcessRetries = 7;

// Posts one signaled work request of `length` bytes at `sink` (in the
// endpoint's memory) and waits for it.
ibv_wc_status run(Endpoint& endpoint, ibv_wr_opcode opcode, void* sink, uint32_t length, uint64_t remote, uint32_t rkey,
                  uint64_t compare_add = 0, uint64_t swap = 0) {
  ibv_sge sge{reinterpret_cast<uint64_t>(sink), length, endpoint.mr()->lkey};
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
    wr.wr.atomic = {remote, compare_add, swap, rkey};
  } else {
    wr.wr.rdma = {remote, rkey};
  }
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(endpoint.qp(), &wr, &bad) != 0) return IBV_WC_GENERAL_ERR;
  auto done = poll_n(endpoint.cq(), 1);
  return done.empty() ? IBV_WC_GENERAL_ERR : done[0].status;
}

// A child process with an Endpoint over `memory`: it sends its ConnectInfo,
// takes the parent's, connects, says 'r', then runs `body` (an exit code) once
// the parent's 'd' is readable or right away, as `body` wants (it gets the
// pipe to read from). Each side closes the pipe ends it does not use, so
// that a child that exits early is an end of file for the parent, not a
// hang; a child that hangs dies of SIGALRM, which the parent reports.
class ChildEndpoint {
 public:
  template <typename Body>
  ChildEndpoint(void* memory, size_t bytes, Body body) {
    int to_child[2], to_parent[2];
    if (pipe(to_child) != 0 || pipe(to_parent) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(to_child[1]);
      close(to_parent[0]);
      alarm(60);
      int code;
      {
        Endpoint self;
        if (!self.open(memory, bytes, kCrossProcessDepth)) _exit(10);
        ConnectInfo mine = self.info(), theirs{};
        if (write(to_parent[1], &mine, sizeof mine) != sizeof mine ||
            read(to_child[0], &theirs, sizeof theirs) != sizeof theirs)
          _exit(11);
        if (!self.connect(theirs, kCrossProcessTimeout, kCrossProcessRetries)) _exit(12);
        char ready = 'r';
        if (write(to_parent[1], &ready, 1) != 1) _exit(13);
        code = body(self, to_child[0]);
      }
      _exit(code);
    }
    close(to_child[0]);
    close(to_parent[1]);
    to_child_ = to_child[1];
    from_child_ = to_parent[0];
  }
  // On an early return, the child's fate explains it.
  ~ChildEndpoint() {
    if (to_child_ >= 0) close(to_child_);  // a child waiting for the parent reads an end of file
    if (from_child_ >= 0) close(from_child_);
    if (reaped_ || pid_ <= 0) return;
    int status = 0;
    if (waitpid(pid_, &status, 0) == pid_) ADD_FAILURE() << "child ended early: " << describe_exit(status);
  }
  // Exchanges ConnectInfos and connects `parent`; true once the child is ready.
  bool connect(Endpoint& parent, ConnectInfo& child) {
    ConnectInfo mine = parent.info();
    char ready;
    return pid_ > 0 && read(from_child_, &child, sizeof child) == sizeof child &&
           write(to_child_, &mine, sizeof mine) == sizeof mine &&
           parent.connect(child, kCrossProcessTimeout, kCrossProcessRetries) && read(from_child_, &ready, 1) == 1;
  }
  // Tells the child it may finish, and returns how it exited.
  int finish() {
    char done = 'd';
    if (write(to_child_, &done, 1) != 1) return -1;
    int status = 0;
    if (waitpid(pid_, &status, 0) != pid_) return -1;
    reaped_ = true;
    return status;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  bool reaped_ = false;
};

// Two processes: the child registers memory and waits; the parent writes,
// reads and runs atomics on it, and the child checks what arrived.
TEST(CrossProcess, OneSidedOperationsNeedNothingFromTheTarget) {
  std::vector<uint64_t> memory(64, 7);
  ChildEndpoint child(memory.data(), memory.size() * 8, [&](Endpoint&, int from_parent) {
    char done;
    if (read(from_parent, &done, 1) != 1) return 14;  // the parent worked meanwhile
    return memory[0] == 0x1122334455667788ull && memory[1] == 7 + 5 && memory[2] == 99 ? 0 : 20;
  });
  std::vector<uint64_t> local(8, 0);
  Endpoint parent;
  ASSERT_TRUE(parent.open(local.data(), local.size() * 8, kCrossProcessDepth));
  ConnectInfo theirs{};
  ASSERT_TRUE(child.connect(parent, theirs));

  local[0] = 0x1122334455667788ull;
  EXPECT_EQ(run(parent, IBV_WR_RDMA_WRITE, &local[0], 8, theirs.address, theirs.rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(run(parent, IBV_WR_RDMA_READ, &local[1], 8, theirs.address + 8 * 3, theirs.rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(local[1], 7u) << "read the child's memory";
  EXPECT_EQ(run(parent, IBV_WR_ATOMIC_FETCH_AND_ADD, &local[2], 8, theirs.address + 8, theirs.rkey, 5), IBV_WC_SUCCESS);
  EXPECT_EQ(local[2], 7u);
  EXPECT_EQ(run(parent, IBV_WR_ATOMIC_CMP_AND_SWP, &local[3], 8, theirs.address + 16, theirs.rkey, 7, 99),
            IBV_WC_SUCCESS);
  EXPECT_EQ(run(parent, IBV_WR_RDMA_WRITE, &local[0], 8, theirs.address + 64 * 8, theirs.rkey), IBV_WC_REM_ACCESS_ERR)
      << "one past the child's region";
  const int status = child.finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << describe_exit(status);
}

// Registrations change the MR table under the lock that every copy holds
// (a slot of it per process, all of them for a change): WRITEs from one
// process into another must go on, each landing whole, while a thread of
// each process registers and deregisters memory of its own as fast as it
// can.
TEST(CrossProcess, WritesFlowWhileBothProcessesRegisterAndDeregister) {
  constexpr size_t kBytes = 64 * 1024;
  constexpr int kWrites = 2000;
  auto churn = [](ibv_pd* pd, const std::atomic<bool>& stop) {
    std::vector<char> scratch(kBytes);
    int registrations = 0;
    while (!stop.load()) {
      ibv_mr* mr = ibv_reg_mr(pd, scratch.data(), scratch.size(), kAllAccess);
      if (mr == nullptr || ibv_dereg_mr(mr) != 0) return -1;
      ++registrations;
    }
    return registrations;
  };
  std::vector<uint8_t> target(kBytes, 0);
  ChildEndpoint child(target.data(), target.size(), [&](Endpoint& self, int from_parent) {
    std::atomic<bool> stop{false};
    int registrations = 0;
    std::thread registering([&] { registrations = churn(self.pd(), stop); });
    char done;
    const bool told = read(from_parent, &done, 1) == 1;
    stop = true;
    registering.join();
    if (!told) return 14;
    if (registrations <= 0) return 21;
    // The last WRITE's pattern, whole.
    for (size_t i = 0; i < target.size(); ++i)
      if (target[i] != static_cast<uint8_t>((kWrites - 1) * 7 + i % 251)) return 22;
    return 0;
  });
  std::vector<uint8_t> source(kBytes);
  Endpoint parent;
  ASSERT_TRUE(parent.open(source.data(), source.size(), kCrossProcessDepth));
  ConnectInfo theirs{};
  ASSERT_TRUE(child.connect(parent, theirs));
  std::atomic<bool> stop{false};
  int registrations = 0;
  std::thread registering([&] { registrations = churn(parent.pd(), stop); });
  int failed = 0;
  for (int write = 0; write < kWrites; ++write) {
    for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint8_t>(write * 7 + i % 251);
    if (run(parent, IBV_WR_RDMA_WRITE, source.data(), kBytes, theirs.address, theirs.rkey) != IBV_WC_SUCCESS) ++failed;
  }
  stop = true;
  registering.join();
  EXPECT_EQ(failed, 0);
  EXPECT_GT(registrations, 0);
  const int status = child.finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << describe_exit(status);
}

}  // namespace
