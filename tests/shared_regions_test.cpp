// Registered memory made mappable by peers (emulator/shared_regions): which
// memory qualifies, that the application's bytes and pointers survive the
// move into the memfd, and that another process maps exactly the owner's
// pages (and only through a descriptor the MR table names).
#include "shm/shared_regions.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/shm.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>

#include "process_runner.h"

namespace softverbs {
namespace {

const uint64_t kPage = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));

struct Pages {
  explicit Pages(size_t count) : length(count * kPage) {
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    base = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~Pages() {
    if (base) munmap(base, length);
  }
  uint64_t address() const { return reinterpret_cast<uint64_t>(base); }
  uint8_t* base = nullptr;
  size_t length;
};

// The /proc/self/maps line of the mapping that holds `address` ("" if none).
std::string mapping_of(const void* address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  auto wanted = reinterpret_cast<uint64_t>(address);
  while (std::getline(maps, line)) {
    uint64_t low = std::stoull(line.substr(0, line.find('-')), nullptr, 16);
    uint64_t high = std::stoull(line.substr(line.find('-') + 1), nullptr, 16);
    if (wanted >= low && wanted < high) return line;
  }
  return "";
}

bool is_memfd_mapping(const void* address) {
  return mapping_of(address).find("memfd:softverbs-mr") != std::string::npos;
}

std::string permissions_of(const void* address) {
  std::string line = mapping_of(address);
  return line.empty() ? "" : line.substr(line.find(' ') + 1, 4);
}

TEST(SharedRegions, WholeAnonymousPagesMoveInPlaceWithTheirBytes) {
  Pages pages(4);
  ASSERT_NE(pages.base, nullptr);
  for (size_t i = 0; i < pages.length; ++i) pages.base[i] = static_cast<uint8_t>(i * 13);
  auto backing = share_pages(pages.address(), pages.length);
  ASSERT_TRUE(backing);
  EXPECT_GE(backing->fd, 0);
  EXPECT_EQ(backing->base, pages.address());
  EXPECT_EQ(backing->length, pages.length);
  EXPECT_TRUE(is_memfd_mapping(pages.base)) << "the pages are the memfd's now";
  for (size_t i = 0; i < pages.length; ++i) ASSERT_EQ(pages.base[i], static_cast<uint8_t>(i * 13)) << i;
  pages.base[5] = 0xee;  // still ordinary, writable memory for the application
  EXPECT_EQ(pages.base[5], 0xee);
  // A second registration inside the same pages shares the same backing.
  auto inner = share_pages(pages.address() + kPage, kPage);
  ASSERT_TRUE(inner);
  EXPECT_EQ(inner->id, backing->id);
  release_pages(*inner);
  EXPECT_EQ(fcntl(backing->fd, F_GETFD), FD_CLOEXEC) << "one hold left: the descriptor stays open";
  release_pages(*backing);
  EXPECT_EQ(fcntl(backing->fd, F_GETFD), -1) << "the last hold closes it";
  EXPECT_EQ(permissions_of(pages.base), "rw-p") << "private pages again";
  EXPECT_EQ(pages.base[5], 0xee) << "the bytes stay where they were";
  for (size_t i = 6; i < pages.length; ++i) ASSERT_EQ(pages.base[i], static_cast<uint8_t>(i * 13)) << i;
}

// Pages never written are not copied (they read as zero, as the memfd's
// do); the written ones keep their bytes, including runs that cross the
// 4,096 pages of one pagemap read, and a peer sees the same.
TEST(SharedRegions, PagesNeverWrittenReadAsZeroAndWrittenOnesKeepTheirBytes) {
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // as the provider does
  constexpr size_t kCount = 4100;
  Pages pages(kCount);
  ASSERT_NE(pages.base, nullptr);
  // Runs of one page, a run across the two reads, one that starts in the second.
  auto written = [](size_t page) {
    return (page % 3 == 0 && page < 4090) || (page >= 4090 && page <= 4097) || page == kCount - 1;
  };
  auto expected = [&](size_t offset) -> uint8_t {
    const size_t page = offset / kPage;
    return written(page) ? static_cast<uint8_t>(page * 7 + offset % 251 + 1) : 0;
  };
  volatile uint8_t sink = 0;
  for (size_t page = 0; page < kCount; ++page) {
    uint8_t* at = pages.base + page * kPage;
    if (written(page))
      for (size_t i = 0; i < kPage; ++i) at[i] = expected(page * kPage + i);
    else if (page % 3 == 1)
      sink = sink + at[0];  // read only: the shared zero page
  }
  auto backing = share_pages(pages.address(), pages.length);
  ASSERT_TRUE(backing);
  EXPECT_TRUE(is_memfd_mapping(pages.base));
  for (size_t i = 0; i < pages.length; ++i) ASSERT_EQ(pages.base[i], expected(i)) << "byte " << i;
  const pid_t owner = getpid();
  pid_t child = fork();
  if (child == 0) {
    const uint8_t* view = peer_view(owner, *backing, pages.address(), pages.length);
    if (view == nullptr) _exit(1);
    for (size_t i = 0; i < pages.length; ++i)
      if (view[i] != expected(i)) _exit(2);
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: no view; 2: the peer saw other bytes";
  release_pages(*backing);
}

TEST(SharedRegions, ReleasingPagesTheApplicationRemappedLeavesItsMappingAlone) {
  Pages pages(2);
  auto backing = share_pages(pages.address(), pages.length);
  ASSERT_TRUE(backing);
  // The application put a new mapping there before deregistering.
  void* fresh = mmap(pages.base, pages.length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  ASSERT_EQ(fresh, static_cast<void*>(pages.base));
  pages.base[0] = 0x31;
  release_pages(*backing);
  EXPECT_EQ(pages.base[0], 0x31) << "its bytes, not the old region's";
  EXPECT_EQ(fcntl(backing->fd, F_GETFD), -1) << "the descriptor still closes";
  // Unmapped before the release: nothing to restore, and nothing touched.
  auto second = share_pages(pages.address(), pages.length);
  ASSERT_TRUE(second);
  ASSERT_EQ(munmap(pages.base, pages.length), 0);
  release_pages(*second);  // would fault if it copied from the hole
  pages.base = nullptr;
}

TEST(SharedRegions, ForkingAfterTheApplicationUnmappedRegisteredPagesHarmsNothing) {
  Pages pages(2);
  auto backing = share_pages(pages.address(), pages.length);
  ASSERT_TRUE(backing);
  // Unmapped while still registered (an HCA keeps such pages pinned): the
  // fork handler must not copy from the hole.
  ASSERT_EQ(munmap(pages.base, pages.length), 0);
  pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  // Made inaccessible instead: the same.
  Pages other(1);
  auto second = share_pages(other.address(), other.length);
  ASSERT_TRUE(second);
  ASSERT_EQ(mprotect(other.base, other.length, PROT_NONE), 0);
  child = fork();
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  release_pages(*second);
  release_pages(*backing);
  pages.base = nullptr;
}

TEST(SharedRegions, MemoryThatMustNotMoveIsRefused) {
  const char* why = nullptr;
  Pages pages(2);
  // Not whole pages: the rest of the page may belong to other data.
  EXPECT_FALSE(share_pages(pages.address() + 64, kPage, &why));
  EXPECT_NE(std::string(why).find("whole pages"), std::string::npos);
  EXPECT_FALSE(share_pages(pages.address(), kPage + 8));
  // Read-only memory.
  mprotect(pages.base, pages.length, PROT_READ);
  EXPECT_FALSE(share_pages(pages.address(), pages.length, &why));
  EXPECT_NE(std::string(why).find("private anonymous"), std::string::npos);
  mprotect(pages.base, pages.length, PROT_READ | PROT_WRITE);
  // A file mapping: its pages belong to the file.
  test::TemporaryDirectory dir;
  std::string path = dir.path() + "/file";
  int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(kPage)), 0);
  void* file = mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(file, MAP_FAILED);
  EXPECT_FALSE(share_pages(reinterpret_cast<uint64_t>(file), kPage));
  munmap(file, kPage);
  close(fd);
  // Memory that is not mapped at all.
  Pages gone(1);
  uint64_t address = gone.address();
  munmap(gone.base, gone.length);
  gone.base = nullptr;
  EXPECT_FALSE(share_pages(address, kPage));
}

TEST(SharedRegions, APeerMapsExactlyTheOwnersPages) {
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // as the provider does
  Pages pages(2);
  std::memset(pages.base, 0x11, pages.length);
  auto backing = share_pages(pages.address(), pages.length);
  ASSERT_TRUE(backing);
  const pid_t owner = getpid();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  if (child == 0) {
    // The peer writes through its own mapping of the owner's memfd.
    uint8_t* view = peer_view(owner, *backing, pages.address() + 100, 50);
    if (view == nullptr) _exit(1);
    std::memset(view, 0x22, 50);
    // Ranges outside the backing get no view.
    if (peer_view(owner, *backing, pages.address() + pages.length - 10, 11) != nullptr) _exit(2);
    if (peer_view(owner, *backing, pages.address() - 1, 1) != nullptr) _exit(3);
    // A descriptor that is not this backing is refused (a reused number).
    SharedBacking wrong = *backing;
    wrong.id ^= 1;
    if (peer_view(owner, wrong, pages.address(), 1) != nullptr) _exit(4);
    if (peer_view_count() != 1) _exit(5);
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  for (size_t i = 0; i < pages.length; ++i)
    ASSERT_EQ(pages.base[i], (i >= 100 && i < 150) ? 0x22 : 0x11) << "byte " << i;
  release_pages(*backing);
  close(ready[0]);
  close(ready[1]);
}

// A System V segment (UCX's buffers where huge pages are reserved) is
// shared as it is: nothing moves, and a peer attaches the segment, even once
// its creator has marked it for removal as UCX does. With 2 MiB pages too
// where some are reserved.
TEST(SharedRegions, ASystemVSegmentIsSharedAsItIsAndPeersAttachIt) {
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  for (const bool huge : {false, true}) {
    const size_t length = huge ? size_t{4} << 20 : 4 * kPage;
    const int id = shmget(IPC_PRIVATE, length, IPC_CREAT | 0600 | (huge ? SHM_HUGETLB : 0));
    if (id < 0 && huge) {
      std::cout << "no 2 MiB pages reserved: the huge-page segment is not tried\n";
      continue;
    }
    ASSERT_GE(id, 0) << std::strerror(errno);
    auto* base = static_cast<uint8_t*>(shmat(id, nullptr, 0));
    ASSERT_NE(base, reinterpret_cast<uint8_t*>(-1));
    shmctl(id, IPC_RMID, nullptr);
    std::memset(base, 0x11, length);
    const std::string before = mapping_of(base);
    const uint64_t address = reinterpret_cast<uint64_t>(base);
    auto backing = share_pages(address + kPage, 2 * kPage);
    ASSERT_TRUE(backing) << huge;
    EXPECT_EQ(backing->sysv_shm_id, id);
    EXPECT_EQ(backing->fd, -1);
    EXPECT_EQ(backing->base, address);
    EXPECT_EQ(backing->length, length);
    EXPECT_EQ(mapping_of(base), before) << "the application's mapping stays as it was";
    // Past the segment's end: not one segment, and not anonymous memory either.
    EXPECT_FALSE(share_pages(address, length + kPage));
    const pid_t owner = getpid();
    pid_t child = fork();
    if (child == 0) {
      shmdt(base);  // the peer's view is an attachment of its own
      uint8_t* view = peer_view(owner, *backing, address + kPage + 100, 50);
      if (view == nullptr) _exit(1);
      std::memset(view, 0x22, 50);
      if (peer_view(owner, *backing, address + length - 10, 11) != nullptr) _exit(2);
      SharedBacking gone = *backing;
      gone.id ^= 1;
      gone.sysv_shm_id = INT32_MAX;  // no such segment
      if (peer_view(owner, gone, address, 1) != nullptr) _exit(3);
      _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << huge;
    for (size_t i = 0; i < length; ++i)
      ASSERT_EQ(base[i], (i >= kPage + 100 && i < kPage + 150) ? 0x22 : 0x11) << "byte " << i << " huge " << huge;
    release_pages(*backing);
    EXPECT_EQ(mapping_of(base), before);
    shmdt(base);
  }
}

TEST(SharedRegions, ForkedChildrenGetTheirOwnCopyOfRegisteredPages) {
  Pages pages(2);
  for (size_t i = 0; i < pages.length; ++i) pages.base[i] = static_cast<uint8_t>(i * 7);
  auto backing = share_pages(pages.address(), pages.length);
  ASSERT_TRUE(backing);
  pid_t child = fork();
  if (child == 0) {
    // As with an HCA on a kernel that copies pinned pages at fork: the
    // child's own private copy, not the memfd the parent shares with peers.
    if (is_memfd_mapping(pages.base) || permissions_of(pages.base) != "rw-p") _exit(1);
    for (size_t i = 0; i < pages.length; ++i)
      if (pages.base[i] != static_cast<uint8_t>(i * 7)) _exit(2);
    std::memset(pages.base, 0x99, pages.length);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_TRUE(is_memfd_mapping(pages.base)) << "still shared in the parent";
  for (size_t i = 0; i < pages.length; ++i) ASSERT_EQ(pages.base[i], static_cast<uint8_t>(i * 7)) << i;
  release_pages(*backing);
  // Released, the page is ordinary memory that a child inherits (and reads).
  pages.base[0] = 0x42;
  child = fork();
  if (child == 0) _exit(pages.base[0] == 0x42 ? 0 : 1);
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

}  // namespace
}  // namespace softverbs
