// On-demand paging and device memory through the installed libibverbs:
// ODP regions (explicit and implicit) whose pages are resolved at access,
// ibv_advise_mr, the ODP capabilities, and ibv_alloc_dm / ibv_memcpy_*_dm /
// ibv_reg_dm_mr with DM MRs as local SGEs and remote targets, in one
// process and across two.
//
// Started through `softverbs run` by ctest, on a shared-memory device, over
// UDP, with kernel copies and with the copy agent: the verbs_datapath_*_test
// files make one executable.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "rc_endpoint.h"
#include "verbs_datapath.h"

namespace {

using namespace softverbs::test;

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// Pages of anonymous memory, unmapped at the end.
class Pages {
 public:
  explicit Pages(size_t count) : bytes_(count * page_size()) {
    void* area = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    base_ = area == MAP_FAILED ? nullptr : static_cast<uint8_t*>(area);
  }
  ~Pages() {
    if (base_) munmap(base_, bytes_);
  }
  Pages(const Pages&) = delete;
  Pages& operator=(const Pages&) = delete;
  uint8_t* page(size_t index) const { return base_ + index * page_size(); }
  uint64_t address(size_t index) const { return reinterpret_cast<uint64_t>(page(index)); }
  // Takes a page away as unmapping would, but keeps its addresses reserved
  // (no access): a mapping made meanwhile (a thread's stack, an allocator's
  // arena) cannot land there, where a test's WRITE would then be legitimate.
  bool unmap(size_t index) const {
    return mmap(page(index), page_size(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) ==
           page(index);
  }
  // A fresh zeroed page where one was unmapped, as an application maps memory again.
  bool map_again(size_t index) const {
    return mmap(page(index), page_size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
           page(index);
  }

 private:
  size_t bytes_;
  uint8_t* base_ = nullptr;
};

constexpr int kOnDemandAll = kAllAccess | IBV_ACCESS_ON_DEMAND;

// One signaled work request from qp_a_, with its SGE as given.
int post_from(ibv_qp* qp, ibv_wr_opcode opcode, uint64_t local, uint32_t length, uint32_t lkey, uint64_t remote,
              uint32_t rkey, uint64_t compare_add = 0, uint64_t swap = 0) {
  ibv_sge sge{local, length, lkey};
  ibv_send_wr wr{};
  wr.wr_id = 7;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == IBV_WR_ATOMIC_CMP_AND_SWP)
    wr.wr.atomic = {remote, compare_add, swap, rkey};
  else
    wr.wr.rdma = {remote, rkey};
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(qp, &wr, &bad);
}

ibv_wc_status status_of(ibv_cq* cq) {
  auto done = poll_n(cq, 1);
  return done.empty() ? IBV_WC_GENERAL_ERR : done[0].status;
}

class OnDemandPaging : public RcDataPath {
 protected:
  // A new connected pair, after an error took the last one down.
  void reconnect() {
    for (ibv_qp** qp : {&qp_a_, &qp_b_})
      if (*qp) {
        ASSERT_EQ(ibv_destroy_qp(*qp), 0);
        *qp = nullptr;
      }
    poll_n(cq_a_, 64, std::chrono::milliseconds(50));
    poll_n(cq_b_, 64, std::chrono::milliseconds(50));
    connect(IBV_QPT_RC);
  }
};

TEST_F(OnDemandPaging, DeviceReportsOdpAndDeviceMemory) {
  ibv_device_attr_ex attr{};
  ASSERT_EQ(ibv_query_device_ex(context_, nullptr, &attr), 0);
  EXPECT_EQ(attr.odp_caps.general_caps, uint64_t{IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT});
  const uint32_t all = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ |
                       IBV_ODP_SUPPORT_ATOMIC | IBV_ODP_SUPPORT_SRQ_RECV;
  EXPECT_EQ(attr.odp_caps.per_transport_caps.rc_odp_caps, all);
  EXPECT_EQ(attr.odp_caps.per_transport_caps.uc_odp_caps,
            uint32_t{IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_SRQ_RECV});
  EXPECT_EQ(attr.odp_caps.per_transport_caps.ud_odp_caps,
            uint32_t{IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_SRQ_RECV});
  EXPECT_EQ(attr.xrc_odp_caps, all);
  EXPECT_EQ(attr.max_dm_size, uint64_t{128} << 10);
}

// No pinning at registration: memory that is not mapped (yet) registers.
TEST_F(OnDemandPaging, RegistrationTakesMemoryThatIsNotMapped) {
  Pages pages(2);
  ASSERT_TRUE(pages.unmap(1));
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, pages.page(0), 2 * page_size(), kAllAccess), nullptr);
  EXPECT_EQ(errno, EFAULT) << "pinned: refused";
  ibv_mr* mr = ibv_reg_mr(pd_, pages.page(0), 2 * page_size(), kOnDemandAll);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  // Implicit ODP names the whole address space, and only at iova 0.
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, nullptr, SIZE_MAX, kAllAccess), nullptr) << "without ON_DEMAND";
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr_iova(pd_, nullptr, SIZE_MAX, 0x1000, kOnDemandAll), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

// A local SGE on a page that is not mapped when the work request runs
// fails as an HCA's unresolvable page fault does; mapped again, it works.
TEST_F(OnDemandPaging, LocalPageNotMappedAtAccessIsALocalProtectionError) {
  Pages pages(2);
  std::memset(pages.page(0), 0x5a, 2 * page_size());
  ibv_mr* mr = ibv_reg_mr(pd_, pages.page(0), 2 * page_size(), kOnDemandAll);
  ASSERT_NE(mr, nullptr);
  connect(IBV_QPT_RC);
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_WRITE, pages.address(1), 16, mr->lkey, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(buffer_b_[15], 0x5a);
  ASSERT_TRUE(pages.unmap(1));
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_WRITE, pages.address(1), 16, mr->lkey, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_LOC_PROT_ERR) << "source page unmapped";
  reconnect();
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_READ, pages.address(1), 16, mr->lkey, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_LOC_PROT_ERR) << "READ into an unmapped page";
  reconnect();
  ASSERT_TRUE(pages.map_again(1));
  buffer_b_[0] = 0x33;
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_READ, pages.address(1), 16, mr->lkey, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS) << "mapped again: resolved at the next access";
  EXPECT_EQ(pages.page(1)[0], 0x33);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
}

// The target's pages are resolved as the operation lands: unmapped, or
// without the access the operation needs, they are a remote access error.
TEST_F(OnDemandPaging, RemotePageNotResolvableIsARemoteAccessError) {
  Pages pages(3);
  ibv_mr* mr = ibv_reg_mr(pd_, pages.page(0), 3 * page_size(), kOnDemandAll);
  ASSERT_NE(mr, nullptr);
  ASSERT_TRUE(pages.unmap(1));
  ASSERT_EQ(mprotect(pages.page(2), page_size(), PROT_READ), 0);
  connect(IBV_QPT_RC);
  std::memset(buffer_a_.data(), 0x42, 64);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 64, pages.address(0), mr->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(pages.page(0)[63], 0x42);
  ASSERT_EQ(post_a(IBV_WR_RDMA_READ, 2, 128, 64, pages.address(2), mr->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS) << "reading a read-only page";
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 3, 0, 64, pages.address(2), mr->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_REM_ACCESS_ERR) << "writing a read-only page";
  struct Case {
    const char* what;
    ibv_wr_opcode opcode;
    uint64_t remote;
  };
  for (const Case& c : {Case{"WRITE into an unmapped page", IBV_WR_RDMA_WRITE, pages.address(1)},
                        Case{"READ of an unmapped page", IBV_WR_RDMA_READ, pages.address(1)},
                        Case{"WRITE running into an unmapped page", IBV_WR_RDMA_WRITE, pages.address(1) - 32},
                        Case{"atomic on a read-only page", IBV_WR_ATOMIC_FETCH_AND_ADD, pages.address(2)}}) {
    reconnect();
    ASSERT_EQ(post_a(c.opcode, 4, 0, c.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ? 8 : 64, c.remote, mr->rkey), 0);
    EXPECT_EQ(status_of(cq_a_), IBV_WC_REM_ACCESS_ERR) << c.what;
  }
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
}

// A SEND into a receive buffer whose page is gone: the receiver's
// completion is a local protection error, the sender's a remote operation
// error, as for a receive buffer an HCA cannot reach.
TEST_F(OnDemandPaging, ReceiveIntoAPageNotMappedFailsOnBothSides) {
  Pages pages(1);
  ibv_mr* mr = ibv_reg_mr(pd_, pages.page(0), page_size(), kOnDemandAll);
  ASSERT_NE(mr, nullptr);
  connect(IBV_QPT_RC);
  ibv_sge sge{pages.address(0), 64, mr->lkey};
  ibv_recv_wr receive{};
  receive.sg_list = &sge;
  receive.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_recv(qp_b_, &receive, &bad), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 1, 0, 64), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(status_of(cq_b_), IBV_WC_SUCCESS);
  ASSERT_TRUE(pages.unmap(0));
  ASSERT_EQ(ibv_post_recv(qp_b_, &receive, &bad), 0);
  ASSERT_EQ(post_a(IBV_WR_SEND, 2, 0, 64), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_REM_OP_ERR);
  EXPECT_EQ(status_of(cq_b_), IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
}

// Implicit ODP: one key over the whole address space, for local SGEs,
// receives and remote access, and still nothing that is not mapped.
TEST_F(OnDemandPaging, ImplicitRegionCoversTheAddressSpace) {
  ibv_mr* implicit = ibv_reg_mr(pd_, nullptr, SIZE_MAX, kOnDemandAll);
  ASSERT_NE(implicit, nullptr) << std::strerror(errno);
  connect(IBV_QPT_RC);
  std::vector<uint8_t> source(256, 0x61), target(256, 0);
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_WRITE, reinterpret_cast<uint64_t>(source.data()), 256, implicit->lkey,
                      reinterpret_cast<uint64_t>(target.data()), implicit->rkey),
            0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(target[255], 0x61);
  // A SEND into a receive whose SGE names the implicit key.
  ibv_sge receive_sge{reinterpret_cast<uint64_t>(target.data()), 256, implicit->lkey};
  ibv_recv_wr receive{};
  receive.sg_list = &receive_sge;
  receive.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_recv(qp_b_, &receive, &bad), 0);
  source[0] = 0x62;
  ASSERT_EQ(post_from(qp_a_, IBV_WR_SEND, reinterpret_cast<uint64_t>(source.data()), 16, implicit->lkey, 0, 0), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(status_of(cq_b_), IBV_WC_SUCCESS);
  EXPECT_EQ(target[0], 0x62);
  Pages hole(1);
  ASSERT_TRUE(hole.unmap(0));
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_WRITE, reinterpret_cast<uint64_t>(source.data()), 16, implicit->lkey,
                      hole.address(0), implicit->rkey),
            0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(ibv_dereg_mr(implicit), 0);
}

TEST_F(OnDemandPaging, AdviseMrPrefetchesAndRefusesAsMlx5Does) {
  Pages pages(2);
  ibv_mr* odp = ibv_reg_mr(pd_, pages.page(0), 2 * page_size(), kOnDemandAll);
  ibv_mr* odp_read_only = ibv_reg_mr(pd_, pages.page(0), page_size(), IBV_ACCESS_ON_DEMAND);
  ASSERT_TRUE(odp && odp_read_only);
  auto advise = [&](int advice, uint32_t flags, uint64_t address, uint32_t length, uint32_t lkey) {
    ibv_sge sge{address, length, lkey};
    return ibv_advise_mr(pd_, static_cast<ibv_advise_mr_advice>(advice), flags, &sge, 1);
  };
  const uint32_t flush = IB_UVERBS_ADVISE_MR_FLAG_FLUSH;
  for (int advice :
       {IBV_ADVISE_MR_ADVICE_PREFETCH, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT})
    for (uint32_t flags : {0u, flush})
      EXPECT_EQ(advise(advice, flags, pages.address(0), 2 * page_size(), odp->lkey), 0)
          << "advice " << advice << " flags " << flags;
  EXPECT_EQ(advise(7, flush, pages.address(0), 8, odp->lkey), EOPNOTSUPP) << "unknown advice";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH, 2, pages.address(0), 8, odp->lkey), EINVAL) << "unknown flag";
  EXPECT_EQ(ibv_advise_mr(pd_, IBV_ADVISE_MR_ADVICE_PREFETCH, flush, nullptr, 0), EINVAL) << "no SGE";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH, flush, addr_b(0), 8, mr_b_->lkey), ENOENT) << "a pinned region";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH, 0, addr_b(0), 8, mr_b_->lkey), EINVAL) << "the same, async";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH, flush, pages.address(0), 8, odp->lkey ^ 0x10000), ENOENT)
      << "no such key";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, flush, pages.address(0), 8, odp_read_only->lkey), ENOENT)
      << "write prefetch of a region without write access";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH, flush, pages.address(0), 8, odp_read_only->lkey), 0);
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH, flush, pages.address(1), 8, odp_read_only->lkey), EFAULT)
      << "beyond the region";
  ibv_pd* other_pd = ibv_alloc_pd(context_);
  ASSERT_NE(other_pd, nullptr);
  ibv_sge sge{pages.address(0), 8, odp->lkey};
  EXPECT_EQ(ibv_advise_mr(other_pd, IBV_ADVISE_MR_ADVICE_PREFETCH, flush, &sge, 1), ENOENT) << "another PD's key";
  EXPECT_EQ(ibv_dealloc_pd(other_pd), 0);
  ASSERT_TRUE(pages.unmap(1));
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, flush, pages.address(1), 8, odp->lkey), EFAULT)
      << "a page that is not mapped";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, pages.address(1), 8, odp->lkey), 0) << "best effort";
  EXPECT_EQ(advise(IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT, flush, pages.address(1), 8, odp->lkey), 0)
      << "no fault: what is not present stays so";
  EXPECT_EQ(ibv_dereg_mr(odp_read_only), 0);
  EXPECT_EQ(ibv_dereg_mr(odp), 0);
}

class DeviceMemoryVerbs : public RcDataPath {
 protected:
  ibv_dm* allocate(size_t length) {
    ibv_alloc_dm_attr attr{};
    attr.length = length;
    return ibv_alloc_dm(context_, &attr);
  }
};

TEST_F(DeviceMemoryVerbs, AllocationRules) {
  ibv_device_attr_ex device{};
  ASSERT_EQ(ibv_query_device_ex(context_, nullptr, &device), 0);
  struct Case {
    const char* what;
    ibv_alloc_dm_attr attr;
  };
  for (const Case& c : {Case{"length 0", {0, 0, 0}}, Case{"beyond max_dm_size", {device.max_dm_size + 1, 0, 0}},
                        Case{"a comp_mask", {64, 0, 1}}, Case{"an alignment beyond a page", {64, 13, 0}}}) {
    ibv_alloc_dm_attr attr = c.attr;
    errno = 0;
    EXPECT_EQ(ibv_alloc_dm(context_, &attr), nullptr) << c.what;
    EXPECT_EQ(errno, EINVAL) << c.what;
  }
  ibv_dm* all = allocate(device.max_dm_size);
  ASSERT_NE(all, nullptr) << std::strerror(errno);
  errno = 0;
  EXPECT_EQ(allocate(4), nullptr) << "the device's memory is taken";
  EXPECT_EQ(errno, ENOMEM);
  EXPECT_EQ(ibv_free_dm(all), 0);
  ibv_dm* half = allocate(device.max_dm_size / 2);
  ibv_dm* other_half = allocate(device.max_dm_size / 2);
  EXPECT_TRUE(half && other_half) << "freed memory is the device's again";
  for (ibv_dm* dm : {half, other_half})
    if (dm) {
      EXPECT_EQ(ibv_free_dm(dm), 0);
    }
}

// A process that dies holding device memory gives it back: the next
// process to open the device reclaims it, as it reclaims the rest.
TEST_F(DeviceMemoryVerbs, MemoryOfAProcessThatDiedIsReclaimed) {
  ibv_device_attr_ex device{};
  ASSERT_EQ(ibv_query_device_ex(context_, nullptr, &device), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ibv_context* context = open_softverbs0();
    ibv_alloc_dm_attr attr{};
    attr.length = device.max_dm_size;
    _exit(context && ibv_alloc_dm(context, &attr) ? 0 : 1);  // no ibv_free_dm
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << describe_exit(status);
  ibv_context* later = open_softverbs0();
  ASSERT_NE(later, nullptr);
  ibv_alloc_dm_attr attr{};
  attr.length = device.max_dm_size;
  ibv_dm* all = ibv_alloc_dm(later, &attr);
  EXPECT_NE(all, nullptr) << std::strerror(errno);
  if (all) {
    EXPECT_EQ(ibv_free_dm(all), 0);
  }
  EXPECT_EQ(ibv_close_device(later), 0);
}

// Importing a device (and so a DM) is not supported: ibv_import_device
// finds the device behind a context's descriptor and says so.
TEST_F(DeviceMemoryVerbs, ImportIsNotSupported) {
  const int fd = dup(context_->cmd_fd);
  ASSERT_GE(fd, 0);
  errno = 0;
  EXPECT_EQ(ibv_import_device(fd), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  close(fd);
}

// Copies stay within the allocation and move 4-byte words, as mlx5's.
TEST_F(DeviceMemoryVerbs, CopiesStayWithinTheAllocation) {
  ibv_dm* dm = allocate(100);
  ASSERT_NE(dm, nullptr);
  std::vector<uint8_t> in(100), out(100, 0xee);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i + 1);
  ASSERT_EQ(ibv_memcpy_from_dm(out.data(), dm, 0, 100), 0);
  EXPECT_EQ(out, std::vector<uint8_t>(100, 0)) << "device memory starts zeroed";
  ASSERT_EQ(ibv_memcpy_to_dm(dm, 0, in.data(), 100), 0);
  ASSERT_EQ(ibv_memcpy_from_dm(out.data(), dm, 0, 100), 0);
  EXPECT_EQ(out, in);
  struct Case {
    const char* what;
    uint64_t offset;
    size_t length;
    int error;
  };
  for (const Case& c : {Case{"unaligned offset", 3, 4, EINVAL}, Case{"unaligned length", 4, 3, EINVAL},
                        Case{"offset beyond", 104, 4, EFAULT}, Case{"length beyond", 0, 104, EFAULT},
                        Case{"running past the end", 96, 8, EFAULT}, Case{"wrapping", UINT64_MAX - 3, 8, EFAULT}}) {
    std::vector<uint8_t> host(128, 0x77);
    EXPECT_EQ(ibv_memcpy_to_dm(dm, c.offset, host.data(), c.length), c.error) << c.what;
    EXPECT_EQ(ibv_memcpy_from_dm(host.data(), dm, c.offset, c.length), c.error) << c.what;
    EXPECT_EQ(host, std::vector<uint8_t>(128, 0x77)) << c.what << ": nothing copied";
  }
  ASSERT_EQ(ibv_memcpy_from_dm(out.data(), dm, 0, 100), 0);
  EXPECT_EQ(out, in) << "refused copies changed nothing";
  EXPECT_EQ(ibv_memcpy_to_dm(dm, 100, in.data(), 0), 0) << "nothing at the end";
  EXPECT_EQ(ibv_free_dm(dm), 0);
}

TEST_F(DeviceMemoryVerbs, RegistrationRules) {
  ibv_dm* dm = allocate(100);
  ASSERT_NE(dm, nullptr);
  const unsigned zero_based = IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE;
  struct Case {
    const char* what;
    uint64_t offset;
    size_t length;
    unsigned access;
  };
  for (const Case& c :
       {Case{"not zero based", 0, 100, IBV_ACCESS_LOCAL_WRITE},
        Case{"memory window binding", 0, 100, zero_based | IBV_ACCESS_MW_BIND},
        Case{"on demand", 0, 100, zero_based | IBV_ACCESS_ON_DEMAND},
        Case{"remote write without local write", 0, 100, IBV_ACCESS_ZERO_BASED | IBV_ACCESS_REMOTE_WRITE},
        Case{"longer than the allocation", 0, 104, zero_based}, Case{"running past its end", 4, 100, zero_based},
        Case{"offset beyond it", 104, 0, zero_based}}) {
    errno = 0;
    EXPECT_EQ(ibv_reg_dm_mr(pd_, dm, c.offset, c.length, c.access), nullptr) << c.what;
    EXPECT_EQ(errno, EINVAL) << c.what;
  }
  ibv_mr* empty = ibv_reg_dm_mr(pd_, dm, 100, 0, zero_based);
  EXPECT_NE(empty, nullptr) << "an empty registration at the end";
  ibv_mr* mr = ibv_reg_dm_mr(pd_, dm, 0, 100, zero_based | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(ibv_free_dm(dm), EBUSY) << "MRs still name it";
  EXPECT_EQ(ibv_dealloc_pd(pd_), EBUSY) << "and the PD";
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  if (empty) {
    EXPECT_EQ(ibv_dereg_mr(empty), 0);
  }
  EXPECT_EQ(ibv_free_dm(dm), 0);
}

// A DM MR as a local SGE (SEND source, READ sink, receive buffer) and as
// the target of WRITE, READ and atomics, at iovas that start at 0.
TEST_F(DeviceMemoryVerbs, RegionsAreLocalAndRemoteBuffers) {
  ibv_dm* dm = allocate(256);
  ASSERT_NE(dm, nullptr);
  ibv_mr* mr = ibv_reg_dm_mr(pd_, dm, 64, 128, IBV_ACCESS_ZERO_BASED | kAllAccess);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  connect(IBV_QPT_RC);
  std::vector<uint8_t> pattern(128);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(0x80 + i);
  ASSERT_EQ(ibv_memcpy_to_dm(dm, 64, pattern.data(), 128), 0);
  // Local: a SEND from the DM into buffer_b_.
  ASSERT_EQ(post_recv_b(1, 0, 128), 0);
  ASSERT_EQ(post_from(qp_a_, IBV_WR_SEND, 0, 128, mr->lkey, 0, 0), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(status_of(cq_b_), IBV_WC_SUCCESS);
  EXPECT_EQ(std::vector<uint8_t>(buffer_b_.begin(), buffer_b_.begin() + 128), pattern);
  // Remote: a WRITE into the DM at iova 16, a READ back, an atomic.
  std::memset(buffer_a_.data(), 0x11, 32);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 2, 0, 32, 16, mr->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  std::vector<uint8_t> seen(256);
  ASSERT_EQ(ibv_memcpy_from_dm(seen.data(), dm, 0, 256), 0);
  EXPECT_EQ(seen[64 + 15], pattern[15]);
  EXPECT_EQ(seen[64 + 16], 0x11);
  EXPECT_EQ(seen[64 + 47], 0x11);
  EXPECT_EQ(seen[64 + 48], pattern[48]);
  EXPECT_EQ(seen[63], 0) << "nothing before the MR's range";
  ASSERT_EQ(post_a(IBV_WR_RDMA_READ, 3, 1000, 8, 120, mr->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(buffer_a_.data() + 1000, pattern.data() + 120, 8), 0);
  uint64_t before = 0;
  std::memcpy(&before, pattern.data() + 64, 8);
  ASSERT_EQ(post_from(qp_a_, IBV_WR_ATOMIC_FETCH_AND_ADD, reinterpret_cast<uint64_t>(buffer_a_.data() + 2000), 8,
                      mr_a_->lkey, 64, mr->rkey, 5),
            0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  uint64_t fetched = 0, after = 0;
  std::memcpy(&fetched, buffer_a_.data() + 2000, 8);
  ASSERT_EQ(ibv_memcpy_from_dm(&after, dm, 128, 8), 0);
  EXPECT_EQ(fetched, before);
  EXPECT_EQ(after, before + 5);
  // A READ into the DM (a local sink) and a receive in it.
  std::memset(buffer_b_.data() + 512, 0x22, 16);
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_READ, 0, 16, mr->lkey, addr_b(512), mr_b_->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  ASSERT_EQ(ibv_memcpy_from_dm(seen.data(), dm, 64, 16), 0);
  EXPECT_EQ(seen[0], 0x22);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 4, 0, 8, 124, mr->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_REM_ACCESS_ERR) << "past the MR's 128 bytes";
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(ibv_free_dm(dm), 0);
}

// Another process's ODP region and DM MR, reached over the device's
// transport (a kernel copy, the copy agent, a mapping of the DM, or UDP).
TEST(PagingCrossProcess, PeersReachOnDemandPagesAndDeviceMemory) {
  struct Keys {
    ConnectInfo info;
    uint64_t odp_address;
    uint32_t odp_rkey;
    uint32_t dm_rkey;
  };
  int to_child[2], to_parent[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(to_parent), 0);
  Pages pages(2);
  ASSERT_NE(pages.page(0), nullptr);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(to_child[1]);
    close(to_parent[0]);
    alarm(60);
    int code;
    {
      std::vector<uint8_t> buffer(64, 0);
      Endpoint self;
      if (!self.open(buffer.data(), buffer.size(), 4)) _exit(10);
      ibv_mr* odp = ibv_reg_mr(self.pd(), pages.page(0), 2 * page_size(), kOnDemandAll);
      ibv_alloc_dm_attr attr{};
      attr.length = 64;
      ibv_dm* dm = ibv_alloc_dm(self.context(), &attr);
      ibv_mr* dm_mr = dm ? ibv_reg_dm_mr(self.pd(), dm, 0, 64, IBV_ACCESS_ZERO_BASED | kAllAccess) : nullptr;
      if (!odp || !dm_mr || !pages.unmap(1)) _exit(11);
      Keys keys{self.info(), pages.address(0), odp->rkey, dm_mr->rkey};
      ConnectInfo parent{};
      if (write(to_parent[1], &keys, sizeof keys) != sizeof keys ||
          read(to_child[0], &parent, sizeof parent) != sizeof parent)
        _exit(12);
      if (!self.connect(parent, 14, 7)) _exit(13);
      char signal = 'r';
      if (write(to_parent[1], &signal, 1) != 1 || read(to_child[0], &signal, 1) != 1) _exit(14);
      std::vector<uint8_t> in_dm(64);
      if (ibv_memcpy_from_dm(in_dm.data(), dm, 0, 64) != 0) _exit(15);
      code = in_dm == std::vector<uint8_t>(64, 0x5c) && pages.page(0)[0] == 0x5c && pages.page(0)[63] == 0x5c &&
                     pages.page(0)[64] == 0
                 ? 0
                 : 20;
      ibv_dereg_mr(dm_mr);
      ibv_dereg_mr(odp);
      ibv_free_dm(dm);
    }
    _exit(code);
  }
  close(to_child[0]);
  close(to_parent[1]);
  std::vector<uint8_t> mine(64, 0x5c), back(64, 0);
  Endpoint parent;
  ASSERT_TRUE(parent.open(mine.data(), mine.size(), 4));
  Keys keys{};
  ConnectInfo info = parent.info();
  char ready = 0;
  ASSERT_EQ(read(to_parent[0], &keys, sizeof keys), static_cast<ssize_t>(sizeof keys));
  ASSERT_EQ(write(to_child[1], &info, sizeof info), static_cast<ssize_t>(sizeof info));
  ASSERT_TRUE(parent.connect(keys.info, 14, 7));
  ASSERT_EQ(read(to_parent[0], &ready, 1), 1);
  const uint32_t lkey = parent.mr()->lkey;
  const uint64_t local = reinterpret_cast<uint64_t>(mine.data());
  ASSERT_EQ(post_from(parent.qp(), IBV_WR_RDMA_WRITE, local, 64, lkey, keys.odp_address, keys.odp_rkey), 0);
  EXPECT_EQ(status_of(parent.cq()), IBV_WC_SUCCESS) << "WRITE into the child's ODP page";
  ASSERT_EQ(post_from(parent.qp(), IBV_WR_RDMA_WRITE, local, 64, lkey, 0, keys.dm_rkey), 0);
  EXPECT_EQ(status_of(parent.cq()), IBV_WC_SUCCESS) << "WRITE into the child's device memory";
  ASSERT_EQ(post_from(parent.qp(), IBV_WR_RDMA_READ, local, 64, lkey, 0, keys.dm_rkey), 0);
  EXPECT_EQ(status_of(parent.cq()), IBV_WC_SUCCESS) << "READ of it";
  ASSERT_EQ(post_from(parent.qp(), IBV_WR_RDMA_WRITE, local, 64, lkey, keys.odp_address + page_size(), keys.odp_rkey),
            0);
  EXPECT_EQ(status_of(parent.cq()), IBV_WC_REM_ACCESS_ERR) << "the child's unmapped ODP page";
  char done = 'd';
  ASSERT_EQ(write(to_child[1], &done, 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << describe_exit(status);
  close(to_child[1]);
  close(to_parent[0]);
}

}  // namespace

namespace {

// Where this process maps the device's shared state (its key table among
// it): a line of /proc/self/maps naming the device memory file.
uint64_t device_state_mapping() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find("softverbs0.mem") != std::string::npos) return std::stoull(line, nullptr, 16);
  return 0;
}

// An implicit region covers the whole address space, but never softverbs'
// own mappings in it: a peer holding its rkey must not rewrite the device's
// key table, nor a local SGE name it.
TEST_F(OnDemandPaging, ImplicitRegionNeverReachesTheDevicesOwnState) {
  const uint64_t state = device_state_mapping();
  ASSERT_NE(state, 0u) << "no mapping of softverbs0.mem in /proc/self/maps";
  ibv_mr* implicit = ibv_reg_mr(pd_, nullptr, SIZE_MAX, kOnDemandAll);
  ASSERT_NE(implicit, nullptr) << std::strerror(errno);
  connect(IBV_QPT_RC);
  std::memset(buffer_a_.data(), 0xee, 64);
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 1, 0, 64, state + 4096, implicit->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_REM_ACCESS_ERR);
  reconnect();
  ASSERT_EQ(post_a(IBV_WR_RDMA_READ, 2, 0, 64, state, implicit->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_REM_ACCESS_ERR);
  reconnect();
  ASSERT_EQ(post_from(qp_a_, IBV_WR_RDMA_WRITE, state, 64, implicit->lkey, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_LOC_PROT_ERR);
  reconnect();
  // The device is unharmed: ordinary traffic still flows.
  ASSERT_EQ(post_a(IBV_WR_RDMA_WRITE, 3, 0, 64, addr_b(0), mr_b_->rkey), 0);
  EXPECT_EQ(status_of(cq_a_), IBV_WC_SUCCESS);
  EXPECT_EQ(buffer_b_[63], 0xee);
  EXPECT_EQ(ibv_dereg_mr(implicit), 0);
}

TEST_F(OnDemandPaging, RangesThatWrapOrChangeKindAreRefused) {
  const uint64_t last_page = ~uint64_t{0} & ~uint64_t{page_size() - 1};
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd_, reinterpret_cast<void*>(last_page), 2 * page_size(), kOnDemandAll), nullptr);
  EXPECT_EQ(errno, EINVAL) << "a range past the end of the address space";

  ibv_mr* implicit = ibv_reg_mr(pd_, nullptr, SIZE_MAX, kOnDemandAll);
  ASSERT_NE(implicit, nullptr);
  EXPECT_EQ(ibv_rereg_mr(implicit, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, kAllAccess), IBV_REREG_MR_ERR_CMD)
      << "an implicit region has no range to keep pinned";
  EXPECT_EQ(ibv_dereg_mr(implicit), 0);

  Pages pages(2);
  ibv_mr* odp = ibv_reg_mr(pd_, pages.page(0), 2 * page_size(), kOnDemandAll);
  ASSERT_NE(odp, nullptr);
  ASSERT_TRUE(pages.unmap(1));
  EXPECT_EQ(ibv_rereg_mr(odp, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, kAllAccess), IBV_REREG_MR_ERR_CMD)
      << "on-demand to pinned, over a page that is not there";
  EXPECT_EQ(ibv_dereg_mr(odp), 0);
}

TEST_F(DeviceMemoryVerbs, RegionsOfDeviceMemoryAreNotReregistered) {
  ibv_dm* dm = allocate(256);
  ASSERT_NE(dm, nullptr);
  ibv_mr* mr = ibv_reg_dm_mr(pd_, dm, 0, 256, IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(
      ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND),
      IBV_REREG_MR_ERR_CMD)
      << "dropping ZERO_BASED, adding MW_BIND";
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(ibv_free_dm(dm), 0);
}

}  // namespace
