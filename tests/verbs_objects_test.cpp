// Unit tests of the verbs object model: the QP state machine's Modify QP
// rules, the MR key table's checks and the completion ring.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "device/completion_ring.h"
#include "device/memory_region_table.h"
#include "device/multicast_table.h"
#include "device/qp_state_machine.h"
#include "device/work_request.h"
#include "host/gid.h"

namespace softverbs {
namespace {

using namespace qp_attr;

constexpr uint32_t kRcInit = kState | kPkeyIndex | kPort | kAccessFlags;
constexpr uint32_t kUdInit = kState | kPkeyIndex | kPort | kQkey;
constexpr uint32_t kRcRtr = kState | kAddressVector | kPathMtu | kDestQpn | kRqPsn | kMaxDestRdAtomic | kMinRnrTimer;
constexpr uint32_t kUcRtr = kState | kAddressVector | kPathMtu | kDestQpn | kRqPsn;
constexpr uint32_t kRcRts = kState | kTimeout | kRetryCount | kRnrRetry | kSqPsn | kMaxQpRdAtomic;

TEST(QpStateMachine, TheConnectSequenceEachTypeNeeds) {
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Init, QpType::Rc, kRcInit), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, QpType::Rc, kRcRtr), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Rts, QpType::Rc, kRcRts), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Init, QpType::Uc, kRcInit), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, QpType::Uc, kUcRtr), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Rts, QpType::Uc, kState | kSqPsn), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Init, QpType::Ud, kUdInit), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, QpType::Ud, kState), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Rts, QpType::Ud, kState | kSqPsn), TransitionVerdict::Allowed);
}

TEST(QpStateMachine, MissingRequiredAttributes) {
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Init, QpType::Rc, kState | kPkeyIndex | kPort),
            TransitionVerdict::MissingRequiredAttribute);
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Init, QpType::Ud, kState | kPkeyIndex | kPort),
            TransitionVerdict::MissingRequiredAttribute)
      << "UD needs a qkey";
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, QpType::Rc, kUcRtr),
            TransitionVerdict::MissingRequiredAttribute)
      << "RC needs max_dest_rd_atomic and min_rnr_timer";
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Rts, QpType::Rc, kState | kSqPsn),
            TransitionVerdict::MissingRequiredAttribute);
}

TEST(QpStateMachine, AttributesOutsideTheTransition) {
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Init, QpType::Ud, kUdInit | kAccessFlags),
            TransitionVerdict::AttributeNotAllowed);
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Init, QpType::Rc, kRcInit | kQkey),
            TransitionVerdict::AttributeNotAllowed);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, QpType::Uc, kUcRtr | kMinRnrTimer),
            TransitionVerdict::AttributeNotAllowed)
      << "UC has no RNR";
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Rts, QpType::Rc, kRcRts | kMinRnrTimer | kAccessFlags),
            TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Rts, QpState::Rts, QpType::Rc, kState | kDestQpn),
            TransitionVerdict::AttributeNotAllowed);
}

// The kernel's uverbs drops these from an XRC QP's Modify QP before checking
// it; what is left is checked against the role's rules.
TEST(QpStateMachine, XrcRolesIgnoreTheAttributesOfTheHalfTheyLack) {
  EXPECT_EQ(ignored_attributes(XrcRole::Send), kMaxDestRdAtomic | kMinRnrTimer);
  EXPECT_EQ(ignored_attributes(XrcRole::Recv), kMaxQpRdAtomic | kRetryCount | kRnrRetry);
  EXPECT_EQ(ignored_attributes(XrcRole::None), 0u);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, XrcRole::Send, kUcRtr), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, XrcRole::Send, kRcRtr),
            TransitionVerdict::AttributeNotAllowed)
      << "left in the mask, they are not the role's";
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, XrcRole::Send, kRcRtr & ~ignored_attributes(XrcRole::Send)),
            TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Rts, XrcRole::Recv, kRcRts & ~ignored_attributes(XrcRole::Recv)),
            TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, XrcRole::Recv, kUcRtr),
            TransitionVerdict::MissingRequiredAttribute)
      << "XRC_RECV's responder needs its READ depth and RNR timer";
}

TEST(QpStateMachine, NoSuchTransitions) {
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Rtr, QpType::Rc, kRcRtr), TransitionVerdict::NoSuchTransition);
  EXPECT_EQ(check_transition(QpState::Reset, QpState::Rts, QpType::Rc, kRcRts), TransitionVerdict::NoSuchTransition);
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rts, QpType::Ud, kState | kSqPsn),
            TransitionVerdict::NoSuchTransition);
  EXPECT_EQ(check_transition(QpState::Error, QpState::Rts, QpType::Rc, kState), TransitionVerdict::NoSuchTransition);
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Init, QpType::Rc, kState), TransitionVerdict::NoSuchTransition);
}

TEST(QpStateMachine, ResetAndErrorFromEveryState) {
  for (QpState from :
       {QpState::Reset, QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe, QpState::Error}) {
    for (QpType type : {QpType::Rc, QpType::Uc, QpType::Ud}) {
      EXPECT_EQ(check_transition(from, QpState::Reset, type, kState), TransitionVerdict::Allowed)
          << qp_state_name(from);
      EXPECT_EQ(check_transition(from, QpState::Error, type, kState), TransitionVerdict::Allowed)
          << qp_state_name(from);
      EXPECT_EQ(check_transition(from, QpState::Error, type, kState | kQkey), TransitionVerdict::AttributeNotAllowed);
    }
  }
}

TEST(QpStateMachine, CurrentStateOnlyFromRtrOnward) {
  EXPECT_EQ(check_transition(QpState::Init, QpState::Rtr, QpType::Ud, kState | kCurrentState),
            TransitionVerdict::CurrentStateNotAllowed);
  EXPECT_EQ(check_transition(QpState::Rtr, QpState::Rts, QpType::Ud, kState | kSqPsn | kCurrentState),
            TransitionVerdict::Allowed);
}

TEST(QpStateMachine, DrainAndSendQueueError) {
  EXPECT_EQ(check_transition(QpState::Rts, QpState::Sqd, QpType::Rc, kState | kEnableSqdAsyncNotify),
            TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Sqd, QpState::Rts, QpType::Rc, kState), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Sqd, QpState::Sqd, QpType::Rc, kState | kTimeout | kRetryCount),
            TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Sqe, QpState::Rts, QpType::Ud, kState | kQkey), TransitionVerdict::Allowed);
  EXPECT_EQ(check_transition(QpState::Sqe, QpState::Rts, QpType::Uc, kState | kQkey),
            TransitionVerdict::AttributeNotAllowed);
}

TEST(QpStateMachine, PostingRules) {
  EXPECT_FALSE(can_post_send(QpState::Reset));
  EXPECT_FALSE(can_post_send(QpState::Init));
  EXPECT_FALSE(can_post_send(QpState::Rtr));
  EXPECT_TRUE(can_post_send(QpState::Rts));
  EXPECT_TRUE(can_post_send(QpState::Error)) << "accepted, completes with a flush error";
  EXPECT_FALSE(can_post_recv(QpState::Reset));
  EXPECT_TRUE(can_post_recv(QpState::Init));
  EXPECT_TRUE(can_post_recv(QpState::Rtr));
}

TEST(MemoryRegistration, RemoteWriteOrAtomicNeedsLocalWrite) {
  EXPECT_EQ(validate_registration_access(access::kRemoteWrite), EINVAL);
  EXPECT_EQ(validate_registration_access(access::kRemoteAtomic | access::kRemoteRead), EINVAL);
  EXPECT_EQ(validate_registration_access(access::kRemoteWrite | access::kLocalWrite), 0);
  EXPECT_EQ(validate_registration_access(access::kRemoteRead), 0);
  EXPECT_EQ(validate_registration_access(0), 0) << "local read is always allowed";
  EXPECT_EQ(validate_registration_access(access::kOnDemand | access::kRemoteWrite), EINVAL) << "ODP or not";
  EXPECT_EQ(validate_registration_access(access::kOnDemand | access::kRemoteRead), 0);
}

class MrTable : public ::testing::Test {
 protected:
  // 16 MiB of slots: on the heap.
  std::unique_ptr<MemoryRegionTable> table = std::make_unique<MemoryRegionTable>();
};

TEST_F(MrTable, KeysAreDistinctNonZeroAndNotReusedVerbatim) {
  auto a = table->register_region(1, 100, 0x10000, 0x10000, 4096, access::kLocalWrite);
  auto b = table->register_region(1, 100, 0x20000, 0x20000, 4096, access::kLocalWrite);
  ASSERT_TRUE(a && b);
  EXPECT_NE(*a, *b);
  EXPECT_NE(*a, 0u);
  ASSERT_TRUE(table->deregister(*a));
  EXPECT_FALSE(table->find(*a));
  EXPECT_FALSE(table->deregister(*a)) << "double deregistration is refused";
  // Reusing the slot changes the variant byte: the stale key stays invalid.
  std::vector<uint32_t> keys;
  for (int i = 0; i < 3; ++i) keys.push_back(*table->register_region(1, 100, 0x30000, 0x30000, 64, 0));
  for (uint32_t key : keys) EXPECT_NE(key, *a);
  EXPECT_EQ(table->check_local(*a, 1, 0x10000, 1, 0, nullptr), KeyCheck::InvalidKey);
  EXPECT_EQ(table->live_count(), 4u);
}

// A peer that has seen one key must not be able to guess another: each
// key carries 16 random bits (rxe: 8), drawn anew at every registration,
// also when a slot is reused.
TEST_F(MrTable, KeysCarryRandomBitsThatChangeAtEveryReuse) {
  std::set<uint32_t> tags, keys;
  uint32_t previous = 0;
  // A counter would make 199 steps of one; 16 random bits make one by
  // chance in under 1% of runs (CI saw it), five in ~10^-13.
  int sequential = 0;
  for (int i = 0; i < 200; ++i) {
    const uint32_t key = *table->register_region(1, 100, 0x10000, 0x10000, 64, 0);
    EXPECT_TRUE(keys.insert(key).second) << "a key repeated right after its slot was freed";
    tags.insert((key >> 24) << 8 | (key & 0xff));  // the index is bits 8-23
    if (key == previous + 1 || key == previous + 0x100 || key == previous + 0x1000000) ++sequential;
    previous = key;
    ASSERT_TRUE(table->deregister(key));
  }
  EXPECT_GT(tags.size(), 150u) << "200 registrations of one slot drew few distinct tags";
  EXPECT_LT(sequential, 5) << "keys of one slot step by one";
  std::set<uint32_t> first_keys;
  for (int i = 0; i < 8; ++i)
    first_keys.insert(*std::make_unique<MemoryRegionTable>()->register_region(1, 1, 0, 0, 1, 0));
  EXPECT_GT(first_keys.size(), 4u) << "fresh tables hand out the same first key";
}

TEST_F(MrTable, BoundsAreCheckedWithoutOverflow) {
  uint32_t key =
      *table->register_region(7, 42, 0x7f0000001000, 0x1000, 0x1000, access::kLocalWrite | access::kRemoteRead);
  ResolvedRange where;
  EXPECT_EQ(table->check_local(key, 7, 0x1000, 0x1000, access::kLocalWrite, &where), KeyCheck::Ok);
  EXPECT_EQ(where.address, 0x7f0000001000u);
  EXPECT_EQ(where.owner_pid, 42);
  EXPECT_EQ(table->check_local(key, 7, 0x1800, 0x800, 0, &where), KeyCheck::Ok);
  EXPECT_EQ(where.address, 0x7f0000001800u);
  EXPECT_EQ(table->check_local(key, 7, 0x1800, 0x801, 0, nullptr), KeyCheck::OutOfBounds);
  EXPECT_EQ(table->check_local(key, 7, 0xfff, 1, 0, nullptr), KeyCheck::OutOfBounds);
  EXPECT_EQ(table->check_local(key, 7, 0x2000, 0, 0, nullptr), KeyCheck::Ok) << "zero bytes at the end";
  EXPECT_EQ(table->check_local(key, 7, 0x2000, 1, 0, nullptr), KeyCheck::OutOfBounds);
  EXPECT_EQ(table->check_remote(key, 7, /*qpn=*/0, 0x1800, UINT64_MAX, access::kRemoteRead, nullptr),
            KeyCheck::OutOfBounds);
  EXPECT_EQ(table->check_remote(key, 7, /*qpn=*/0, UINT64_MAX, 2, access::kRemoteRead, nullptr), KeyCheck::OutOfBounds);
}

// An on-demand region's pages are resolved by the checks of its owner, with
// the access asked for; one that cannot be is a page fault, another
// process's pages are left to the copy that reaches them.
TEST_F(MrTable, OnDemandPagesAreResolvedAtTheCheck) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* area = mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(area, MAP_FAILED);
  const uint64_t base = reinterpret_cast<uint64_t>(area);
  const uint32_t all = access::kLocalWrite | access::kRemoteWrite | access::kRemoteRead | access::kOnDemand;
  const uint32_t mine = *table->register_region(1, getpid(), base, base, 3 * page, all);
  const uint32_t peers = *table->register_region(1, getpid() + 1, base, base, 3 * page, all);
  // The hole is made after the registrations, which may map memory of
  // their own (on Debian 13 a new anonymous page landed in it).
  ASSERT_EQ(munmap(reinterpret_cast<void*>(base + page), page), 0);
  ASSERT_EQ(mprotect(reinterpret_cast<void*>(base + 2 * page), page, PROT_READ), 0);
  EXPECT_EQ(table->check_local(mine, 1, base, 8, access::kLocalWrite, nullptr), KeyCheck::Ok);
  EXPECT_EQ(table->check_local(mine, 1, base + page, 8, 0, nullptr), KeyCheck::PageFault) << "not mapped";
  EXPECT_EQ(table->check_local(mine, 1, base + page - 4, 8, 0, nullptr), KeyCheck::PageFault) << "running into it";
  EXPECT_EQ(table->check_remote(mine, 1, 0, base + 2 * page, 8, access::kRemoteRead, nullptr), KeyCheck::Ok);
  EXPECT_EQ(table->check_remote(mine, 1, 0, base + 2 * page, 8, access::kRemoteWrite, nullptr), KeyCheck::PageFault)
      << "read-only";
  EXPECT_EQ(table->check_local(mine, 1, base + page, 0, 0, nullptr), KeyCheck::Ok) << "no bytes, no page";
  EXPECT_EQ(table->check_remote(peers, 1, 0, base + page, 8, access::kRemoteWrite, nullptr), KeyCheck::Ok)
      << "another process's pages are its kernel's to resolve";
  munmap(area, 3 * page);
}

TEST_F(MrTable, AccessRightsAndProtectionDomains) {
  uint32_t read_only = *table->register_region(1, 1, 0x1000, 0x1000, 0x1000, access::kRemoteRead);
  EXPECT_EQ(table->check_local(read_only, 1, 0x1000, 8, 0, nullptr), KeyCheck::Ok) << "local read always";
  EXPECT_EQ(table->check_local(read_only, 1, 0x1000, 8, access::kLocalWrite, nullptr), KeyCheck::AccessDenied);
  EXPECT_EQ(table->check_remote(read_only, 1, /*qpn=*/0, 0x1000, 8, access::kRemoteRead, nullptr), KeyCheck::Ok);
  EXPECT_EQ(table->check_remote(read_only, 1, /*qpn=*/0, 0x1000, 8, access::kRemoteWrite, nullptr),
            KeyCheck::AccessDenied);
  EXPECT_EQ(table->check_remote(read_only, 1, /*qpn=*/0, 0x1000, 8, access::kRemoteAtomic, nullptr),
            KeyCheck::AccessDenied);
  EXPECT_EQ(table->check_remote(read_only, 2, /*qpn=*/0, 0x1000, 8, access::kRemoteRead, nullptr), KeyCheck::WrongPd);
  EXPECT_EQ(table->check_remote(read_only ^ 0x100, 1, /*qpn=*/0, 0x1000, 8, access::kRemoteRead, nullptr),
            KeyCheck::InvalidKey);
  EXPECT_EQ(table->check_remote(0, 1, /*qpn=*/0, 0x1000, 8, access::kRemoteRead, nullptr), KeyCheck::InvalidKey);
}

TEST_F(MrTable, ZeroBasedIovaMapsOntoTheRegisteredAddress) {
  uint32_t key = *table->register_region(1, 9, 0x555500000000, 0, 4096, access::kLocalWrite | access::kRemoteWrite);
  ResolvedRange where;
  ASSERT_EQ(table->check_remote(key, 1, /*qpn=*/0, 100, 8, access::kRemoteWrite, &where), KeyCheck::Ok);
  EXPECT_EQ(where.address, 0x555500000000u + 100);
}

TEST_F(MrTable, FullTableRefusesRegistration) {
  for (uint32_t i = 0; i < MemoryRegionTable::kCapacity; ++i)
    ASSERT_TRUE(table->register_region(1, 1, 0x1000, 0x1000, 1, 0)) << i;
  EXPECT_FALSE(table->register_region(1, 1, 0x1000, 0x1000, 1, 0));
}

// The table counts each owner's live keys: a dead process that owns none is
// released without a walk over all 65,536 slots.
TEST_F(MrTable, CountsEachOwnersLiveRegionsAndWindows) {
  const auto mine = [&](int32_t owner) {
    return table->register_region(1, 100, 0x10000, 0x10000, 4096, access::kLocalWrite | access::kMwBind, {}, owner);
  };
  auto a = mine(5), b = mine(5), c = mine(7), unowned = mine(-1);
  auto window = table->allocate_window(1, 100, 5, 1);
  ASSERT_TRUE(a && b && c && unowned && window);
  EXPECT_EQ(table->owned_by(5), 3u);
  EXPECT_EQ(table->owned_by(7), 1u);
  EXPECT_EQ(table->owned_by(-1), 0u) << "no record, nothing counted";
  EXPECT_EQ(table->owned_by(MemoryRegionTable::kOwnerCapacity), 0u);
  MemoryRegion changed = *table->find(*a);
  changed.length = 8192;
  ASSERT_TRUE(table->reregister(*a, changed));
  EXPECT_EQ(table->owned_by(5), 3u) << "a re-registration is the same region";
  WindowBind bind{*window, 0x11, *b, access::kRemoteRead, 0x10000, 64, true};
  ASSERT_TRUE(table->bind_window(bind, 1, 0));
  EXPECT_EQ(table->owned_by(5), 3u) << "binding changes neither owner";
  ASSERT_TRUE(table->deregister(*a));
  EXPECT_FALSE(table->deregister(*a));
  EXPECT_EQ(table->owned_by(5), 2u) << "a refused deregistration counts nothing";
  ASSERT_TRUE(table->deallocate_window(*window));
  EXPECT_EQ(table->owned_by(5), 1u);
  EXPECT_EQ(table->deregister_owned_if([](int32_t owner) { return owner == 5; }), 1u);
  EXPECT_EQ(table->owned_by(5), 0u);
  EXPECT_EQ(table->owned_by(7), 1u);
  EXPECT_EQ(table->live_count(), 2u);
}

TEST_F(MrTable, UnlockedChecksGiveTheLockedChecksAnswers) {
  uint32_t key =
      *table->register_region(3, 11, 0x7f0000000000, 0x4000, 0x2000, access::kLocalWrite | access::kRemoteWrite);
  uint32_t gone = *table->register_region(3, 11, 0x7f0000100000, 0, 64, access::kLocalWrite);
  ASSERT_TRUE(table->deregister(gone));
  struct Case {
    uint32_t key, pd;
    uint64_t iova, length;
    uint32_t access;
  };
  const Case cases[] = {{key, 3, 0x4000, 0x2000, access::kRemoteWrite}, {key, 3, 0x5fff, 2, access::kRemoteWrite},
                        {key, 3, 0x3fff, 1, access::kRemoteWrite},      {key, 4, 0x4000, 8, access::kRemoteWrite},
                        {key, 3, 0x4000, 8, access::kRemoteRead},       {gone, 3, 0, 8, access::kLocalWrite},
                        {key ^ 1, 3, 0x4000, 8, access::kRemoteWrite},  {0xffffff00, 3, 0, 8, 0}};
  for (const Case& c : cases) {
    ResolvedRange locked{}, unlocked{};
    EXPECT_EQ(table->check_remote(c.key, c.pd, /*qpn=*/0, c.iova, c.length, c.access, &unlocked,
                                  MemoryRegionTable::Lock::NotHeld),
              table->check_remote(c.key, c.pd, /*qpn=*/0, c.iova, c.length, c.access, &locked));
    EXPECT_EQ(unlocked.address, locked.address);
    EXPECT_EQ(unlocked.owner_pid, locked.owner_pid);
    EXPECT_EQ(table->check_local(c.key, c.pd, c.iova, c.length, c.access, nullptr, MemoryRegionTable::Lock::NotHeld),
              table->check_local(c.key, c.pd, c.iova, c.length, c.access, nullptr));
  }
}

// A reader without the lock, while a writer switches a key between two
// regions that differ in every field it checks, sees one region or the
// other, whole: never region A's PD with region B's bounds, nor A's
// bounds resolved into B's pages.
TEST_F(MrTable, UnlockedChecksNeverSeeHalfAChange) {
  const MemoryRegion a{0, 1, access::kLocalWrite | access::kRemoteWrite, 10, -1, 0, 0xa0000000, 0x1000, 0x1000, {}};
  const MemoryRegion b{0, 2, access::kRemoteRead, 20, -1, 0, 0xb0000000, 0x100000000, 0x10, {}};
  const uint32_t key = *table->register_region(a.pd_handle, a.owner_pid, a.address, a.iova, a.length, a.access);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> saw_a{0}, saw_b{0}, torn{0};
  std::thread reader([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      ResolvedRange where{};
      KeyCheck verdict = table->check_remote(key, 1, /*qpn=*/0, 0x1800, 8, access::kRemoteWrite, &where,
                                             MemoryRegionTable::Lock::NotHeld);
      if (verdict == KeyCheck::Ok && where.address == 0xa0000800 && where.owner_pid == 10)
        saw_a.fetch_add(1, std::memory_order_relaxed);
      else if (verdict == KeyCheck::WrongPd)
        saw_b.fetch_add(1, std::memory_order_relaxed);
      else
        torn.fetch_add(1, std::memory_order_relaxed);
    }
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  for (uint64_t i = 0; std::chrono::steady_clock::now() < until || saw_a == 0 || saw_b == 0; ++i)
    ASSERT_TRUE(table->reregister(key, i % 2 ? a : b));
  stop = true;
  reader.join();
  EXPECT_EQ(torn.load(), 0u) << "of " << saw_a + saw_b + torn << " checks";
  EXPECT_GT(saw_a.load(), 0u);
  EXPECT_GT(saw_b.load(), 0u);
}

// A ring over storage of its own, `slots` entries long.
struct TestRing {
  explicit TestRing(size_t slots) : storage(slots) { CompletionRing::initialize(header, storage); }
  CompletionRingHeader header;
  std::vector<CompletionSlot> storage;
  CompletionRing ring{header, storage};
};

// Pushes entries wr_id first..first+count-1, alternately of QP 0 and QP 1.
void push_alternating(CompletionRing& ring, uint64_t first, uint64_t count) {
  for (uint64_t i = first; i < first + count; ++i) {
    Completion c;
    c.wr_id = i;
    c.qp_num = static_cast<uint32_t>(i % 2);
    ASSERT_TRUE(ring.push(c)) << "entry " << i;
  }
}

TEST(CompletionRing, FifoOrderAndWrapAround) {
  TestRing test_ring(4);
  CompletionRing& ring = test_ring.ring;
  std::vector<Completion> out(3);
  uint64_t next_expected = 0;
  for (uint64_t round = 0; round < 5; ++round) {
    for (uint64_t i = 0; i < 3; ++i) {
      Completion c;
      c.wr_id = round * 3 + i;
      ASSERT_TRUE(ring.push(c));
    }
    ASSERT_EQ(ring.pop(out), 3u);
    for (const auto& c : out) EXPECT_EQ(c.wr_id, next_expected++);
  }
  EXPECT_EQ(ring.size(), 0u);
  EXPECT_FALSE(ring.overflowed());
}

TEST(CompletionRing, OverflowIsReportedNeverOverwritten) {
  TestRing test_ring(2);
  CompletionRing& ring = test_ring.ring;
  Completion c;
  c.wr_id = 1;
  ASSERT_TRUE(ring.push(c));
  c.wr_id = 2;
  ASSERT_TRUE(ring.push(c));
  c.wr_id = 3;
  EXPECT_FALSE(ring.push(c));
  EXPECT_TRUE(ring.overflowed());
  std::vector<Completion> out(4);
  ASSERT_EQ(ring.pop(out), 2u);
  EXPECT_EQ(out[0].wr_id, 1u);
  EXPECT_EQ(out[1].wr_id, 2u);
}

TEST(CompletionRing, RemoveIfKeepsTheOthersInOrder) {
  TestRing test_ring(4);
  CompletionRing& ring = test_ring.ring;
  push_alternating(ring, 0, 4);
  std::vector<Completion> two(2);  // the next two wrap
  ASSERT_EQ(ring.pop(two), 2u);
  push_alternating(ring, 4, 2);
  EXPECT_EQ(ring.remove_if([](const Completion& e) { return e.qp_num == 1; }), 2u);
  std::vector<Completion> out(4);
  ASSERT_EQ(ring.pop(out), 2u);
  EXPECT_EQ(out[0].wr_id, 2u);
  EXPECT_EQ(out[1].wr_id, 4u);
}

TEST(CompletionRing, PushesAfterARemovalFollowTheKeptEntries) {
  TestRing test_ring(4);
  CompletionRing& ring = test_ring.ring;
  push_alternating(ring, 0, 4);
  EXPECT_EQ(ring.remove_if([](const Completion& e) { return e.qp_num == 1; }), 2u);
  Completion c;
  c.wr_id = 10;
  ASSERT_TRUE(ring.push(c));
  std::vector<Completion> out(8);
  ASSERT_EQ(ring.pop(out), 3u) << "the removed entries' slots must not be read as new ones";
  EXPECT_EQ(out[0].wr_id, 0u);
  EXPECT_EQ(out[1].wr_id, 2u);
  EXPECT_EQ(out[2].wr_id, 10u);
}

// The consumer pops without the producers' lock, as a poll in one process
// does while producers in others push: every entry arrives once, in order,
// whole, through many laps of a small ring.
TEST(CompletionRing, ConsumerWithoutTheProducersLockSeesEveryEntryWhole) {
  TestRing test_ring(8);
  CompletionRingHeader& header = test_ring.header;
  constexpr uint64_t kEntries = 200000;
  std::atomic<uint64_t> full_retries{0};
  std::thread producer([&] {
    CompletionRing ring(header, test_ring.storage);
    for (uint64_t i = 0; i < kEntries; ++i) {
      Completion c;
      c.wr_id = i;
      c.byte_len = static_cast<uint32_t>(i * 7);
      c.imm_data = static_cast<uint32_t>(~i);
      c.qp_num = static_cast<uint32_t>(i >> 3);
      while (!ring.push(c)) {  // full: the consumer has not caught up
        header.producer.overflowed = false;
        full_retries.fetch_add(1, std::memory_order_relaxed);
        std::this_thread::yield();
      }
    }
  });
  CompletionRing& ring = test_ring.ring;
  uint64_t next = 0, torn = 0, out_of_order = 0;
  std::vector<Completion> out(5);
  while (next < kEntries) {
    size_t got = ring.pop(out);
    for (size_t i = 0; i < got; ++i, ++next) {
      const Completion& c = out[i];
      if (c.wr_id != next) ++out_of_order;
      if (c.byte_len != static_cast<uint32_t>(c.wr_id * 7) || c.imm_data != static_cast<uint32_t>(~c.wr_id) ||
          c.qp_num != static_cast<uint32_t>(c.wr_id >> 3))
        ++torn;
    }
  }
  producer.join();
  EXPECT_EQ(out_of_order, 0u);
  EXPECT_EQ(torn, 0u);
  EXPECT_EQ(ring.pop(out), 0u) << "nothing beyond what was pushed";
  EXPECT_GT(full_retries.load(), 0u) << "the ring never filled: the test did not exercise laps under contention";
}

// The send opcodes as one table: who may post them, what they complete as.
TEST(SendOpcodeTable, SaysWhichQpTypesPostEachOpcodeAndWhatItCompletesAs) {
  const SendOpcodeInfo& read = send_opcode_info(SendOpcode::RdmaRead);
  EXPECT_TRUE(read.valid_for(QpType::Rc));
  EXPECT_FALSE(read.valid_for(QpType::Uc));
  EXPECT_FALSE(read.valid_for(QpType::Ud));
  EXPECT_TRUE(read.is(wr_mask::kIntoLocal) && read.expects_response());
  EXPECT_EQ(read.completion, WcOpcode::RdmaRead);
  const SendOpcodeInfo& write_imm = send_opcode_info(SendOpcode::RdmaWriteWithImm);
  EXPECT_TRUE(write_imm.valid_for(QpType::Uc));
  EXPECT_FALSE(write_imm.valid_for(QpType::Ud));
  EXPECT_TRUE(write_imm.is(wr_mask::kImmediate) && write_imm.is(wr_mask::kRemoteRange));
  EXPECT_FALSE(write_imm.expects_response());
  EXPECT_EQ(write_imm.completion, WcOpcode::RdmaWrite);
  for (SendOpcode send : {SendOpcode::Send, SendOpcode::SendWithImm})
    for (QpType type : {QpType::Rc, QpType::Uc, QpType::Ud}) EXPECT_TRUE(send_opcode_info(send).valid_for(type));
  EXPECT_EQ(completion_opcode(SendOpcode::AtomicCompareSwap), WcOpcode::CompareSwap);
  EXPECT_EQ(completion_opcode(SendOpcode::AtomicFetchAdd), WcOpcode::FetchAdd);
  // Memory windows: bind and local invalidation on RC and UC (as rxe), remote invalidation on RC only.
  EXPECT_EQ(completion_opcode(SendOpcode::LocalInvalidate), WcOpcode::LocalInvalidate);
  EXPECT_EQ(completion_opcode(SendOpcode::BindMemoryWindow), WcOpcode::BindMw);
  EXPECT_EQ(completion_opcode(SendOpcode::SendWithInvalidate), WcOpcode::Send);
  EXPECT_TRUE(send_opcode_info(SendOpcode::SendWithInvalidate).valid_for(QpType::Rc));
  EXPECT_FALSE(send_opcode_info(SendOpcode::SendWithInvalidate).valid_for(QpType::Ud));
  EXPECT_FALSE(send_opcode_info(SendOpcode::LocalInvalidate).valid_for(QpType::Ud));
  EXPECT_EQ(completion_opcode(SendOpcode::AtomicWrite), WcOpcode::AtomicWrite);
  EXPECT_TRUE(send_opcode_info(SendOpcode::AtomicWrite).valid_for(QpType::Rc));
  EXPECT_FALSE(send_opcode_info(SendOpcode::AtomicWrite).valid_for(QpType::Uc));
  EXPECT_TRUE(send_opcode_info(SendOpcode::AtomicWrite).expects_response());
  // IBV_WR_TSO (10), IBV_WR_DRIVER1 (11), FLUSH (14 from rdma-core 47): not taken.
  for (uint32_t unknown : {10u, 11u, 14u, 99u}) {
    EXPECT_EQ(send_opcode_info(unknown).name, nullptr);
    EXPECT_FALSE(send_opcode_info(unknown).valid_for(QpType::Rc));
  }
}

TEST(MulticastTable, AttachDetachAndLimits) {
  auto table = std::make_unique<MulticastTable>();
  MulticastTable::Gid group{};
  group[0] = 0xff;
  group[15] = 1;
  MulticastTable::Gid unicast{};
  unicast[0] = 0xfe;
  EXPECT_EQ(table->attach(unicast, 0x11), EINVAL) << "only multicast GIDs";
  // RoCE v2's IPv4 groups: ::ffff:224.0.0.0/4 is a group, ::ffff:10.0.0.1 is not.
  MulticastTable::Gid ipv4_group = Gid::from_ipv4(std::array<uint8_t, 4>{239, 1, 2, 3}).raw;
  MulticastTable::Gid ipv4_host = Gid::from_ipv4(std::array<uint8_t, 4>{10, 0, 0, 1}).raw;
  EXPECT_EQ(table->attach(ipv4_host, 0x11), EINVAL);
  EXPECT_EQ(table->attach(ipv4_group, 0x11), 0);
  EXPECT_EQ(table->members(ipv4_group), std::vector<uint32_t>{0x11});
  table->detach_everywhere(0x11);
  EXPECT_EQ(table->attach(group, 0x11), 0);
  EXPECT_EQ(table->attach(group, 0x11), 0) << "attaching twice is harmless";
  EXPECT_EQ(table->attach(group, 0x12), 0);
  EXPECT_EQ(table->members(group), (std::vector<uint32_t>{0x11, 0x12}));
  EXPECT_EQ(table->detach(group, 0x13), EINVAL);
  EXPECT_EQ(table->detach(group, 0x11), 0);
  EXPECT_EQ(table->members(group), std::vector<uint32_t>{0x12});
  table->detach_everywhere(0x12);
  EXPECT_TRUE(table->members(group).empty());
  for (uint32_t qpn = 0; qpn < limits::kMaxMcastQpAttach; ++qpn) ASSERT_EQ(table->attach(group, 0x100 + qpn), 0);
  EXPECT_EQ(table->attach(group, 0x999), ENOMEM) << "max_mcast_qp_attach";
}

}  // namespace
}  // namespace softverbs
