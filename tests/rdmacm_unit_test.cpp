// The rdmacm shim's parts that need no device: the CM wire format (nothing
// malformed gets through), the listener directory, and delegation to a real
// librdmacm.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "cm_protocol.h"
#include "listener_directory.h"
#include "process_runner.h"

namespace softverbs::cm {
namespace {

TEST(CmProtocol, EveryMessageRoundTrips) {
  for (MessageType type : {MessageType::Req, MessageType::Rep, MessageType::Rtu, MessageType::Rej, MessageType::Dreq,
                           MessageType::Drep, MessageType::SidrReq, MessageType::SidrRep}) {
    Message message;
    message.type = type;
    message.req.qp_num = 0x123456;
    message.req.private_data_length = 56;
    message.req.private_data[55] = 0x5a;
    message.rep.start_psn = 0xabcdef;
    message.rej.reason = kRejectConsumer;
    auto bytes = encode(message);
    ASSERT_EQ(framed_length(bytes).value_or(0), bytes.size());
    auto decoded = decode(bytes);
    ASSERT_TRUE(decoded) << static_cast<int>(type);
    EXPECT_EQ(decoded->type, type);
    if (type == MessageType::Req) {
      EXPECT_EQ(decoded->req.qp_num, 0x123456u);
      EXPECT_EQ(decoded->req.private_data[55], 0x5a);
    }
  }
}

TEST(CmProtocol, MalformedInputIsRejected) {
  Message message;
  message.type = MessageType::Req;
  auto good = encode(message);
  // Truncated, padded, wrong magic, wrong version, unknown type, wrong body size.
  EXPECT_FALSE(decode(std::span(good.data(), good.size() - 1)));
  auto padded = good;
  padded.push_back(0);
  EXPECT_FALSE(decode(padded));
  auto bad_magic = good;
  bad_magic[0] ^= 0xff;
  EXPECT_FALSE(framed_length(bad_magic));
  EXPECT_FALSE(decode(bad_magic));
  auto bad_version = good;
  bad_version[5] = 99;
  EXPECT_FALSE(decode(bad_version));
  auto bad_type = good;
  bad_type[4] = 200;
  EXPECT_FALSE(decode(bad_type));
  auto bad_size = good;
  bad_size[6] = 1;
  bad_size[7] = 0;
  EXPECT_FALSE(framed_length(bad_size));
  // Private data longer than its area.
  message.req.private_data_length = kReqPrivateData + 1;
  EXPECT_FALSE(decode(encode(message)));
  // A header alone asks for the rest; fewer bytes ask for a header.
  EXPECT_EQ(framed_length(std::span(good.data(), kHeaderBytes)).value_or(0), good.size());
  EXPECT_EQ(framed_length(std::span(good.data(), 3)).value_or(0), kHeaderBytes);
}

TEST(CmProtocol, RandomBytesNeverDecodeIntoAnythingWithTooMuchPrivateData) {
  uint32_t seed = 12345;
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> bytes(static_cast<size_t>(seed % 400));
    for (auto& b : bytes) {
      seed = seed * 1103515245 + 12345;
      b = static_cast<uint8_t>(seed >> 16);
    }
    if (bytes.size() >= 8) {  // give half of them a valid header
      if (round % 2) std::memcpy(bytes.data(), "CMVS\x01\x01", 6);
    }
    auto message = decode(bytes);
    if (!message) continue;
    EXPECT_LE(message->req.private_data_length, kReqPrivateData);
    EXPECT_LE(message->rep.private_data_length, kRepPrivateData);
    EXPECT_LE(message->rej.private_data_length, kRejPrivateData);
  }
}

sockaddr_storage ipv4(const char* address, uint16_t port) {
  sockaddr_storage storage{};
  auto& in = reinterpret_cast<sockaddr_in&>(storage);
  in.sin_family = AF_INET;
  in.sin_port = htons(port);
  inet_pton(AF_INET, address, &in.sin_addr);
  return storage;
}

TEST(ListenerDirectory, ClaimFindReleaseAndConflicts) {
  test::TemporaryDirectory dir;
  ListenerDirectory directory(dir.path());
  EXPECT_FALSE(directory.find(ipv4("127.0.0.1", 7000)));
  ASSERT_EQ(directory.claim(ipv4("127.0.0.1", 7000), 40000), 0);
  EXPECT_EQ(directory.find(ipv4("127.0.0.1", 7000)).value_or(0), 40000);
  EXPECT_EQ(directory.claim(ipv4("127.0.0.1", 7000), 40001), EADDRINUSE);
  EXPECT_EQ(directory.claim(ipv4("0.0.0.0", 7000), 40002), EADDRINUSE) << "a wildcard overlaps every address";
  ASSERT_EQ(directory.claim(ipv4("0.0.0.0", 7001), 40003), 0);
  EXPECT_EQ(directory.find(ipv4("10.9.8.7", 7001)).value_or(0), 40003) << "a wildcard listener serves any address";
  EXPECT_EQ(directory.claim(ipv4("127.0.0.1", 7001), 40004), EADDRINUSE);
  directory.release(ipv4("127.0.0.1", 7000));
  EXPECT_FALSE(directory.find(ipv4("127.0.0.1", 7000)));
  uint16_t port = directory.free_port();
  EXPECT_GE(port, 49152);
}

TEST(ListenerDirectory, EntriesOfExitedProcessesAreIgnored) {
  test::TemporaryDirectory dir;
  pid_t child = fork();
  if (child == 0) {
    ListenerDirectory(dir.path()).claim(ipv4("127.0.0.1", 7100), 41000);
    _exit(0);
  }
  waitpid(child, nullptr, 0);
  ListenerDirectory directory(dir.path());
  EXPECT_FALSE(directory.find(ipv4("127.0.0.1", 7100)));
  EXPECT_EQ(directory.claim(ipv4("127.0.0.1", 7100), 41001), 0) << "the dead listener's port is free again";
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
