// The message-rate baseline over UDP loopback: how many small datagrams per
// second one process can move to another, with the batching the kernel
// offers. Each datagram is as long as a RoCEv2 RDMA WRITE ONLY packet of
// the payload asked for (BTH + RETH + payload padded to 4 bytes + ICRC:
// 40 bytes for 8 B). The parent sends for a fixed time as fast as it can;
// a forked child busy-polls its socket and counts the datagrams that
// arrive (not those sent: what the kernel drops does not count), and
// prints datagrams per second from the start of the sending to its last read.
//
// Ways of sending and receiving, each measured on its own:
//   sendmmsg   64 datagrams per sendmmsg; received with recvmmsg, 64 a call
//   gso        64 equal datagrams in one sendmsg (UDP_SEGMENT); received
//              with UDP_GRO (the kernel hands over runs of them as one
//              buffer, split by the reader at the segment size)
//   gso128     the same with 128 datagrams a send (newer kernels' limit,
//              UDP_MAX_SEGMENTS; 0 where the kernel refuses it)
//   gso_split  64 a GSO send, received without UDP_GRO (recvmmsg)
//   send       one send() per datagram; received with recvmmsg
// The best of them is the floor for a software transport's message rate.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "udp/gso.h"

namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr size_t kBatch = 64;                 // datagrams per sendmmsg / GSO send / recvmmsg
constexpr size_t kLargeGso = 128;             // datagrams per GSO send for gso128
constexpr size_t kRoceHeaders = 12 + 16 + 4;  // BTH + RETH + ICRC

int bound_socket(uint16_t& port) {
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  port = ntohs(address.sin_port);
  int size = 8 << 20;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
  return fd;
}

void connect_to(int fd, uint16_t port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
}

enum class Way { Sendmmsg, Gso, Gso128, GsoSplit, Send };

// The receiving child: counts datagrams until none came for 200 ms; returns
// datagrams per second from `start` (just before the sender began) to the
// last read. (Not from the first read: a receiver that gets its core late
// finds a socket buffer full of GRO batches and reads them at memory speed.)
double receive_rate(int fd, bool gro, SteadyClock::time_point start) {
  std::vector<char> buffers(kBatch * 65536);
  std::vector<iovec> pieces(kBatch);
  std::vector<mmsghdr> messages(kBatch);
  std::vector<softverbs::UdpGroControl> controls(kBatch);
  uint64_t count = 0;
  SteadyClock::time_point last{};
  SteadyClock::time_point idle_since = SteadyClock::now();
  for (;;) {
    for (size_t i = 0; i < kBatch; ++i) {
      pieces[i] = {buffers.data() + i * 65536, 65536};
      messages[i].msg_hdr = msghdr{};
      messages[i].msg_hdr.msg_iov = &pieces[i];
      messages[i].msg_hdr.msg_iovlen = 1;
      if (gro) {
        messages[i].msg_hdr.msg_control = controls[i].bytes;
        messages[i].msg_hdr.msg_controllen = sizeof controls[i].bytes;
      }
    }
    const int got = recvmmsg(fd, messages.data(), kBatch, MSG_DONTWAIT, nullptr);
    const SteadyClock::time_point now = SteadyClock::now();
    if (got <= 0) {
      if (count > 0 && now - idle_since > std::chrono::milliseconds(200)) break;
      if (count == 0 && now - idle_since > std::chrono::seconds(5)) break;
      continue;
    }
    uint64_t arrived = 0;
    for (int i = 0; i < got; ++i) {
      const size_t length = messages[i].msg_len;
      const size_t segment = gro ? softverbs::udp_gro_segment(messages[i].msg_hdr, length) : length;
      arrived += segment == 0 ? 1 : (length + segment - 1) / segment;
    }
    count += arrived;
    last = now;
    idle_since = now;
  }
  const double seconds = std::chrono::duration<double>(last - start).count();
  return count > 0 && seconds > 0 ? static_cast<double>(count) / seconds : 0.0;
}

// The sending parent: `way` for `seconds`.
// Returns false if a send failed (GSO refused).
bool send_for(int fd, Way way, size_t datagram, double seconds) {
  std::vector<char> bytes(kLargeGso * datagram, 0x5a);
  std::vector<iovec> pieces(kBatch);
  std::vector<mmsghdr> messages(kBatch);
  for (size_t i = 0; i < kBatch; ++i) {
    pieces[i] = {bytes.data() + i * datagram, datagram};
    messages[i].msg_hdr = msghdr{};
    messages[i].msg_hdr.msg_iov = &pieces[i];
    messages[i].msg_hdr.msg_iovlen = 1;
  }
  iovec whole{bytes.data(), (way == Way::Gso128 ? kLargeGso : kBatch) * datagram};
  msghdr gso{};
  gso.msg_iov = &whole;
  gso.msg_iovlen = 1;
  softverbs::UdpSegmentControl control;
  softverbs::request_udp_segments(gso, control, static_cast<uint16_t>(datagram));
  const auto until = SteadyClock::now() + std::chrono::duration<double>(seconds);
  while (SteadyClock::now() < until) {
    for (int round = 0; round < 16; ++round) {
      switch (way) {
        case Way::Sendmmsg:
          sendmmsg(fd, messages.data(), kBatch, 0);
          break;
        case Way::Gso:
        case Way::Gso128:
        case Way::GsoSplit:
          if (sendmsg(fd, &gso, 0) < 0 && errno == EINVAL) return false;
          break;
        case Way::Send:
          for (size_t i = 0; i < kBatch; ++i) send(fd, bytes.data(), datagram, 0);
          break;
      }
    }
  }
  return true;
}

double measure(Way way, size_t datagram, double seconds) {
  uint16_t port_a, port_b;
  const int a = bound_socket(port_a), b = bound_socket(port_b);
  connect_to(a, port_b);
  connect_to(b, port_a);
  const bool gro = way == Way::Gso || way == Way::Gso128;
  if (gro) {
    int on = 1;
    setsockopt(b, SOL_UDP, UDP_GRO, &on, sizeof on);
  }
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return 0;
  std::fflush(stdout);  // before fork: the child must not repeat it
  const SteadyClock::time_point start = SteadyClock::now();
  const pid_t child = fork();
  if (child == 0) {
    close(pipe_fds[0]);
    const double rate = receive_rate(b, gro, start);
    (void)!write(pipe_fds[1], &rate, sizeof rate);
    _exit(0);
  }
  close(pipe_fds[1]);
  const bool sent = send_for(a, way, datagram, seconds);
  double rate = 0;
  if (read(pipe_fds[0], &rate, sizeof rate) != sizeof rate || !sent) rate = 0;
  waitpid(child, nullptr, 0);
  close(pipe_fds[0]);
  close(a);
  close(b);
  return rate;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t payload = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 8;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 0.5;
  if (payload == 0 || payload > 1024 || seconds <= 0) {
    std::fprintf(stderr, "usage: udp_rate [PAYLOAD 1..1024, default 8] [SECONDS, default 0.5]\n");
    return 2;
  }
  const size_t datagram = kRoceHeaders + (payload + 3) / 4 * 4;
  const struct {
    Way way;
    const char* name;
  } ways[] = {{Way::Sendmmsg, "sendmmsg"},
              {Way::Gso, "gso"},
              {Way::Gso128, "gso128"},
              {Way::GsoSplit, "gso_split"},
              {Way::Send, "send"}};
  double best = 0;
  const char* best_name = "";
  for (const auto& way : ways) {
    const double rate = measure(way.way, datagram, seconds);
    std::printf("udp_rate_%s_Mpps value=%.3f datagram=%zu\n", way.name, rate / 1e6, datagram);
    if (rate > best) {
      best = rate;
      best_name = way.name;
    }
  }
  std::printf("udp_rate_best_Mpps value=%.3f way=%s datagram=%zu\n", best / 1e6, best_name, datagram);
  return 0;
}
