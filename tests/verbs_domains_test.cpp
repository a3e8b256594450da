// Thread domains and parent domains through the installed libibverbs:
// a parent domain taken wherever a PD is, its allocator giving the memory of
// the QPs, CQs and SRQs made in it, and the errors HCAs give.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "verbs_features.h"

namespace softverbs::test {
namespace {

// An allocator that counts what it is asked for and gives aligned memory,
// or answers `answer` instead when that is set.
struct CountingAllocator {
  struct Block {
    void* pointer;
    size_t size;
    uint64_t resource_type;
  };
  std::vector<Block> given;
  std::vector<Block> freed;
  void* answer = nullptr;  // IBV_ALLOCATOR_USE_DEFAULT, or nullptr for real memory
  bool refuse = false;     // answer NULL: out of memory

  static void* alloc(ibv_pd*, void* pd_context, size_t size, size_t alignment, uint64_t resource_type) {
    auto* self = static_cast<CountingAllocator*>(pd_context);
    if (self->refuse) return nullptr;
    if (self->answer != nullptr) return self->answer;
    void* memory = nullptr;
    if (posix_memalign(&memory, alignment, size) != 0) return nullptr;
    std::memset(memory, 0xa5, size);  // the provider must not rely on zeroed memory
    self->given.push_back({memory, size, resource_type});
    return memory;
  }
  static void free(ibv_pd*, void* pd_context, void* pointer, uint64_t resource_type) {
    auto* self = static_cast<CountingAllocator*>(pd_context);
    self->freed.push_back({pointer, 0, resource_type});
    std::free(pointer);
  }
  bool gave(const void* object) const {
    for (const Block& block : given) {
      const auto* start = static_cast<const char*>(block.pointer);
      if (static_cast<const char*>(object) >= start && static_cast<const char*>(object) < start + block.size)
        return true;
    }
    return false;
  }
};

class Domains : public DeviceFixture {
 protected:
  ibv_pd* parent_domain(ibv_td* td = nullptr, CountingAllocator* allocator = nullptr) {
    ibv_parent_domain_init_attr attr{};
    attr.pd = pd_;
    attr.td = td;
    if (allocator != nullptr) {
      attr.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
      attr.alloc = CountingAllocator::alloc;
      attr.free = CountingAllocator::free;
      attr.pd_context = allocator;
    }
    return ibv_alloc_parent_domain(context_, &attr);
  }
};

TEST_F(Domains, ThreadDomainAllocatesAndFrees) {
  ibv_td_init_attr attr{};
  ibv_td* td = ibv_alloc_td(context_, &attr);
  ASSERT_NE(td, nullptr) << std::strerror(errno);
  EXPECT_EQ(td->context, context_);
  EXPECT_EQ(ibv_dealloc_td(td), 0);
}

TEST_F(Domains, ThreadDomainWithUnknownMaskIsRefused) {
  ibv_td_init_attr attr{};
  attr.comp_mask = 1;
  errno = 0;
  EXPECT_EQ(ibv_alloc_td(context_, &attr), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(Domains, ParentDomainStandsForItsPdEverywhere) {
  ibv_td_init_attr td_attr{};
  ibv_td* td = ibv_alloc_td(context_, &td_attr);
  ASSERT_NE(td, nullptr);
  ibv_pd* domain = parent_domain(td);
  ASSERT_NE(domain, nullptr) << std::strerror(errno);
  EXPECT_EQ(domain->context, context_);

  // An MR of the parent domain and one of its PD are usable by QPs of either.
  Pair pair;
  ASSERT_TRUE(pair.create(domain, pd_, cq_a_, cq_b_));
  EXPECT_EQ(pair.qp_a->pd, domain);
  ASSERT_TRUE(pair.connect());
  ASSERT_TRUE(pair.write_and_send());

  ibv_srq_init_attr srq_init{};
  srq_init.attr = {16, 1, 0};
  ibv_srq* srq = ibv_create_srq(domain, &srq_init);
  ASSERT_NE(srq, nullptr) << std::strerror(errno);
  EXPECT_EQ(srq->pd, domain);

  ibv_qp_init_attr_ex ex{};
  ex.qp_type = IBV_QPT_RC;
  ex.send_cq = cq_a_;
  ex.recv_cq = cq_a_;
  ex.cap = {4, 4, 1, 1, 0};
  ex.comp_mask = IBV_QP_INIT_ATTR_PD;
  ex.pd = domain;
  ibv_qp* qp_ex = ibv_create_qp_ex(context_, &ex);
  ASSERT_NE(qp_ex, nullptr) << std::strerror(errno);

  ibv_ah_attr ah_attr{};
  ah_attr.port_num = 1;
  ah_attr.is_global = 1;
  ah_attr.grh.sgid_index = static_cast<uint8_t>(ipv4_gid_index(context_, &ah_attr.grh.dgid));
  ibv_ah* ah = ibv_create_ah(domain, &ah_attr);
  ASSERT_NE(ah, nullptr) << std::strerror(errno);

  // In use: neither the parent domain, nor its PD, nor its thread domain go.
  EXPECT_EQ(ibv_dealloc_pd(domain), EBUSY);
  EXPECT_EQ(ibv_dealloc_td(td), EBUSY);

  EXPECT_EQ(ibv_destroy_ah(ah), 0);
  EXPECT_EQ(ibv_destroy_qp(qp_ex), 0);
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
  pair.destroy();
  EXPECT_EQ(ibv_dealloc_pd(pd_), EBUSY) << "a parent domain still stands for it";
  EXPECT_EQ(ibv_dealloc_pd(domain), 0);
  EXPECT_EQ(ibv_dealloc_td(td), 0);
}

TEST_F(Domains, AllocatorGivesTheMemoryOfQpsCqsAndSrqs) {
  CountingAllocator allocator;
  ibv_pd* domain = parent_domain(nullptr, &allocator);
  ASSERT_NE(domain, nullptr) << std::strerror(errno);

  ibv_cq_init_attr_ex cq_attr{};
  cq_attr.cqe = 16;
  cq_attr.wc_flags = IBV_WC_STANDARD_FLAGS;
  cq_attr.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  cq_attr.parent_domain = domain;
  ibv_cq_ex* cq = ibv_create_cq_ex(context_, &cq_attr);
  ASSERT_NE(cq, nullptr) << std::strerror(errno);
  EXPECT_TRUE(allocator.gave(cq));
  ASSERT_EQ(allocator.given.size(), 1u);
  EXPECT_EQ(allocator.given[0].resource_type, 5u) << "mlx5dv's MLX5DV_RES_TYPE_CQ";

  ibv_srq_init_attr srq_init{};
  srq_init.attr = {16, 1, 0};
  ibv_srq* srq = ibv_create_srq(domain, &srq_init);
  ASSERT_NE(srq, nullptr) << std::strerror(errno);
  EXPECT_TRUE(allocator.gave(srq));
  EXPECT_EQ(allocator.given.back().resource_type, 4u);

  // Traffic through a QP and CQ that live in the application's memory.
  Pair pair;
  ASSERT_TRUE(pair.create(domain, domain, ibv_cq_ex_to_cq(cq), ibv_cq_ex_to_cq(cq)));
  EXPECT_TRUE(allocator.gave(pair.qp_a));
  EXPECT_TRUE(allocator.gave(pair.qp_b));
  EXPECT_EQ(allocator.given.back().resource_type, 1u);
  ASSERT_TRUE(pair.connect());
  ASSERT_TRUE(pair.write_and_send());

  EXPECT_EQ(ibv_dealloc_pd(domain), EBUSY);
  const size_t given = allocator.given.size();
  pair.destroy();
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
  EXPECT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)), 0);
  // Everything given back, each block once.
  ASSERT_EQ(allocator.freed.size(), given);
  for (const auto& block : allocator.given) {
    int times = 0;
    for (const auto& freed : allocator.freed) times += freed.pointer == block.pointer;
    EXPECT_EQ(times, 1);
  }
  EXPECT_EQ(ibv_dealloc_pd(domain), 0);
}

TEST_F(Domains, AllocatorMayLeaveTheMemoryToTheProvider) {
  CountingAllocator allocator;
  allocator.answer = IBV_ALLOCATOR_USE_DEFAULT;
  ibv_pd* domain = parent_domain(nullptr, &allocator);
  ASSERT_NE(domain, nullptr);
  Pair pair;
  ASSERT_TRUE(pair.create(domain, domain, cq_a_, cq_b_));
  ASSERT_TRUE(pair.connect());
  ASSERT_TRUE(pair.write_and_send());
  pair.destroy();
  EXPECT_TRUE(allocator.freed.empty()) << "nothing of the allocator's to give back";
  EXPECT_EQ(ibv_dealloc_pd(domain), 0);
}

TEST_F(Domains, AllocatorOutOfMemoryFailsTheCreation) {
  CountingAllocator allocator;
  allocator.refuse = true;
  ibv_pd* domain = parent_domain(nullptr, &allocator);
  ASSERT_NE(domain, nullptr);
  ibv_qp_init_attr init{};
  init.send_cq = cq_a_;
  init.recv_cq = cq_a_;
  init.qp_type = IBV_QPT_RC;
  init.cap = {4, 4, 1, 1, 0};
  errno = 0;
  EXPECT_EQ(ibv_create_qp(domain, &init), nullptr);
  EXPECT_EQ(errno, ENOMEM);
  ibv_srq_init_attr srq_init{};
  srq_init.attr = {16, 1, 0};
  errno = 0;
  EXPECT_EQ(ibv_create_srq(domain, &srq_init), nullptr);
  EXPECT_EQ(errno, ENOMEM);
  // Nothing of the failed creations holds the domain.
  EXPECT_EQ(ibv_dealloc_pd(domain), 0);
}

TEST_F(Domains, ParentDomainErrors) {
  ibv_parent_domain_init_attr attr{};
  errno = 0;
  EXPECT_EQ(ibv_alloc_parent_domain(context_, &attr), nullptr) << "no PD";
  EXPECT_EQ(errno, EINVAL);

  attr.pd = pd_;
  attr.comp_mask = 1u << 7;
  errno = 0;
  EXPECT_EQ(ibv_alloc_parent_domain(context_, &attr), nullptr) << "unknown comp_mask";
  EXPECT_EQ(errno, EINVAL);

  attr.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS;
  attr.alloc = CountingAllocator::alloc;
  errno = 0;
  EXPECT_EQ(ibv_alloc_parent_domain(context_, &attr), nullptr) << "an allocator without its free";
  EXPECT_EQ(errno, EINVAL);
  attr.comp_mask = 0;
  attr.alloc = nullptr;

  ibv_pd* domain = parent_domain();
  ASSERT_NE(domain, nullptr);
  attr.pd = domain;
  errno = 0;
  EXPECT_EQ(ibv_alloc_parent_domain(context_, &attr), nullptr) << "a parent domain of a parent domain";
  EXPECT_EQ(errno, EINVAL);

  // A TD or PD of another context.
  ibv_context* other = open_softverbs0();
  ASSERT_NE(other, nullptr);
  ibv_td_init_attr td_attr{};
  ibv_td* other_td = ibv_alloc_td(other, &td_attr);
  ibv_pd* other_pd = ibv_alloc_pd(other);
  ASSERT_TRUE(other_td && other_pd);
  attr.pd = pd_;
  attr.td = other_td;
  errno = 0;
  EXPECT_EQ(ibv_alloc_parent_domain(context_, &attr), nullptr) << "a TD of another context";
  EXPECT_EQ(errno, EINVAL);
  attr.pd = other_pd;
  attr.td = nullptr;
  errno = 0;
  EXPECT_EQ(ibv_alloc_parent_domain(context_, &attr), nullptr) << "a PD of another context";
  EXPECT_EQ(errno, EINVAL);

  // An extended CQ names a parent domain of its context, not a PD.
  ibv_cq_init_attr_ex cq_attr{};
  cq_attr.cqe = 4;
  cq_attr.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  cq_attr.parent_domain = pd_;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(context_, &cq_attr), nullptr) << "a PD that is no parent domain";
  EXPECT_EQ(errno, EINVAL);
  cq_attr.parent_domain = nullptr;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(context_, &cq_attr), nullptr) << "no parent domain";
  EXPECT_EQ(errno, EINVAL);

  EXPECT_EQ(ibv_dealloc_td(other_td), 0);
  EXPECT_EQ(ibv_dealloc_pd(other_pd), 0);
  EXPECT_EQ(ibv_close_device(other), 0);
  EXPECT_EQ(ibv_dealloc_pd(domain), 0);
}

// Sharing a context's objects with another (ibv_import_device, _pd, _mr)
// is not emulated: the answers are those of drivers without it.
TEST_F(Domains, ImportingIsNotSupported) {
  const int command_fd = dup(context_->cmd_fd);
  ASSERT_GE(command_fd, 0);
  errno = 0;
  EXPECT_EQ(ibv_import_device(command_fd), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP) << "the device is found by its command fd, and says it cannot import";
  close(command_fd);
  errno = 0;
  EXPECT_EQ(ibv_import_pd(context_, pd_->handle), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

}  // namespace
}  // namespace softverbs::test
