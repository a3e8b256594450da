// Memory through the installed libibverbs: what registration accepts and
// refuses, reregistration, deregistration under traffic, protection domains
// in use, and registered memory across fork.
//
// Started through `softverbs run` by ctest, on a shared-memory device, over
// UDP, with kernel copies and with the copy agent: the verbs_datapath_*_test
// files make one executable.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "verbs_datapath.h"

namespace {

using namespace softverbs::test;

TEST_F(RcDataPath, RegistrationRules) {
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, buffer_a_.data(), 64, IBV_ACCESS_REMOTE_WRITE), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, buffer_a_.data(), 64, IBV_ACCESS_REMOTE_ATOMIC), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_mr* ok = ibv_reg_mr(pd_, buffer_a_.data(), 64, IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(ok, nullptr);
  EXPECT_NE(ok->lkey, mr_a_->lkey);
  EXPECT_EQ(ibv_dereg_mr(ok), 0);
}

// An HCA pins the pages with the access asked for, so memory it could not
// pin is refused at registration (EFAULT; EINVAL for a range that wraps)
// rather than found out when a peer's WRITE lands on it.
TEST_F(RcDataPath, RegistrationRefusesMemoryAnHcaCouldNotPin) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* area = mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(area, MAP_FAILED);
  auto* bytes = static_cast<uint8_t*>(area);
  ASSERT_EQ(munmap(bytes + 2 * page, page), 0);           // a hole after two pages
  ASSERT_EQ(mprotect(bytes + page, page, PROT_READ), 0);  // the second page read-only
  struct Case {
    const char* what;
    void* address;
    size_t length;
    int access;
    int error;  // 0: accepted
  };
  const Case cases[] = {
      {"unmapped memory", bytes + 2 * page, page, 0, EFAULT},
      {"a range running into unmapped memory", bytes + page, 2 * page, IBV_ACCESS_REMOTE_READ, EFAULT},
      {"read-only memory with local write", bytes + page, page, IBV_ACCESS_LOCAL_WRITE, EFAULT},
      {"read-only memory with remote write", bytes + page, page, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
       EFAULT},
      {"writable and read-only pages with remote atomic", bytes, 2 * page,
       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC, EFAULT},
      {"a range that wraps past 2^64", reinterpret_cast<void*>(UINTPTR_MAX - page + 1), 2 * page, 0, EINVAL},
      {"read-only memory for remote reads", bytes + page, page, IBV_ACCESS_REMOTE_READ, 0},
      {"read-only memory for local reads", bytes + page, page, 0, 0},
      {"writable memory with every right", bytes, page, kAllAccess, 0},
  };
  for (const Case& c : cases) {
    errno = 0;
    ibv_mr* mr = ibv_reg_mr(pd_, c.address, c.length, c.access);
    if (c.error == 0) {
      EXPECT_NE(mr, nullptr) << c.what << ": " << std::strerror(errno);
      if (mr) {
        EXPECT_EQ(ibv_dereg_mr(mr), 0);
      }
    } else {
      EXPECT_EQ(mr, nullptr) << c.what;
      EXPECT_EQ(errno, c.error) << c.what;
      if (mr) ibv_dereg_mr(mr);
    }
  }
  munmap(bytes, 2 * page);
}

TEST_F(RcDataPath, ReregisteringChangesWhatTheKeyAllows) {
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 8, addr_b(0), mr_b_->rkey), 0);
  ASSERT_EQ(poll_n(cq_a_, 1).at(0).status, IBV_WC_SUCCESS);
  ASSERT_EQ(ibv_rereg_mr(mr_b_, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ),
            0);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 2, 0, 8, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(poll_n(cq_a_, 1).at(0).status, IBV_WC_REM_ACCESS_ERR) << "remote write was taken away";
  EXPECT_EQ(ibv_rereg_mr(mr_b_, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_REMOTE_WRITE),
            IBV_REREG_MR_ERR_CMD)
      << "remote write without local write";
}

TEST_F(RcDataPath, DeregisteringASourceUnderTrafficNeverReadsItAfterwards) {
  // 32 MiB of WRITEs (more than a UDP QP's window) from a region that is
  // deregistered and unmapped right after they are posted: whatever was not
  // sent by then must fail (LOC_PROT_ERR, then flushes) rather than read the
  // unmapped pages, which would kill this process. Several rounds, since
  // the deregistration races with the sending.
  constexpr size_t kChunk = 1 << 20;
  constexpr int kWrites = 32;
  const size_t bytes = kChunk * kWrites;
  void* target = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(target, MAP_FAILED);
  ibv_mr* target_mr = ibv_reg_mr(pd_, target, bytes, kAllAccess);
  ASSERT_NE(target_mr, nullptr);
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    for (ibv_qp** qp : {&qp_a_, &qp_b_})
      if (*qp) {
        ASSERT_EQ(ibv_destroy_qp(*qp), 0);
        *qp = nullptr;
      }
    connect(IBV_QPT_RC);
    void* source = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(source, MAP_FAILED);
    std::memset(source, 0x50 + round, bytes);
    ibv_mr* source_mr = ibv_reg_mr(pd_, source, bytes, kAllAccess);
    ASSERT_NE(source_mr, nullptr);
    for (int i = 0; i < kWrites; ++i) {
      ibv_sge sge{reinterpret_cast<uint64_t>(source) + i * kChunk, static_cast<uint32_t>(kChunk), source_mr->lkey};
      ibv_send_wr wr{};
      wr.wr_id = 100 + i;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(target) + i * kChunk;
      wr.wr.rdma.rkey = target_mr->rkey;
      ibv_send_wr* bad = nullptr;
      ASSERT_EQ(ibv_post_send(qp_a_, &wr, &bad), 0);
    }
    // Idle for a while, so that the background thread (if the transport
    // has one) is the one sending when the region goes.
    std::this_thread::sleep_for(std::chrono::microseconds(300 * (round + 1)));
    ASSERT_EQ(ibv_dereg_mr(source_mr), 0);
    ASSERT_EQ(munmap(source, bytes), 0);
    auto done = poll_n(cq_a_, kWrites, std::chrono::seconds(20));
    ASSERT_EQ(done.size(), static_cast<size_t>(kWrites));
    int succeeded = 0;
    for (int i = 0; i < kWrites; ++i) {
      EXPECT_EQ(done[i].wr_id, 100u + i) << "in order";
      if (done[i].status == IBV_WC_SUCCESS) {
        EXPECT_EQ(succeeded, i) << "no success after a failure";
        ++succeeded;
        const auto* landed = static_cast<const uint8_t*>(target) + i * kChunk;
        EXPECT_TRUE(landed[0] == 0x50 + round && landed[kChunk - 1] == 0x50 + round) << "WRITE " << i;
      } else if (i == succeeded) {
        EXPECT_EQ(done[i].status, IBV_WC_LOC_PROT_ERR) << "the first failure";
      } else {
        EXPECT_EQ(done[i].status, IBV_WC_WR_FLUSH_ERR) << "the rest";
      }
    }
  }
  EXPECT_EQ(ibv_dereg_mr(target_mr), 0);
  munmap(target, bytes);
}

// An HCA refuses to free a PD that still has MRs, QPs, SRQs or AHs (EBUSY),
// and the PD stays usable.
TEST_F(RcDataPath, AProtectionDomainInUseIsBusyAndStaysUsable) {
  ibv_pd* pd = ibv_alloc_pd(context_);
  ASSERT_NE(pd, nullptr);
  ibv_mr* mr = ibv_reg_mr(pd, buffer_a_.data(), 64, 0);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with an MR";
  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = cq_a_;
  init.qp_type = IBV_QPT_RC;
  init.cap = {1, 1, 1, 1, 0};
  ibv_qp* qp = ibv_create_qp(pd, &init);
  ASSERT_NE(qp, nullptr) << "the PD is still usable";
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with a QP";
  ASSERT_EQ(ibv_destroy_qp(qp), 0);
  ibv_srq_init_attr srq_init{};
  srq_init.attr = {4, 1, 0};
  ibv_srq* srq = ibv_create_srq(pd, &srq_init);
  ASSERT_NE(srq, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with an SRQ";
  ASSERT_EQ(ibv_destroy_srq(srq), 0);
  ibv_ah_attr ah_attr{};
  ah_attr.port_num = 1;
  ah_attr.is_global = 1;
  const int gid_index = ipv4_gid_index(context_, &ah_attr.grh.dgid);
  ASSERT_GE(gid_index, 0);
  ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
  ibv_ah* ah = ibv_create_ah(pd, &ah_attr);
  ASSERT_NE(ah, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "with an AH";
  ASSERT_EQ(ibv_destroy_ah(ah), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0) << "once nothing uses it";
}

// A forked child gets its own copy of memory, registered or not, as with
// rdma-core and an HCA on a kernel that copies pinned pages at fork (5.13+).
// Registration may move a page-aligned buffer's pages into a memfd that
// peers map; neither the child's writes nor a later fork after
// deregistration (when the allocator hands the memory out again) may see
// anything else.
TEST(Fork, RegisteredAndDeregisteredMemoryIsAForkedChildsOwnCopy) {
  ibv_context* context = open_softverbs0();
  ASSERT_NE(context, nullptr);
  ibv_pd* pd = ibv_alloc_pd(context);
  ASSERT_NE(pd, nullptr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t length = 8 * page;
  void* raw = nullptr;
  ASSERT_EQ(posix_memalign(&raw, page, length), 0);
  auto* bytes = static_cast<uint8_t*>(raw);
  std::memset(bytes, 0x5a, length);
  ibv_mr* mr = ibv_reg_mr(pd, bytes, length, kAllAccess);
  ASSERT_NE(mr, nullptr);
  bytes[page + 1] = 0x11;  // written while registered
  auto fork_and_check = [&](const char* when) {
    pid_t child = fork();
    if (child == 0) {
      bool intact = bytes[0] == 0x5a && bytes[page + 1] == 0x11 && bytes[length - 1] == 0x5a;
      std::memset(bytes, 0x77, length);  // the child's own copy
      _exit(intact ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << when << ": " << describe_exit(status);
    EXPECT_EQ(bytes[0], 0x5a) << "the child wrote into the parent's memory " << when;
    EXPECT_EQ(bytes[length - 1], 0x5a) << "the child wrote into the parent's memory " << when;
  };
  fork_and_check("while registered");
  ASSERT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(bytes[0], 0x5a);
  EXPECT_EQ(bytes[page + 1], 0x11);
  EXPECT_EQ(bytes[length - 1], 0x5a);
  fork_and_check("after deregistration");
  // Registering the same buffer again works as the first time.
  mr = ibv_reg_mr(pd, bytes, length, kAllAccess);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  std::free(raw);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
  EXPECT_EQ(ibv_close_device(context), 0);
}

// The descriptors each epoll set of this process watches ("epfd:tfd"), from
// /proc: a forked child shares the sets, so its changes would show here.
std::vector<std::string> epoll_registrations() {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    if (std::filesystem::read_symlink(entry.path(), error).string() != "anon_inode:[eventpoll]") continue;
    const std::string fd = entry.path().filename().string();
    std::ifstream info("/proc/self/fdinfo/" + fd);
    for (std::string line; std::getline(info, line);)
      if (line.rfind("tfd:", 0) == 0) found.push_back(fd + ":" + line.substr(0, line.find(" events")));
  }
  std::sort(found.begin(), found.end());
  return found;
}

// Whether a thread of this process is named `name` (/proc/self/task/*/comm).
bool has_thread_named(const std::string& name) {
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) return true;
  }
  return false;
}

// RC pairs whose traffic is checked in the parent after a fork.
class ForkDataPath : public RcDataPath {
 protected:
  // `rounds` SENDs of `length` bytes from A land whole in B's receives
  // (on its own queue, or on `srq`).
  void expect_sends_arrive(int rounds, uint32_t length, ibv_srq* srq = nullptr) {
    for (int round = 0; round < rounds; ++round) {
      std::memset(buffer_a_.data(), 0x40 + round, length);
      const uint64_t wr_id = 100 + static_cast<uint64_t>(round);
      ASSERT_EQ(post_recv_b(wr_id, 0, length, srq), 0);
      ASSERT_EQ(post_a(IBV_WR_SEND, wr_id, 0, length), 0);
      auto sent = poll_n(cq_a_, 1);
      auto received = poll_n(cq_b_, 1);
      ASSERT_EQ(sent.size(), 1u);
      ASSERT_EQ(received.size(), 1u);
      EXPECT_EQ(sent[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(sent[0].status);
      EXPECT_EQ(received[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(received[0].status);
      EXPECT_EQ(received[0].wr_id, wr_id);
      EXPECT_EQ(received[0].byte_len, length);
      EXPECT_EQ(std::memcmp(buffer_a_.data(), buffer_b_.data(), length), 0) << "round " << round;
    }
  }
};

// A forked child holds its parent's verbs objects too, and may destroy them:
// Python's collector does so in multiprocessing's children, for objects of
// earlier work the parent has not collected yet. That drops the child's
// handles; the parent's objects, their rings and keys stay the parent's
// (rdma-core 56's pyverbs suite lost completions when they did not).
TEST_F(ForkDataPath, AForkedChildDestroyingInheritedObjectsLeavesTheParentsAlone) {
  ibv_srq* srq = connect_rc_on_srq(8);
  ASSERT_NE(srq, nullptr);
  ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr) << std::strerror(errno);
  ibv_alloc_dm_attr dm_attr{};
  dm_attr.length = 4096;
  ibv_dm* dm = ibv_alloc_dm(context_, &dm_attr);
  ASSERT_NE(dm, nullptr) << std::strerror(errno);
  const uint8_t pattern[4] = {0xd0, 0x0d, 0xfe, 0xed};
  ASSERT_EQ(ibv_memcpy_to_dm(dm, 0, pattern, sizeof pattern), 0);

  const std::vector<std::string> watched = epoll_registrations();
  pid_t child = fork();
  if (child == 0) {
    // Each destroy that fails sets a bit of the exit status.
    int failed = 0;
    int bit = 0;
    auto note = [&](int result) { failed |= (result != 0) << bit++; };
    note(ibv_destroy_qp(qp_a_));
    note(ibv_destroy_qp(qp_b_));
    note(ibv_destroy_srq(srq));
    note(ibv_dealloc_mw(mw));
    note(ibv_free_dm(dm));
    note(ibv_dereg_mr(mr_a_));
    note(ibv_dereg_mr(mr_b_));
    note(ibv_destroy_cq(cq_a_));
    note(ibv_destroy_cq(cq_b_));
    note(ibv_dealloc_pd(pd_));
    note(ibv_close_device(context_));
    _exit(failed);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the child's destroys (bit per verb): " << describe_exit(status);
  // The parent's engine may have added some since; none may be gone.
  const std::vector<std::string> still = epoll_registrations();
  for (const std::string& registration : watched)
    EXPECT_TRUE(std::binary_search(still.begin(), still.end(), registration))
        << registration << ": the child took it out of the epoll set it shares with the parent";

  // The parent's QPs, SRQ, CQs and MRs work as before the fork.
  expect_sends_arrive(3, 256, srq);
  std::memset(buffer_a_.data() + 512, 0x6b, 128);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 30, 512, 128, addr_b(1024), mr_b_->rkey), 0);
  auto written = poll_n(cq_a_, 1);
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(written[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(written[0].status);
  EXPECT_EQ(std::memcmp(buffer_a_.data() + 512, buffer_b_.data() + 1024, 128), 0);
  uint8_t back[4] = {};
  ASSERT_EQ(ibv_memcpy_from_dm(back, dm, 0, sizeof back), 0);
  EXPECT_EQ(std::memcmp(back, pattern, sizeof back), 0);

  // Objects made now get rings of their own, not the parent's (which the
  // child must not have given back to the device).
  ibv_cq* fresh = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
  ASSERT_NE(fresh, nullptr);
  ASSERT_EQ(post_recv_b(40, 0, 64, srq), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 41, 0, 64), 0);
  EXPECT_EQ(poll_n(cq_a_, 1).size(), 1u);
  EXPECT_EQ(poll_n(cq_b_, 1).size(), 1u);
  ibv_wc none{};
  EXPECT_EQ(ibv_poll_cq(fresh, 1, &none), 0) << "the new CQ shares a ring with one of the parent's";
  EXPECT_EQ(ibv_destroy_cq(fresh), 0);

  // And the parent's destroys succeed once each.
  EXPECT_EQ(ibv_free_dm(dm), 0);
  EXPECT_EQ(ibv_dealloc_mw(mw), 0);
  EXPECT_EQ(ibv_destroy_qp(qp_b_), 0);
  qp_b_ = nullptr;
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
}

// A forked child may also make QPs of its own on the device context it
// inherited (librdmacm's device list, kept across fork, makes its QP1
// agent there): they carry traffic as in any process, and the parent's
// keep working beside them.
TEST_F(ForkDataPath, AForkedChildMakesItsOwnQpsOnTheContextItInherited) {
  connect(IBV_QPT_RC);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(post_recv_b(1, 0, 64), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 64), 0);
  ASSERT_EQ(poll_n(cq_a_, 1).size(), 1u);
  ASSERT_EQ(poll_n(cq_b_, 1).size(), 1u);

  // On a UDP device the parent's QPs are served by its engine's thread.
  const bool parent_has_engine = has_thread_named("softverbs-udp");
  pid_t child = fork();
  if (child == 0) {
    // Its own CQs, QPs and MRs (the inherited ones stay the parent's).
    cq_a_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    cq_b_ = ibv_create_cq(context_, 64, nullptr, nullptr, 0);
    mr_a_ = ibv_reg_mr(pd_, buffer_a_.data(), buffer_a_.size(), kAllAccess);
    mr_b_ = ibv_reg_mr(pd_, buffer_b_.data(), buffer_b_.size(), kAllAccess);
    if (!cq_a_ || !cq_b_ || !mr_a_ || !mr_b_) _exit(2);
    connect(IBV_QPT_RC);
    if (HasFatalFailure()) _exit(3);
    for (int round = 0; round < 200; ++round) {
      std::memset(buffer_a_.data(), round, 1024);
      if (post_recv_b(10, 0, 1024) != 0 || post_a(IBV_WR_SEND, 11, 0, 1024) != 0) _exit(4);
      auto sent = poll_n(cq_a_, 1);
      auto received = poll_n(cq_b_, 1);
      if (sent.size() != 1 || received.size() != 1) _exit(5);
      if (sent[0].status != IBV_WC_SUCCESS || received[0].status != IBV_WC_SUCCESS) _exit(6);
      if (std::memcmp(buffer_a_.data(), buffer_b_.data(), 1024) != 0) _exit(7);
    }
    // Served by an engine of its own: fork copies no thread, and the
    // parent's sockets and epoll set are the parent's.
    if (parent_has_engine && !has_thread_named("softverbs-udp")) _exit(8);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the child's traffic (2: objects, 3: connect, 4: post, 5: no completion, 6: error, 7: bytes, 8: no engine of "
         "its own): "
      << describe_exit(status);
  expect_sends_arrive(20, 512);
}

}  // namespace
