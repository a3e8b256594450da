// The copy agent: the fallback that moves bytes into and out of a process
// when the kernel refuses process_vm_*. It must copy exactly the registered
// bytes asked for, and nothing outside the region the key names.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "cross_user_helpers.h"
#include "device/device_memory.h"
#include "process_runner.h"
#include "shm/memory_copy.h"

namespace softverbs {
namespace {

struct ChildRegion {
  pid_t pid;
  uint32_t key;  // local write, remote write and read
  uint64_t address;
  uint32_t read_only_key;  // the same bytes, remote read only
};

// The child maps the device memory, registers 4 KiB of its own (a guard page
// of 0x11 on each side stays unregistered), starts its agent and waits for
// the parent's verdict; it exits 0 if its memory looks as the parent says.
class CopyAgent : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.path() + "/dev.mem";
    std::string error;
    memory_ = DeviceMemory::open(path_, &error);
    ASSERT_TRUE(memory_) << error;
    ASSERT_EQ(pipe(to_parent_), 0);
    ASSERT_EQ(pipe(to_child_), 0);
    child_ = fork();
    if (child_ == 0) run_child();
    ASSERT_EQ(read(to_parent_[0], &region_, sizeof region_), static_cast<ssize_t>(sizeof region_));
  }

  [[noreturn]] void run_child() {
    std::string error;
    auto memory = DeviceMemory::open(path_, &error);
    std::vector<uint8_t> buffer(3 * 4096, 0x11);
    uint8_t* registered = buffer.data() + 4096;
    std::memset(registered, 0, 4096);
    std::optional<uint32_t> key, read_only_key;
    const int process = memory->process_slot();  // joins: the agent starts
    {
      ExclusiveLock lock(memory->shared().memory_lock);
      key = memory->shared().mrs.register_region(
          1, getpid(), reinterpret_cast<uint64_t>(registered), reinterpret_cast<uint64_t>(registered), 4096,
          access::kLocalWrite | access::kRemoteWrite | access::kRemoteRead, {}, process);
      read_only_key = memory->shared().mrs.register_region(1, getpid(), reinterpret_cast<uint64_t>(registered),
                                                           reinterpret_cast<uint64_t>(registered), 4096,
                                                           access::kRemoteRead, {}, process);
    }
    ChildRegion mine{getpid(), key.value_or(0), reinterpret_cast<uint64_t>(registered), read_only_key.value_or(0)};
    if (write(to_parent_[1], &mine, sizeof mine) != sizeof mine) _exit(2);
    uint8_t expected_first = 0;
    if (read(to_child_[0], &expected_first, 1) != 1) _exit(3);
    bool guards_intact = true;
    for (size_t i = 0; i < 4096; ++i)
      guards_intact = guards_intact && buffer[i] == 0x11 && buffer[2 * 4096 + i] == 0x11;
    _exit(guards_intact && registered[0] == expected_first ? 0 : 1);
  }

  int finish(uint8_t expected_first) {
    EXPECT_EQ(write(to_child_[1], &expected_first, 1), 1);
    int status = 0;
    waitpid(child_, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  test::TemporaryDirectory dir_;
  std::string path_;
  std::shared_ptr<DeviceMemory> memory_;
  int to_parent_[2], to_child_[2];
  pid_t child_ = -1;
  ChildRegion region_{};
};

TEST_F(CopyAgent, WritesAndReadsRegisteredBytes) {
  std::vector<uint8_t> data(4096);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 3 + 1);
  iovec local{data.data(), data.size()};
  RemoteRange remote{region_.address, 4096, region_.key, access::kRemoteWrite};
  ASSERT_EQ(agent_copy_to_process(*memory_, region_.pid, std::span(&local, 1), std::span(&remote, 1)), 0);
  std::vector<uint8_t> back(4096, 0);
  iovec sink{back.data(), back.size()};
  RemoteRange readable{region_.address, 4096, region_.read_only_key, access::kRemoteRead};
  ASSERT_EQ(agent_copy_from_process(*memory_, region_.pid, std::span(&sink, 1), std::span(&readable, 1)), 0);
  EXPECT_EQ(back, data);
  EXPECT_EQ(finish(data[0]), 0);
}

TEST_F(CopyAgent, RefusesBytesOutsideTheKeysRegion) {
  uint8_t bytes[2] = {0x77, 0x77};
  iovec local{bytes, 2};
  const RemoteRange cases[] = {
      {region_.address - 1, 2, region_.key, access::kRemoteWrite},                    // starts before the region
      {region_.address + 4096, 2, region_.key, access::kRemoteWrite},                 // after it
      {region_.address + 4095, 2, region_.key, access::kRemoteWrite},                 // runs one byte past its end
      {region_.address, 2, region_.key ^ 0x10000, access::kRemoteWrite},              // a key that names nothing
      {region_.address, 2, region_.read_only_key, access::kRemoteWrite},              // a right the key lacks
      {region_.address, 2, region_.read_only_key, access::kLocalWrite},               // the same, as a SEND
      {region_.address, 2, region_.key, access::kRemoteRead},                         // a read right to write
      {region_.address, 2, region_.key, 0},                                           // no right named
      {region_.address, 2, region_.key, access::kRemoteWrite | access::kLocalWrite},  // two rights at once
  };
  for (size_t i = 0; i < std::size(cases); ++i)
    EXPECT_EQ(agent_copy_to_process(*memory_, region_.pid, std::span(&local, 1), std::span(&cases[i], 1)), EFAULT)
        << "case " << i;
  EXPECT_EQ(finish(0), 0) << "the child's guard bytes and region were not touched";
}

// The reproduction: as user nobody, a forged request made root's
// agent copy device heap into root's registered memory, and its EFAULT or
// EINVAL answers told which key and address pairs were valid. Now another
// user gets no answer at all, and nothing moves.
TEST_F(CopyAgent, AnotherUsersRequestIsNeitherServedNorAnswered) {
  if (!test::can_switch_user()) GTEST_SKIP() << "needs root, to run a second user";
  const int status = test::run_as_nobody([&] {
    // Device memory stays mapped after the switch, as it would for an
    // attacker who had obtained the file some other way.
    uint8_t bytes[2] = {0x77, 0x77};
    iovec local{bytes, 2};
    RemoteRange valid{region_.address, 2, region_.key, access::kRemoteWrite};
    RemoteRange invalid{region_.address, 2, region_.key ^ 0x10000, access::kRemoteWrite};
    const int to_valid = agent_copy_to_process(*memory_, region_.pid, std::span(&local, 1), std::span(&valid, 1));
    const int to_invalid = agent_copy_to_process(*memory_, region_.pid, std::span(&local, 1), std::span(&invalid, 1));
    // No answer: the requester waits out its timeout either way, and learns
    // nothing from the difference.
    return to_valid == ETIMEDOUT && to_invalid == ETIMEDOUT ? 0 : 1;
  });
  EXPECT_EQ(status, 0);
  EXPECT_EQ(finish(0), 0) << "the child's region and guard bytes were not touched";
}

TEST_F(CopyAgent, NoAgentAnswersForAProcessWithoutOne) {
  uint8_t byte = 1;
  iovec local{&byte, 1};
  RemoteRange remote{region_.address, 1, region_.key, access::kRemoteWrite};
  // Our own pid runs no agent on this device memory.
  EXPECT_NE(agent_copy_to_process(*memory_, getpid() + 100000, std::span(&local, 1), std::span(&remote, 1)), 0);
  EXPECT_EQ(finish(0), 0);
}

}  // namespace
}  // namespace softverbs
