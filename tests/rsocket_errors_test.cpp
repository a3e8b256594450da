// rsockets' error paths, as rdma-core's rsockets give them, through our
// librdmacm.so.1 (run under `softverbs run`): a refused connection, a
// non-blocking connect, reads after shutdown, a peer killed mid-stream.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <rdma/rsocket.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

sockaddr_in loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

int listener(uint16_t port) {
  int s = rsocket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = loopback(port);
  if (s < 0 || rbind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || rlisten(s, 4) != 0) return -1;
  return s;
}

int connected(uint16_t port) {
  int s = rsocket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = loopback(port);
  if (s < 0 || rconnect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return -1;
  return s;
}

// A connected pair: {accepted, connecting}.
std::pair<int, int> pair_on(uint16_t port) {
  int l = listener(port);
  int accepted = -1;
  std::thread server([&] { accepted = raccept(l, nullptr, nullptr); });
  int client = connected(port);
  server.join();
  rclose(l);
  return {accepted, client};
}

TEST(RsocketErrors, ConnectWithNoListenerIsRefused) {
  int s = rsocket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(s, 0);
  sockaddr_in a = loopback(7590);
  EXPECT_EQ(rconnect(s, reinterpret_cast<sockaddr*>(&a), sizeof a), -1);
  EXPECT_EQ(errno, ECONNREFUSED);
  // As in rdma-core, a failed connection reads as the end of the stream.
  char byte;
  EXPECT_EQ(rrecv(s, &byte, 1, 0), 0);
  EXPECT_EQ(rclose(s), 0);
}

TEST(RsocketErrors, NonBlockingConnectCompletesThroughRpoll) {
  int l = listener(7591);
  ASSERT_GE(l, 0);
  int s = rsocket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  ASSERT_GE(s, 0);
  EXPECT_EQ(rfcntl(s, F_GETFL) & O_NONBLOCK, O_NONBLOCK);
  sockaddr_in a = loopback(7591);
  // Accepting only after rconnect returns keeps the connection pending: an
  // accept racing ahead could let it complete at once, which is also valid.
  ASSERT_EQ(rconnect(s, reinterpret_cast<sockaddr*>(&a), sizeof a), -1);
  EXPECT_EQ(errno, EINPROGRESS);
  int accepted = -1;
  std::thread server([&] { accepted = raccept(l, nullptr, nullptr); });
  pollfd p{s, POLLOUT, 0};
  ASSERT_EQ(rpoll(&p, 1, 10000), 1);
  EXPECT_TRUE(p.revents & POLLOUT) << p.revents;
  int error = -1;
  socklen_t len = sizeof error;
  ASSERT_EQ(rgetsockopt(s, SOL_SOCKET, SO_ERROR, &error, &len), 0);
  EXPECT_EQ(error, 0);
  server.join();
  ASSERT_GE(accepted, 0);
  // Nothing to read yet: EAGAIN, not a block.
  char byte;
  EXPECT_EQ(rrecv(s, &byte, 1, 0), -1);
  EXPECT_EQ(errno, EAGAIN);
  EXPECT_EQ(rsend(accepted, "x", 1, 0), 1);
  p = {s, POLLIN, 0};
  ASSERT_EQ(rpoll(&p, 1, 10000), 1);
  EXPECT_EQ(rrecv(s, &byte, 1, 0), 1);
  EXPECT_EQ(byte, 'x');
  rclose(s);
  rclose(accepted);
  rclose(l);
}

TEST(RsocketErrors, NonBlockingConnectRefusedShowsInPollAndSoError) {
  int s = rsocket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  ASSERT_GE(s, 0);
  sockaddr_in a = loopback(7592);
  ASSERT_EQ(rconnect(s, reinterpret_cast<sockaddr*>(&a), sizeof a), -1);
  // The rejection can arrive before rconnect looks for it (a preempted
  // caller); either way poll and SO_ERROR must then report it.
  EXPECT_TRUE(errno == EINPROGRESS || errno == ECONNREFUSED) << std::strerror(errno);
  pollfd p{s, POLLOUT, 0};
  ASSERT_EQ(rpoll(&p, 1, 10000), 1);
  EXPECT_TRUE(p.revents & POLLERR) << p.revents;
  int error = 0;
  socklen_t len = sizeof error;
  ASSERT_EQ(rgetsockopt(s, SOL_SOCKET, SO_ERROR, &error, &len), 0);
  EXPECT_EQ(error, ECONNREFUSED);
  rclose(s);
}

TEST(RsocketErrors, ReadsAfterShutdownReturnTheDataThenEndOfFile) {
  auto [server, client] = pair_on(7593);
  ASSERT_GE(server, 0);
  ASSERT_GE(client, 0);
  ASSERT_EQ(rsend(client, "hello", 5, 0), 5);
  ASSERT_EQ(rshutdown(client, SHUT_WR), 0);
  char buffer[16];
  EXPECT_EQ(rrecv(server, buffer, sizeof buffer, MSG_WAITALL), 5);
  EXPECT_EQ(std::string(buffer, 5), "hello");
  EXPECT_EQ(rrecv(server, buffer, sizeof buffer, 0), 0);
  // The other direction still works after the peer's SHUT_WR.
  ASSERT_EQ(rsend(server, "back", 4, 0), 4);
  EXPECT_EQ(rrecv(client, buffer, 4, MSG_WAITALL), 4);
  // A local SHUT_RD: reads end at once.
  ASSERT_EQ(rshutdown(client, SHUT_RD), 0);
  EXPECT_EQ(rrecv(client, buffer, sizeof buffer, 0), 0);
  EXPECT_EQ(rshutdown(client, 42), -1);
  EXPECT_EQ(errno, EINVAL);
  rclose(server);
  rclose(client);
}

TEST(RsocketErrors, BadDescriptorsAndTypes) {
  char byte;
  EXPECT_EQ(rrecv(12345, &byte, 1, 0), -1);
  EXPECT_EQ(errno, EBADF);
  EXPECT_EQ(rclose(12345), -1);
  EXPECT_EQ(errno, EBADF);
  EXPECT_EQ(rsocket(AF_UNIX, SOCK_STREAM, 0), -1);
  EXPECT_EQ(errno, ENOTSUP);
  EXPECT_EQ(rsocket(AF_INET, SOCK_RAW, 0), -1);  // streams and datagrams only
  EXPECT_EQ(errno, ENOTSUP);
  EXPECT_EQ(rsocket(AF_INET, SOCK_STREAM, IPPROTO_UDP), -1);
  EXPECT_EQ(errno, ENOTSUP);
  int s = rsocket(AF_INET, SOCK_STREAM, 0);
  int size = 64;
  EXPECT_EQ(rsetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &size, sizeof size), 0);
  int got = 0;
  socklen_t len = sizeof got;
  EXPECT_EQ(rgetsockopt(s, SOL_RDMA, RDMA_SQSIZE, &got, &len), 0);
  EXPECT_EQ(got, 64);
  EXPECT_EQ(rgetsockopt(s, SOL_SOCKET, SO_PEERCRED, &got, &len), -1);
  EXPECT_EQ(errno, ENOTSUP);
  rclose(s);
}

// A peer process killed mid-stream: its kernel CM would send a DREQ, so the
// survivor sees DISCONNECTED: what was sent before the death is read, then
// rrecv returns 0 (the end of the stream) and rsend fails with ECONNRESET,
// as rdma-core's rsockets give them.
TEST(RsocketErrors, PeerKilledMidStreamEndsTheStream) {
  int l = listener(7594);
  ASSERT_GE(l, 0);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  // The peer is a fresh process (this binary again, as KilledPeer below):
  // a child forked from a process whose rdma_cm is in use would share it.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    setenv("RSOCKET_KILLED_PEER_FD", std::to_string(ready[1]).c_str(), 1);
    execl("/proc/self/exe", "rsocket_errors_test", "--gtest_filter=KilledPeer.*", nullptr);
    _exit(127);
  }
  int s = raccept(l, nullptr, nullptr);
  ASSERT_GE(s, 0);
  char byte;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  char buffer[16];
  EXPECT_EQ(rrecv(s, buffer, 6, MSG_WAITALL), 6);
  EXPECT_EQ(std::string(buffer, 6), "before");
  EXPECT_EQ(rrecv(s, buffer, sizeof buffer, 0), 0);
  EXPECT_EQ(rsend(s, "after", 5, 0), -1);
  EXPECT_EQ(errno, ECONNRESET);
  pollfd p{s, POLLIN, 0};
  ASSERT_EQ(rpoll(&p, 1, 1000), 1);
  EXPECT_TRUE(p.revents & POLLHUP) << p.revents;
  rclose(s);
  rclose(l);
  close(ready[0]);
  close(ready[1]);
}

// The peer of PeerKilledMidStreamEndsTheStream, run only as that test's
// child: connects, sends, says so, and waits to be killed.
TEST(KilledPeer, ConnectsSendsAndWaits) {
  const char* ready = std::getenv("RSOCKET_KILLED_PEER_FD");
  if (ready == nullptr) GTEST_SKIP() << "the peer of RsocketErrors.PeerKilledMidStreamEndsTheStream";
  int s = connected(7594);
  ASSERT_GE(s, 0);
  ASSERT_EQ(rsend(s, "before", 6, 0), 6);
  char byte = 'R';
  ASSERT_EQ(write(std::atoi(ready), &byte, 1), 1);
  for (;;) pause();
}

}  // namespace
