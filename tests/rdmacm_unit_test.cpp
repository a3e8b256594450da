// The rdmacm shim's parts that need no device: the listener directory and
// delegation to a real librdmacm. (The CM wire format: cm_mad_test.)
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "listener_directory.h"
#include "process_runner.h"

namespace softverbs::cm {
namespace {

sockaddr_storage ipv4(const char* address, uint16_t port) {
  sockaddr_storage storage{};
  auto& in = reinterpret_cast<sockaddr_in&>(storage);
  in.sin_family = AF_INET;
  in.sin_port = htons(port);
  inet_pton(AF_INET, address, &in.sin_addr);
  return storage;
}

TEST(ListenerDirectory, ClaimReleaseAndConflicts) {
  test::TemporaryDirectory dir;
  ListenerDirectory directory(dir.path());
  ASSERT_EQ(directory.claim(ipv4("127.0.0.1", 7000)), 0);
  EXPECT_EQ(directory.claim(ipv4("127.0.0.1", 7000)), EADDRINUSE);
  EXPECT_EQ(directory.claim(ipv4("0.0.0.0", 7000)), EADDRINUSE) << "a wildcard overlaps every address";
  ASSERT_EQ(directory.claim(ipv4("0.0.0.0", 7001)), 0);
  EXPECT_EQ(directory.claim(ipv4("127.0.0.1", 7001)), EADDRINUSE);
  EXPECT_EQ(directory.claim(ipv4("10.9.8.7", 7002)), 0) << "another port";
  directory.release(ipv4("127.0.0.1", 7000));
  EXPECT_EQ(directory.claim(ipv4("127.0.0.1", 7000)), 0) << "released";
  uint16_t port = directory.free_port();
  EXPECT_GE(port, 49152);
}

TEST(ListenerDirectory, EntriesOfExitedProcessesAreIgnored) {
  test::TemporaryDirectory dir;
  pid_t child = fork();
  if (child == 0) {
    ListenerDirectory(dir.path()).claim(ipv4("127.0.0.1", 7100));
    _exit(0);
  }
  waitpid(child, nullptr, 0);
  ListenerDirectory directory(dir.path());
  EXPECT_EQ(directory.claim(ipv4("127.0.0.1", 7100)), 0) << "the dead listener's port is free again";
}

TEST(Delegation, HandsCallsToTheRealLibraryWhenAskedTo) {
  auto real = test::run_process({DELEGATION_PROBE},
                                {"SOFTVERBS_RDMACM=real", std::string("SOFTVERBS_RDMACM_REAL=") + FAKE_LIBRDMACM});
  ASSERT_EQ(real.exit_code, 0) << real.err;
  EXPECT_NE(real.out.find("event_str=FAKE_LIBRDMACM_EVENT"), std::string::npos) << real.out;
  EXPECT_NE(real.out.find("channel_fd=4242"), std::string::npos) << real.out;
  EXPECT_NE(real.out.find("bind=-4243"), std::string::npos) << real.out;

  auto emulated = test::run_process({DELEGATION_PROBE},
                                    {"SOFTVERBS_RDMACM=emu", std::string("SOFTVERBS_RDMACM_REAL=") + FAKE_LIBRDMACM});
  ASSERT_EQ(emulated.exit_code, 0) << emulated.err;
  EXPECT_NE(emulated.out.find("event_str=RDMA_CM_EVENT_ESTABLISHED"), std::string::npos) << emulated.out;
  EXPECT_NE(emulated.out.find("bind=-1"), std::string::npos) << emulated.out;

  // auto: no kernel rdma_cm on this machine, so the emulation answers.
  if (access("/dev/infiniband/rdma_cm", R_OK | W_OK) != 0) {
    auto automatic = test::run_process(
        {DELEGATION_PROBE}, {"SOFTVERBS_RDMACM=auto", std::string("SOFTVERBS_RDMACM_REAL=") + FAKE_LIBRDMACM});
    EXPECT_NE(automatic.out.find("event_str=RDMA_CM_EVENT_ESTABLISHED"), std::string::npos) << automatic.out;
  }
}

}  // namespace
}  // namespace softverbs::cm
