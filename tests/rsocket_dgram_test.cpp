// Datagram rsockets through our librdmacm.so.1.
// - DgramSocket*: in this process, run under `softverbs run`: datagrams of
//   many sizes with their source address, the switch from UDP to the UD QP
//   once the peer's QPN is known, and the error paths as rdma-core's
//   rsockets or a UDP socket give them.
// - Udpong.*: rdma-core's udpong, server and client as two processes under
//   `softverbs run`, on a device of their own (shared memory or UDP).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <rdma/rsocket.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "process_runner.h"

namespace {

sockaddr_in loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

sockaddr* as_sockaddr(sockaddr_in& a) { return reinterpret_cast<sockaddr*>(&a); }

// A datagram rsocket bound to 127.0.0.1 on a port the kernel picks; `bound`
// receives its address.
int bound_socket(sockaddr_in& bound, int flags = 0) {
  int s = rsocket(AF_INET, SOCK_DGRAM | flags, 0);
  if (s < 0) return -1;
  sockaddr_in a = loopback(0);
  if (rbind(s, as_sockaddr(a), sizeof a) != 0) return -1;
  socklen_t len = sizeof bound;
  if (rgetsockname(s, as_sockaddr(bound), &len) != 0) return -1;
  return s;
}

std::vector<uint8_t> pattern(size_t size, unsigned seed) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(seed * 131 + i * 7);
  return bytes;
}

bool same_address(const sockaddr_in& a, const sockaddr_in& b) {
  return a.sin_family == b.sin_family && a.sin_port == b.sin_port && a.sin_addr.s_addr == b.sin_addr.s_addr;
}

// Waits for a datagram on `s`: a lost one fails the test with a message
// rather than leaving a blocking receive to ctest's timeout.
bool arrives(int s) {
  pollfd p{s, POLLIN, 0};
  return rpoll(&p, 1, 10000) == 1;
}

// The largest datagram: rdma-core's 2048-byte slot less the 8-byte header,
// unless the port's MTU is smaller still (not on our devices: 4096).
constexpr size_t kMaxDatagram = 2048 - 8;

class DgramSockets : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = bound_socket(server_address_);
    client_ = bound_socket(client_address_);
    ASSERT_GE(server_, 0) << strerror(errno);
    ASSERT_GE(client_, 0) << strerror(errno);
  }
  void TearDown() override {
    if (client_ >= 0) {
      EXPECT_EQ(rclose(client_), 0);
    }
    if (server_ >= 0) {
      EXPECT_EQ(rclose(server_), 0);
    }
  }

  // One datagram from the client to the server and back, checked on both
  // sides: bytes, length and source address.
  void round_trip(const std::vector<uint8_t>& bytes) {
    ASSERT_EQ(rsendto(client_, bytes.data(), bytes.size(), 0, as_sockaddr(server_address_), sizeof server_address_),
              static_cast<ssize_t>(bytes.size()))
        << strerror(errno);
    std::vector<uint8_t> got(kMaxDatagram + 100, 0xEE);
    sockaddr_in from{};
    socklen_t from_len = sizeof from;
    ASSERT_TRUE(arrives(server_)) << "no datagram within 10 s";
    ASSERT_EQ(rrecvfrom(server_, got.data(), got.size(), 0, as_sockaddr(from), &from_len),
              static_cast<ssize_t>(bytes.size()))
        << strerror(errno);
    EXPECT_EQ(from_len, sizeof(sockaddr_in));
    EXPECT_TRUE(same_address(from, client_address_)) << ntohs(from.sin_port) << " " << ntohs(client_address_.sin_port);
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), got.begin()));
    EXPECT_EQ(got[bytes.size()], 0xEE);  // nothing written past the datagram

    ASSERT_EQ(rsendto(server_, got.data(), bytes.size(), 0, as_sockaddr(from), from_len),
              static_cast<ssize_t>(bytes.size()));
    std::vector<uint8_t> echoed(kMaxDatagram, 0);
    from_len = sizeof from;
    ASSERT_TRUE(arrives(client_)) << "no datagram within 10 s";
    ASSERT_EQ(rrecvfrom(client_, echoed.data(), echoed.size(), 0, as_sockaddr(from), &from_len),
              static_cast<ssize_t>(bytes.size()));
    EXPECT_TRUE(same_address(from, server_address_));
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), echoed.begin()));
  }

  int server_ = -1, client_ = -1;
  sockaddr_in server_address_{}, client_address_{};
};

TEST_F(DgramSockets, DatagramsOfManySizesArriveWholeWithTheirSource) {
  const size_t sizes[] = {1, 2, 7, 8, 63, 64, 65, 100, 511, 512, 1000, 1023, 1024, 1500, 2000, 2039, kMaxDatagram};
  unsigned seed = 0;
  for (int round = 0; round < 10; ++round)
    for (size_t size : sizes) ASSERT_NO_FATAL_FAILURE(round_trip(pattern(size, ++seed)));
}

TEST_F(DgramSockets, AnEmptyDatagramArrivesAsZeroBytes) {
  ASSERT_NO_FATAL_FAILURE(round_trip(pattern(16, 1)));  // the peers learn each other's QPN
  ASSERT_EQ(rsendto(client_, nullptr, 0, 0, as_sockaddr(server_address_), sizeof server_address_), 0);
  char byte = 0;
  pollfd p{server_, POLLIN, 0};
  ASSERT_EQ(rpoll(&p, 1, 5000), 1);
  EXPECT_EQ(rrecv(server_, &byte, 1, 0), 0);
}

// The rsocket's number is its UDP socket: once the first exchange has told
// each side the other's QPN, nothing more reaches that socket.
TEST_F(DgramSockets, AfterTheFirstExchangeDatagramsTravelOverTheQp) {
  ASSERT_NO_FATAL_FAILURE(round_trip(pattern(100, 1)));
  const auto bytes = pattern(1000, 2);
  ASSERT_EQ(rsendto(client_, bytes.data(), bytes.size(), 0, as_sockaddr(server_address_), sizeof server_address_),
            1000);
  char peek;
  EXPECT_EQ(::recv(server_, &peek, 1, MSG_PEEK | MSG_DONTWAIT), -1);
  EXPECT_EQ(errno, EAGAIN);
  std::vector<uint8_t> got(2048);
  ASSERT_TRUE(arrives(server_)) << "no datagram within 10 s";
  EXPECT_EQ(rrecv(server_, got.data(), got.size(), 0), 1000);
}

TEST_F(DgramSockets, AShortBufferTakesTheStartOfTheDatagram) {
  ASSERT_NO_FATAL_FAILURE(round_trip(pattern(16, 1)));
  const auto bytes = pattern(500, 3);
  ASSERT_EQ(rsendto(client_, bytes.data(), bytes.size(), 0, as_sockaddr(server_address_), sizeof server_address_), 500);
  std::vector<uint8_t> got(100);
  ASSERT_TRUE(arrives(server_)) << "no datagram within 10 s";
  EXPECT_EQ(rrecv(server_, got.data(), got.size(), MSG_PEEK), 100);
  EXPECT_EQ(rrecv(server_, got.data(), got.size(), 0), 100);  // the peek left it queued
  EXPECT_TRUE(std::equal(got.begin(), got.end(), bytes.begin()));
  char byte;
  EXPECT_EQ(rrecv(server_, &byte, 1, MSG_DONTWAIT), -1);  // the rest went with it
  EXPECT_EQ(errno, EAGAIN);
}

TEST_F(DgramSockets, MessageCallsCarryTheAddresses) {
  char part1[] = "gather", part2[] = "ed";
  iovec out[2] = {{part1, 6}, {part2, 2}};
  msghdr sent{};
  sent.msg_name = &server_address_;
  sent.msg_namelen = sizeof server_address_;
  sent.msg_iov = out;
  sent.msg_iovlen = 2;
  ASSERT_EQ(rsendmsg(client_, &sent, 0), 8);
  char got[32] = {};
  iovec in{got, sizeof got};
  sockaddr_in from{};
  msghdr received{};
  received.msg_name = &from;
  received.msg_namelen = sizeof from;
  received.msg_iov = &in;
  received.msg_iovlen = 1;
  ASSERT_TRUE(arrives(server_)) << "no datagram within 10 s";
  ASSERT_EQ(rrecvmsg(server_, &received, 0), 8);
  EXPECT_EQ(std::string(got, 8), "gathered");
  EXPECT_EQ(received.msg_namelen, sizeof(sockaddr_in));
  EXPECT_TRUE(same_address(from, client_address_));
}

TEST_F(DgramSockets, ADatagramLargerThanOnePacketIsRefused) {
  ASSERT_NO_FATAL_FAILURE(round_trip(pattern(16, 1)));
  std::vector<uint8_t> big(kMaxDatagram + 1);
  EXPECT_EQ(rsendto(client_, big.data(), big.size(), 0, as_sockaddr(server_address_), sizeof server_address_), -1);
  EXPECT_EQ(errno, EMSGSIZE);
  big.resize(65000);
  EXPECT_EQ(rsendto(client_, big.data(), big.size(), 0, as_sockaddr(server_address_), sizeof server_address_), -1);
  EXPECT_EQ(errno, EMSGSIZE);
  // Before the peer's QPN is known (over UDP), the same limit.
  int fresh = rsocket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fresh, 0);
  EXPECT_EQ(rsendto(fresh, big.data(), kMaxDatagram + 1, 0, as_sockaddr(server_address_), sizeof server_address_), -1);
  EXPECT_EQ(errno, EMSGSIZE);
  EXPECT_EQ(rclose(fresh), 0);
  // Nothing of them arrived; the socket still works.
  char byte;
  EXPECT_EQ(rrecv(server_, &byte, 1, MSG_DONTWAIT), -1);
  EXPECT_EQ(errno, EAGAIN);
  ASSERT_NO_FATAL_FAILURE(round_trip(pattern(kMaxDatagram, 2)));
}

TEST_F(DgramSockets, ReceivingOnAnEmptyNonBlockingSocketSaysEagain) {
  char byte;
  EXPECT_EQ(rrecv(server_, &byte, 1, MSG_DONTWAIT), -1);
  EXPECT_EQ(errno, EAGAIN);
  ASSERT_EQ(rfcntl(server_, F_SETFL, O_NONBLOCK), 0);
  EXPECT_EQ(rfcntl(server_, F_GETFL) & O_NONBLOCK, O_NONBLOCK);
  EXPECT_EQ(rrecvfrom(server_, &byte, 1, 0, nullptr, nullptr), -1);
  EXPECT_EQ(errno, EAGAIN);
  pollfd p{server_, POLLIN | POLLOUT, 0};
  EXPECT_EQ(rpoll(&p, 1, 0), 1);
  EXPECT_EQ(p.revents, POLLOUT);
}

// As over UDP: a datagram to a port where no one listens is lost, the send
// does not wait for anyone, and nothing comes back.
TEST_F(DgramSockets, SendingWhereNoOneListensNeitherHangsNorAnswers) {
  // A port that was bound a moment ago and is free now.
  sockaddr_in nobody{};
  {
    sockaddr_in unused{};
    int probe = bound_socket(unused);
    ASSERT_GE(probe, 0);
    nobody = unused;
    ASSERT_EQ(rclose(probe), 0);
  }
  const auto bytes = pattern(64, 4);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(rsendto(client_, bytes.data(), bytes.size(), 0, as_sockaddr(nobody), sizeof nobody), 64)
        << strerror(errno);
  pollfd p{client_, POLLIN, 0};
  EXPECT_EQ(rpoll(&p, 1, 300), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  char byte;
  EXPECT_EQ(rrecv(client_, &byte, 1, MSG_DONTWAIT), -1);
  EXPECT_EQ(errno, EAGAIN);
  // The socket still talks to a live peer.
  ASSERT_NO_FATAL_FAILURE(round_trip(pattern(64, 5)));
}

TEST_F(DgramSockets, RpollWakesForADatagramSentLater) {
  ASSERT_NO_FATAL_FAILURE(round_trip(pattern(16, 1)));
  std::thread sender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto bytes = pattern(300, 6);
    rsendto(client_, bytes.data(), bytes.size(), 0, as_sockaddr(server_address_), sizeof server_address_);
  });
  pollfd p{server_, POLLIN, 0};
  EXPECT_EQ(rpoll(&p, 1, 10000), 1);
  EXPECT_EQ(p.revents, POLLIN);
  sender.join();
  std::vector<uint8_t> got(2048);
  EXPECT_EQ(rrecv(server_, got.data(), got.size(), MSG_DONTWAIT), 300);
}

TEST_F(DgramSockets, AConnectedSocketSendsAndReadsWithoutAddresses) {
  ASSERT_EQ(rconnect(client_, as_sockaddr(server_address_), sizeof server_address_), 0);
  sockaddr_in peer{};
  socklen_t len = sizeof peer;
  ASSERT_EQ(rgetpeername(client_, as_sockaddr(peer), &len), 0);
  EXPECT_TRUE(same_address(peer, server_address_));
  const auto bytes = pattern(700, 7);
  ASSERT_EQ(rsend(client_, bytes.data(), bytes.size(), 0), 700);
  sockaddr_in from{};
  socklen_t from_len = sizeof from;
  std::vector<uint8_t> got(2048);
  ASSERT_TRUE(arrives(server_)) << "no datagram within 10 s";
  ASSERT_EQ(rrecvfrom(server_, got.data(), got.size(), 0, as_sockaddr(from), &from_len), 700);
  EXPECT_TRUE(same_address(from, client_address_));
  ASSERT_EQ(rsendto(server_, bytes.data(), 100, 0, as_sockaddr(from), from_len), 100);
  ASSERT_TRUE(arrives(client_)) << "no datagram within 10 s";
  EXPECT_EQ(rrecv(client_, got.data(), got.size(), 0), 100);
}

// rdma-core's ds_udp_header (librdmacm/docs/rsocket), as a plain UDP socket
// sees it: what a host with the real librdmacm would receive and send.
struct WireUdpHeader {
  uint32_t tag;
  uint8_t version, op, length, reserved;
  uint32_t qpn;
  uint32_t ipv4;
};
static_assert(sizeof(WireUdpHeader) == 16);

TEST_F(DgramSockets, TheUdpExchangeFollowsRdmaCoresFormat) {
  int peer = ::socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(peer, 0);
  sockaddr_in peer_address = loopback(0);
  socklen_t len = sizeof peer_address;
  ASSERT_EQ(::bind(peer, as_sockaddr(peer_address), sizeof peer_address), 0);
  ASSERT_EQ(::getsockname(peer, as_sockaddr(peer_address), &len), 0);
  timeval patience{5, 0};
  ASSERT_EQ(::setsockopt(peer, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience), 0);

  // A first datagram to an address with no known QPN: header, then data.
  ASSERT_EQ(rsendto(client_, "abc", 3, 0, as_sockaddr(peer_address), sizeof peer_address), 3);
  uint8_t wire[64];
  sockaddr_in from{};
  len = sizeof from;
  ASSERT_EQ(::recvfrom(peer, wire, sizeof wire, 0, as_sockaddr(from), &len), 16 + 3);
  WireUdpHeader header;
  std::memcpy(&header, wire, sizeof header);
  EXPECT_EQ(ntohl(header.tag), 0x55555555u);
  EXPECT_EQ(header.version, 4);
  EXPECT_EQ(header.op, 0);  // RS_OP_DATA
  EXPECT_EQ(header.length, 16);
  const uint32_t client_qpn = ntohl(header.qpn);
  EXPECT_NE(client_qpn, 0u);
  EXPECT_EQ(client_qpn & 0xFF000000u, 0u);
  EXPECT_EQ(header.ipv4, htonl(INADDR_LOOPBACK));
  EXPECT_EQ(std::memcmp(wire + 16, "abc", 3), 0);
  EXPECT_TRUE(same_address(from, client_address_));

  // Data from "a real rsocket" naming the client's QP: delivered with the
  // UDP source, and answered with a header-only control message naming the
  // server's QP.
  WireUdpHeader data = header;  // the client's QPN and address
  uint8_t message[16 + 3];
  std::memcpy(message, &data, sizeof data);
  std::memcpy(message + 16, "xyz", 3);
  ASSERT_EQ(::sendto(peer, message, sizeof message, 0, as_sockaddr(server_address_), sizeof server_address_), 19);
  char got[16] = {};
  len = sizeof from;
  ASSERT_TRUE(arrives(server_)) << "no datagram within 10 s";
  ASSERT_EQ(rrecvfrom(server_, got, sizeof got, 0, as_sockaddr(from), &len), 3);
  EXPECT_EQ(std::memcmp(got, "xyz", 3), 0);
  EXPECT_TRUE(same_address(from, peer_address));
  len = sizeof from;
  ASSERT_EQ(::recvfrom(peer, wire, sizeof wire, 0, as_sockaddr(from), &len), 16);
  std::memcpy(&header, wire, sizeof header);
  EXPECT_EQ(ntohl(header.tag), 0x55555555u);
  EXPECT_EQ(header.op, 7);  // RS_OP_CTRL
  EXPECT_EQ(header.length, 16);
  EXPECT_NE(ntohl(header.qpn), 0u);
  EXPECT_NE(ntohl(header.qpn), client_qpn);
  EXPECT_TRUE(same_address(from, server_address_));

  // The server now sends to that address over the UD QP it was named: the
  // client's, which reports the server as the source.
  ASSERT_EQ(rsendto(server_, "hello", 5, 0, as_sockaddr(peer_address), sizeof peer_address), 5);
  len = sizeof from;
  ASSERT_TRUE(arrives(client_)) << "no datagram within 10 s";
  ASSERT_EQ(rrecvfrom(client_, got, sizeof got, 0, as_sockaddr(from), &len), 5);
  EXPECT_EQ(std::memcmp(got, "hello", 5), 0);
  EXPECT_TRUE(same_address(from, server_address_));
  char byte;
  EXPECT_EQ(::recv(peer, &byte, 1, MSG_DONTWAIT), -1);  // nothing went over UDP

  // A message without rdma-core's tag is no rsocket's: dropped, unanswered.
  std::memcpy(message, "not a header....", 16);
  ASSERT_EQ(::sendto(peer, message, sizeof message, 0, as_sockaddr(server_address_), sizeof server_address_), 19);
  pollfd p{server_, POLLIN, 0};
  EXPECT_EQ(rpoll(&p, 1, 200), 0);
  EXPECT_EQ(::recv(peer, &byte, 1, MSG_DONTWAIT), -1);
  ::close(peer);
}

// Over IPv6 the header is 24 bytes, so a datagram carries at most 2024.
TEST(DgramSocketsIpv6, LoopbackDatagramsCarryTheirSourceAndTheirLimit) {
  sockaddr_in6 server{}, client{};
  server.sin6_family = client.sin6_family = AF_INET6;
  server.sin6_addr = client.sin6_addr = in6addr_loopback;
  int s = rsocket(AF_INET6, SOCK_DGRAM, 0), c = rsocket(AF_INET6, SOCK_DGRAM, 0);
  ASSERT_GE(s, 0);
  ASSERT_GE(c, 0);
  socklen_t len = sizeof server;
  ASSERT_EQ(rbind(s, reinterpret_cast<sockaddr*>(&server), sizeof server), 0) << strerror(errno);
  ASSERT_EQ(rgetsockname(s, reinterpret_cast<sockaddr*>(&server), &len), 0);
  ASSERT_EQ(rbind(c, reinterpret_cast<sockaddr*>(&client), sizeof client), 0);
  len = sizeof client;
  ASSERT_EQ(rgetsockname(c, reinterpret_cast<sockaddr*>(&client), &len), 0);
  std::vector<uint8_t> buffer(4096);
  for (size_t size : {size_t{5}, size_t{1000}, size_t{2024}}) {
    const auto bytes = pattern(size, static_cast<unsigned>(size));
    ASSERT_EQ(rsendto(c, bytes.data(), size, 0, reinterpret_cast<sockaddr*>(&server), sizeof server),
              static_cast<ssize_t>(size));
    sockaddr_in6 from{};
    len = sizeof from;
    ASSERT_TRUE(arrives(s)) << "no datagram within 10 s";
    ASSERT_EQ(rrecvfrom(s, buffer.data(), buffer.size(), 0, reinterpret_cast<sockaddr*>(&from), &len),
              static_cast<ssize_t>(size));
    EXPECT_EQ(len, sizeof(sockaddr_in6));
    EXPECT_EQ(from.sin6_port, client.sin6_port);
    EXPECT_EQ(std::memcmp(&from.sin6_addr, &in6addr_loopback, 16), 0);
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), buffer.begin()));
    EXPECT_EQ(rsendto(s, buffer.data(), 2025, 0, reinterpret_cast<sockaddr*>(&from), len), -1);
    EXPECT_EQ(errno, EMSGSIZE);
    ASSERT_EQ(rsendto(s, buffer.data(), size, 0, reinterpret_cast<sockaddr*>(&from), len), static_cast<ssize_t>(size));
    ASSERT_TRUE(arrives(c)) << "no datagram within 10 s";
    EXPECT_EQ(rrecv(c, buffer.data(), buffer.size(), 0), static_cast<ssize_t>(size));
  }
  EXPECT_EQ(rclose(c), 0);
  EXPECT_EQ(rclose(s), 0);
}

TEST(DgramSocketErrors, CallsThatNeedAConnectionOrABindFail) {
  int s = rsocket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(s, 0);
  char byte = 0;
  // As rdma-core: nothing to receive on before a bind, connect or send.
  EXPECT_EQ(rrecv(s, &byte, 1, MSG_DONTWAIT), -1);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(rsend(s, &byte, 1, 0), -1);
  EXPECT_EQ(errno, EDESTADDRREQ);
  EXPECT_EQ(rlisten(s, 1), -1);
  EXPECT_EQ(errno, EOPNOTSUPP);
  EXPECT_EQ(rclose(s), 0);
  EXPECT_EQ(rsocket(AF_INET, SOCK_DGRAM, IPPROTO_TCP), -1);
  EXPECT_EQ(errno, ENOTSUP);
  EXPECT_EQ(rsocket(AF_INET, SOCK_DGRAM, IPPROTO_UDP) >= 0, true);
}

TEST(DgramSocketErrors, BufferSizesCountUntilTheFirstDatagram) {
  int s = rsocket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(s, 0);
  int size = 1 << 19;
  ASSERT_EQ(rsetsockopt(s, SOL_SOCKET, SO_RCVBUF, &size, sizeof size), 0);
  int got = 0;
  socklen_t len = sizeof got;
  ASSERT_EQ(rgetsockopt(s, SOL_SOCKET, SO_RCVBUF, &got, &len), 0);
  EXPECT_EQ(got, 1 << 20);  // doubled, as a kernel socket (and rdma-core) does
  EXPECT_EQ(rclose(s), 0);
}

// udpong: rdma-core's datagram ping-pong. Its server never ends by itself,
// so a shell runs it until the test says stop (a file appears), its output
// line-buffered to survive the kill; without -b it binds ::1 (getaddrinfo's
// first loopback address), where the client's 127.0.0.1 never arrives. The
// client prints one line of results when its run completed, and nothing
// when a transfer failed (its exit status is 0 either way).
struct UdpongCase {
  const char* name;
  std::vector<std::string> options;  // for both sides
  const char* result;                // the client's result line
};

void PrintTo(const UdpongCase& c, std::ostream* out) { *out << c.name; }

class Udpong : public ::testing::TestWithParam<UdpongCase> {};

// Whether a UDP socket of this network namespace is bound to `port`.
bool udp_port_bound(uint16_t port) {
  char wanted[16];
  std::snprintf(wanted, sizeof wanted, ":%04X ", port);
  for (const char* table : {"/proc/net/udp", "/proc/net/udp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the heading
    while (std::getline(in, line)) {
      // "sl local_address rem_address ...": the local address comes first.
      const size_t local = line.find(':') + 1;
      const size_t end = line.find(' ', line.find_first_not_of(' ', local));
      if (line.substr(local, end - local + 1).find(wanted) != std::string::npos) return true;
    }
  }
  return false;
}

TEST_P(Udpong, ClientCompletesItsRun) {
  const UdpongCase& c = GetParam();
  const std::string transport = std::string(c.name).rfind("udp", 0) == 0 ? "udp" : "shm";
  softverbs::test::TemporaryDirectory dir;
  const std::vector<std::string> env = {"SOFTVERBS_RUNTIME_DIR=" + dir.path() + "/rt"};
  std::vector<std::string> up = {SOFTVERBS_CLI, "up"};
  if (transport == "udp") up.insert(up.end(), {"--transport", "udp"});
  ASSERT_EQ(softverbs::test::run_process(up, env).exit_code, 0);

  const uint16_t port = static_cast<uint16_t>(20000 + getpid() % 20000);
  const std::string stop = dir.path() + "/stop";
  std::string options;
  for (const auto& option : c.options) options += " " + option;
  const std::string server_script =
      "\"$1\" run -- stdbuf -oL udpong -b 127.0.0.1 -p $2" + options +
      " & pid=$!\n"
      "while [ ! -e \"$3\" ]; do\n"
      "  kill -0 $pid 2>/dev/null || { wait $pid; echo \"udpong server ended by itself: $?\" >&2; exit 1; }\n"
      "  sleep 0.05\n"
      "done\n"
      "kill $pid; wait $pid; exit 0\n";
  auto server = std::async(std::launch::async, [&] {
    return softverbs::test::run_process({"sh", "-c", server_script, "sh", SOFTVERBS_CLI, std::to_string(port), stop},
                                        env, 45);
  });
  for (int i = 0; i < 200 && !udp_port_bound(port); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::vector<std::string> client = {SOFTVERBS_CLI, "run",       "--", "udpong",
                                     "-s",          "127.0.0.1", "-p", std::to_string(port)};
  client.insert(client.end(), c.options.begin(), c.options.end());
  const auto r = softverbs::test::run_process(client, env, 30);
  std::ofstream(stop).put('\n');
  const auto s = server.get();
  EXPECT_EQ(r.exit_code, 0) << r.err << r.out << "\nserver:\n" << s.err << s.out;
  EXPECT_TRUE(std::regex_search(r.out + r.err, std::regex(c.result))) << r.err << r.out << "\nserver:\n"
                                                                      << s.err << s.out;
  EXPECT_EQ(s.exit_code, 0) << s.err << s.out;
  EXPECT_NE(s.out.find("client login from 127.0.0.1"), std::string::npos) << s.err << s.out;
}

// name size xfers total time Gb/sec usec/xfer: an echo run counts both
// directions; a one-way run counts what the server received (at most -C,
// "1k" when none was dropped).
// A datagram larger than one packet (2040 bytes) fails its rsend.
#define UDPONG_CASES(prefix)                                                                                         \
  UdpongCase{prefix "echo", {"-T", "e", "-C", "150", "-S", "1000"}, "\ncustom +1000 +300 +"},                        \
      UdpongCase{prefix "echo_largest", {"-T", "e", "-C", "100", "-S", "2040"}, "\ncustom +1\\.9k +200 +"},          \
      UdpongCase{prefix "nonblocking", {"-T", "n", "-T", "e", "-C", "150", "-S", "64"}, "\ncustom +64 +300 +"},      \
      UdpongCase{prefix "blocking", {"-T", "b", "-T", "e", "-C", "300", "-S", "100"}, "\ncustom +100 +600 +"},       \
      UdpongCase{prefix "async", {"-T", "a", "-T", "e", "-C", "300", "-S", "500"}, "\ncustom +500 +600 +"},          \
      UdpongCase{prefix "async_blocking", {"-T", "a", "-T", "b", "-T", "e", "-C", "200"}, "\ncustom +1000 +400 +"},  \
      UdpongCase{prefix "too_large", {"-T", "e", "-C", "10", "-S", "2041"}, "rsend: Message too long"}, UdpongCase { \
    prefix "one_way", {"-C", "1000", "-S", "1000"}, "\ncustom +1000 +([0-9]+|1k) +"                                  \
  }

const UdpongCase kUdpongCases[] = {UDPONG_CASES("shm_"), UDPONG_CASES("udp_")};

INSTANTIATE_TEST_SUITE_P(Tools, Udpong, ::testing::ValuesIn(kUdpongCases),
                         [](const ::testing::TestParamInfo<UdpongCase>& info) { return info.param.name; });

}  // namespace
