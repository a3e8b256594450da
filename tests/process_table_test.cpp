// The device's view of the processes that use it: a process that joined is
// alive until it ends, however it ends; what a dead process held is
// reclaimed, and only then is its record free again. And QPNs: each carries
// random bits, so that a stale or guessed QPN names nothing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <set>
#include <string>

#include "device/device_memory.h"
#include "process_runner.h"

namespace softverbs {
namespace {

class ProcessTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    memory_ = DeviceMemory::open(dir_.path() + "/dev.mem", &error);
    ASSERT_TRUE(memory_) << error;
  }

  // A child that joins the device (and, if `objects`, creates a QP and
  // registers an MR), tells its record, then runs `then`.
  template <typename Then>
  pid_t joined_child(int& slot, bool objects, Then then) {
    int to_parent[2];
    EXPECT_EQ(pipe(to_parent), 0);
    const pid_t child = fork();
    if (child == 0) {
      std::string error;
      auto memory = DeviceMemory::open(dir_.path() + "/dev.mem", &error);
      int mine = memory ? memory->process_slot() : -1;
      if (objects && mine >= 0) {
        memory->allocate_qp();
        memory->allocate_cq();
        memory->allocate_srq();
        ExclusiveLock lock(memory->shared().memory_lock);
        memory->shared().mrs.register_region(1, getpid(), 0x1000, 0x1000, 64, 0, {}, mine);
      }
      if (write(to_parent[1], &mine, sizeof mine) != sizeof mine) _exit(2);
      _exit(then());
    }
    close(to_parent[1]);
    EXPECT_EQ(read(to_parent[0], &slot, sizeof slot), static_cast<ssize_t>(sizeof slot));
    close(to_parent[0]);
    return child;
  }

  test::TemporaryDirectory dir_;
  std::shared_ptr<DeviceMemory> memory_;
};

TEST_F(ProcessTableTest, AJoinedProcessIsAliveUntilItIsKilled) {
  int slot = -1;
  const pid_t child = joined_child(slot, false, [] {
    pause();
    return 0;
  });
  ASSERT_GE(slot, 0);
  EXPECT_TRUE(memory_->owner_alive(slot));
  EXPECT_EQ(memory_->shared().processes.pid_of(slot), child);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_FALSE(memory_->owner_alive(slot)) << "SIGKILL: no code of the process ran";
}

TEST_F(ProcessTableTest, AProcessThatExitsOrExecsIsDead) {
  int exited = -1, execed = -1;
  const pid_t first = joined_child(exited, false, [] { return 0; });
  waitpid(first, nullptr, 0);
  EXPECT_FALSE(memory_->owner_alive(exited));
  // A process that execs keeps its pid but loses its verbs state.
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  const pid_t second = joined_child(execed, false, [&] {
    char byte;
    if (read(go[0], &byte, 1) != 1) return 3;
    execl("/bin/sleep", "sleep", "5", static_cast<char*>(nullptr));
    return 4;
  });
  ASSERT_GE(execed, 0);
  EXPECT_TRUE(memory_->owner_alive(execed));
  ASSERT_EQ(write(go[1], "x", 1), 1);
  bool dead = false;
  for (int i = 0; i < 500 && !dead; ++i) {
    dead = !memory_->owner_alive(execed);
    if (!dead) usleep(10000);
  }
  EXPECT_TRUE(dead) << "the exec'ed process still looks like the one that joined";
  EXPECT_EQ(kill(second, 0), 0) << "while the process itself still runs";
  kill(second, SIGKILL);
  waitpid(second, nullptr, 0);
}

TEST_F(ProcessTableTest, ADeadProcessesRecordIsFreedOnlyWithItsObjects) {
  int slot = -1;
  const pid_t child = joined_child(slot, true, [] {
    pause();
    return 0;
  });
  ASSERT_GE(slot, 0);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  DeviceUsage before = memory_->usage();
  EXPECT_EQ(before.qps, 1u);
  EXPECT_EQ(before.mrs, 1u);
  EXPECT_EQ(before.processes, 0u);
  EXPECT_NE(memory_->shared().processes.pid_of(slot), 0) << "held until its objects go";
  memory_->reclaim_dead_owners();
  DeviceUsage after = memory_->usage();
  EXPECT_EQ(after.qps, 0u);
  EXPECT_EQ(after.mrs, 0u);
  EXPECT_EQ(after.heap_bytes, 0u) << "the QP's receive queue went back to the heap";
  EXPECT_EQ(memory_->shared().processes.pid_of(slot), 0) << "free again";
}

// The sweep reads only the records ever allocated and the MR table only
// for a dead owner of keys: objects above others and keys deep in the
// table's rotation are reclaimed all the same, and nothing of the living.
TEST_F(ProcessTableTest, ADeadProcessesObjectsAreFoundAboveTheLivingOnesAndDeepInTheKeyTable) {
  constexpr uint32_t kOurs = 300;
  for (uint32_t i = 0; i < kOurs; ++i)
    ASSERT_TRUE(memory_->allocate_qp() >= 0 && memory_->allocate_cq() >= 0 && memory_->allocate_srq() >= 0);
  const int our_slot = memory_->process_slot();
  {
    // Moves the key table's rotation on, so that the child's key lands past them.
    ExclusiveLock lock(memory_->shared().memory_lock);
    for (int i = 0; i < 5000; ++i) {
      auto key = memory_->shared().mrs.register_region(1, getpid(), 0x1000, 0x1000, 64, 0, {}, our_slot);
      ASSERT_TRUE(key && memory_->shared().mrs.deregister(*key));
    }
    ASSERT_TRUE(memory_->shared().mrs.register_region(1, getpid(), 0x1000, 0x1000, 64, 0, {}, our_slot));
  }
  int slot = -1;
  const pid_t child = joined_child(slot, true, [] { return 0; });
  ASSERT_GE(slot, 0);
  waitpid(child, nullptr, 0);
  EXPECT_EQ(memory_->qps_ever_used().size(), kOurs + 1);
  EXPECT_EQ(memory_->cqs_ever_used().size(), kOurs + 1);
  EXPECT_EQ(memory_->srqs_ever_used().size(), kOurs + 1);
  EXPECT_EQ(memory_->shared().mrs.owned_by(slot), 1u);
  DeviceUsage before = memory_->usage();
  EXPECT_EQ(before.qps, kOurs + 1);
  EXPECT_EQ(before.cqs, kOurs + 1);
  EXPECT_EQ(before.srqs, kOurs + 1);
  EXPECT_EQ(before.mrs, 2u);
  memory_->reclaim_dead_owners();
  DeviceUsage after = memory_->usage();
  EXPECT_EQ(after.qps, kOurs);
  EXPECT_EQ(after.cqs, kOurs);
  EXPECT_EQ(after.srqs, kOurs);
  EXPECT_EQ(after.mrs, 1u) << "the child's key went, ours stayed";
  EXPECT_EQ(memory_->shared().mrs.owned_by(slot), 0u);
  EXPECT_EQ(memory_->shared().processes.pid_of(slot), 0) << "free again";
  // A process that dies owning nothing is released as well.
  int empty = -1;
  const pid_t idle = joined_child(empty, false, [] { return 0; });
  ASSERT_GE(empty, 0);
  waitpid(idle, nullptr, 0);
  memory_->reclaim_dead_owners();
  EXPECT_EQ(memory_->shared().processes.pid_of(empty), 0);
  EXPECT_EQ(memory_->usage().qps, kOurs);
}

TEST_F(ProcessTableTest, QpnsCarryRandomBitsAndAStaleQpnNamesNothing) {
  std::set<uint32_t> tags;
  uint32_t previous = 0;
  for (int i = 0; i < 100; ++i) {
    const int index = memory_->allocate_qp();
    ASSERT_GE(index, 0);
    QpRecord& qp = memory_->shared().qps[index];
    EXPECT_EQ(qp.qpn & ((1u << kQpnIndexBits) - 1), static_cast<uint32_t>(index));
    EXPECT_GT(qp.qpn, 1u) << "QPs 0 and 1 are special";
    EXPECT_LT(qp.qpn, 0xffffffu) << "0xffffff is the multicast QPN";
    EXPECT_EQ(memory_->qp_by_number(qp.qpn), &qp);
    if (previous != 0) {
      EXPECT_EQ(memory_->qp_by_number(previous), nullptr) << "a stale QPN names nothing";
    }
    tags.insert(qp.qpn >> kQpnIndexBits);
    previous = qp.qpn;
    qp.live = 0;  // free the record: the next allocation reuses it
  }
  // 1,021 tags: 100 draws repeat a few (about 5), never the one just used.
  EXPECT_GT(tags.size(), 80u) << "100 creations drew few distinct tags";
}

}  // namespace
}  // namespace softverbs
