// Baselines over UDP loopback: one-way ping-pong latency with busy-polling
// (non-blocking recv in a loop); the same ping-pong where each side's main
// thread spins on memory and a second thread, blocked in recv, sets it (what
// a software transport must do for an application, such as ib_write_lat,
// that waits for an RDMA WRITE by spinning on its buffer); the busy-polling
// ping-pong with RoCEv2's packets (each way a 2-byte RDMA WRITE and the ACK
// of the peer's, 36 + 20 bytes in one UDP GSO send, as softverbs sends them
// when an ACK leaves with the next request); one-way throughput with 64 KiB
// datagrams; and one-way throughput of 64 KiB RDMA WRITEs framed as RoCEv2
// at path MTU 4096, received with UDP_GRO, in two framings: as softverbs
// sends them, each packet a WRITE ONLY with a RETH of its own (4128 bytes:
// BTH + RETH + 4096 + ICRC), 15 to a UDP GSO send; and as an HCA sends them,
// one message of FIRST (with the RETH, 4128 bytes) and MIDDLE and LAST
// packets (4112), where as all datagrams of a UDP GSO send but the last must
// have one size, each message takes two sends (first + one, then the other
// 14). And the first framing with a software transport's work on the data,
// as softverbs does it: the sender copies each packet's payload from the
// application's buffer into the send buffer and computes its ICRC, the
// receiver checks every packet's ICRC and copies its payload out. The
// floors for the RoCEv2-over-UDP transport. With a third argument,
// SENDER_ADDRESS@NETNS,RECEIVER_ADDRESS@NETNS, the two sockets are made in
// those network namespaces (ip netns names) on those addresses instead of on
// 127.0.0.1: raw UDP between two namespaces, e.g. over a veth pair; and the
// throughput of datagrams of an MTU of 1500 (1472 bytes, 44 to a UDP GSO
// send) beside that of 64 KB datagrams, which such a link fragments.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "udp/gso.h"
#include "wire/icrc.h"

namespace {

// Where a socket is made: an IPv4 address, in a network namespace (an ip
// netns name) or in this process's.
struct Place {
  in_addr_t address = htonl(INADDR_LOOPBACK);
  std::string netns;
};

// A UDP socket of `place` (the namespace it is made in stays its own).
int socket_in(const Place& place) {
  if (place.netns.empty()) return socket(AF_INET, SOCK_DGRAM, 0);
  const int home = open("/proc/self/ns/net", O_RDONLY);
  const int target = open(("/run/netns/" + place.netns).c_str(), O_RDONLY);
  int fd = -1;
  if (home >= 0 && target >= 0 && setns(target, CLONE_NEWNET) == 0) {
    fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (setns(home, CLONE_NEWNET) != 0) std::abort();
  }
  if (home >= 0) close(home);
  if (target >= 0) close(target);
  if (fd < 0) std::perror(("udp_pingpong: a socket in network namespace " + place.netns).c_str());
  return fd;
}

int bound_socket(uint16_t& port, const Place& place = {}) {
  int fd = socket_in(place);
  if (fd < 0) std::exit(1);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = place.address;
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  port = ntohs(address.sin_port);
  int size = 8 << 20;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
  return fd;
}

void connect_to(int fd, uint16_t port, const Place& place = {}) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = place.address;
  address.sin_port = htons(port);
  connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
}

void spin_recv(int fd, char* buffer, size_t length) {
  while (recv(fd, buffer, length, MSG_DONTWAIT) < 0) {
  }
}

// One send: `count` datagrams of `segment` bytes, then one of `last` bytes
// (if not 0); with UDP GSO when that makes more than one datagram.
struct Send {
  size_t segment;
  size_t count;
  size_t last = 0;
  size_t bytes() const { return segment * count + last; }
  size_t datagrams() const { return count + (last != 0); }
};

ssize_t send_datagrams(int fd, char* buffer, const Send& what) {
  iovec data{buffer, what.bytes()};
  msghdr message{};
  message.msg_iov = &data;
  message.msg_iovlen = 1;
  softverbs::UdpSegmentControl control;
  if (what.datagrams() > 1) softverbs::request_udp_segments(message, control, static_cast<uint16_t>(what.segment));
  return sendmsg(fd, &message, 0);
}

// The software work around one 64 KiB RDMA WRITE at path MTU 4096 (see the
// top), framed as softverbs sends it (a RETH in every packet): the sender
// fills `packets` from `application`, copying each payload in the pass that
// computes the packet's CRC (crc32_copy, as softverbs's sender does), and
// seals the packet with it; the receiver checks each datagram of a GRO
// batch and copies its payload to `memory`. Returns the bytes written.
constexpr size_t kPathMtu = 4096;
constexpr size_t kBth = 12, kReth = 16, kIcrc = 4;
constexpr size_t kWritePackets = 16;
constexpr size_t kWriteOnlyPacket = kBth + kReth + kPathMtu + kIcrc;
// 15 WRITE ONLY packets fit a UDP GSO send (65,507 bytes at most), so 15
// messages of 16 make 16 full sends.
constexpr size_t kMessagesPerRound = 15;

size_t build_write(const uint8_t* application, uint8_t* packets) {
  for (size_t packet = 0; packet < kWritePackets; ++packet) {
    constexpr size_t header = kBth + kReth;
    uint32_t crc = softverbs::wire::crc32(0xffffffffu, std::span<const uint8_t>(packets, header));
    crc = softverbs::wire::crc32_copy(crc, packets + header,
                                      std::span<const uint8_t>(application + packet * kPathMtu, kPathMtu));
    softverbs::wire::store_icrc(~crc, packets + header + kPathMtu);
    packets += kWriteOnlyPacket;
  }
  return kWritePackets * kWriteOnlyPacket;
}

// Returns the number of datagrams whose CRC did not match.
size_t check_write(std::span<const uint8_t> batch, size_t segment, uint8_t* memory, size_t& at) {
  size_t bad = 0;
  for (size_t offset = 0; offset < batch.size(); offset += segment) {
    const auto datagram = batch.subspan(offset, std::min(segment, batch.size() - offset));
    if (datagram.size() < kBth + kPathMtu + kIcrc) return bad + 1;
    const size_t body = datagram.size() - kIcrc;
    if (~softverbs::wire::crc32(0xffffffffu, datagram.first(body)) != softverbs::wire::load_icrc(&datagram[body]))
      ++bad;
    std::memcpy(memory + at, &datagram[body - kPathMtu], kPathMtu);
    at = (at + kPathMtu) % (kWritePackets * kPathMtu);
  }
  return bad;
}

// The parent makes the sends of `pattern` over and over as fast as it can;
// the child (busy-polling, with UDP_GRO) counts the bytes that arrive
// between its first and last receive and prints GB/s as `name`. With
// `software` the pattern is kMessagesPerRound 64 KiB WRITEs of WRITE ONLY
// packets, and both sides do the work of build_write and check_write.
void throughput(int a, int b, char* buffer, const std::vector<Send>& pattern, const char* name, bool software = false) {
  size_t bytes_per_round = 0;
  for (const Send& one : pattern) bytes_per_round += one.bytes();
  const long rounds = static_cast<long>(2600000000.0 / static_cast<double>(bytes_per_round));
  int on = 1;
  setsockopt(b, SOL_UDP, UDP_GRO, &on, sizeof on);
  std::fflush(stdout);  // before fork: the child must not repeat it
  pid_t child = fork();
  if (child == 0) {
    size_t received = 0;
    double bytes = 0;
    std::chrono::steady_clock::time_point first{}, last{};
    auto idle_since = std::chrono::steady_clock::now();
    std::vector<uint8_t> memory(kWritePackets * kPathMtu);
    size_t memory_at = 0, bad = 0;
    while (received < bytes_per_round * rounds) {
      ssize_t got;
      if (software) {
        // As softverbs reads: the GRO segment size comes with the datagrams.
        iovec data{buffer, 65536};
        softverbs::UdpGroControl control;
        msghdr message{};
        message.msg_iov = &data;
        message.msg_iovlen = 1;
        message.msg_control = control.bytes;
        message.msg_controllen = sizeof control.bytes;
        got = recvmsg(b, &message, MSG_DONTWAIT);
        if (got > 0) {
          const size_t segment = softverbs::udp_gro_segment(message, static_cast<size_t>(got));
          bad += check_write(std::span(reinterpret_cast<const uint8_t*>(buffer), static_cast<size_t>(got)), segment,
                             memory.data(), memory_at);
        }
      } else {
        got = recv(b, buffer, 65536, MSG_DONTWAIT);
      }
      if (got > 0) {
        last = std::chrono::steady_clock::now();
        if (received == 0)
          first = last;
        else
          bytes += got;  // what arrived after the clock started
        received += got;
        idle_since = last;
      } else if (std::chrono::steady_clock::now() - idle_since > std::chrono::milliseconds(500)) {
        break;  // the sender is done; the rest was dropped
      }
    }
    double seconds = std::chrono::duration<double>(last - first).count();
    if (bad != 0) std::fprintf(stderr, "%s: %zu datagrams with a wrong CRC\n", name, bad);
    std::printf("%s value=%.3f\n", name, seconds > 0 && bad == 0 ? bytes / seconds / 1e9 : 0.0);
    std::fflush(stdout);
    _exit(0);
  }
  std::vector<uint8_t> application(kWritePackets * kPathMtu, 0x5a);
  for (long i = 0; i < rounds; ++i) {
    if (software)
      for (size_t message = 0, at = 0; message < kMessagesPerRound; ++message)
        at += build_write(application.data(), reinterpret_cast<uint8_t*>(buffer) + at);
    for (size_t offset = 0; const Send& one : pattern) {
      send_datagrams(a, buffer + offset, one);
      if (software) offset += one.bytes();
    }
  }
  waitpid(child, nullptr, 0);
  int off = 0;
  setsockopt(b, SOL_UDP, UDP_GRO, &off, sizeof off);
}

// Prints the median and 99th percentile of one-way times as `name`.
void print_one_way(const char* name, std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  std::printf("%s median=%.3f p99=%.3f\n", name, samples[samples.size() / 2], samples[samples.size() * 99 / 100]);
}

// One side of the woken ping-pong: `first` sends first. Returns the one-way
// times, as the busy-polling ping-pong measures them.
std::vector<double> woken_side(int fd, int iterations, bool first) {
  std::atomic<long> arrived{0};
  std::thread receiver([&] {
    char buffer[64];
    for (long i = 0; i < iterations; ++i) {
      if (recv(fd, buffer, sizeof buffer, 0) < 0) break;
      arrived.store(i + 1, std::memory_order_release);
    }
  });
  std::vector<double> samples;
  char message[2] = {};
  for (long i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    if (first) send(fd, message, sizeof message, 0);
    while (arrived.load(std::memory_order_acquire) < i + 1) {
    }
    if (!first) send(fd, message, sizeof message, 0);
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 2);
  }
  receiver.join();
  return samples;
}

}  // namespace

constexpr const char* kParts[] = {
    "busy", "woken", "roce", "throughput", "roce_write", "roce_write_software", "roce_write_message", "mtu_throughput"};

// SENDER_ADDRESS@NETNS,RECEIVER_ADDRESS@NETNS into two places.
bool parse_places(const char* text, Place& sender, Place& receiver) {
  const std::string both(text);
  const size_t comma = both.find(',');
  if (comma == std::string::npos) return false;
  for (auto [one, place] : {std::pair{both.substr(0, comma), &sender}, std::pair{both.substr(comma + 1), &receiver}}) {
    const size_t at = one.find('@');
    if (inet_pton(AF_INET, one.substr(0, at).c_str(), &place->address) != 1) return false;
    if (at != std::string::npos) place->netns = one.substr(at + 1);
  }
  return true;
}

// Which measurements to make: all by default, or those named in a
// comma-separated list, so that bench/run can measure a baseline again just
// before each run it compares with it. Returns false, with the name in
// `unknown`, if one is not a measurement.
bool parse_parts(const char* list, std::set<std::string>& parts, std::string& unknown) {
  if (list == nullptr) {
    parts.insert(std::begin(kParts), std::end(kParts));
    return true;
  }
  std::istringstream names{std::string(list)};
  for (std::string name; std::getline(names, name, ',');) {
    if (std::find(std::begin(kParts), std::end(kParts), name) == std::end(kParts)) {
      unknown = name.empty() ? "," : name;
      return false;
    }
    parts.insert(name);
  }
  return true;
}

// A busy-polling ping-pong: a forked child echoes on `b` what `a` sends,
// each side sending with `send_one`; the one-way times `a` saw, in us.
template <typename SendOne>
std::vector<double> ping_pong(int a, int b, int iterations, char* buffer, size_t size, SendOne send_one) {
  std::fflush(stdout);  // before fork: the child must not repeat it
  pid_t child = fork();
  if (child == 0) {
    for (int i = 0; i < iterations; ++i) {
      spin_recv(b, buffer, size);
      send_one(b, buffer);
    }
    _exit(0);
  }
  std::vector<double> samples;
  for (int i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    send_one(a, buffer);
    spin_recv(a, buffer, size);
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 2);
  }
  waitpid(child, nullptr, 0);
  return samples;
}

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 50000;
  std::set<std::string> parts;
  std::string unknown;
  Place sender, receiver;
  if (!parse_parts(argc > 2 ? argv[2] : nullptr, parts, unknown) || iterations <= 0 ||
      (argc > 3 && !parse_places(argv[3], sender, receiver))) {
    std::string names;
    for (const char* part : kParts) names += (names.empty() ? "" : ",") + std::string(part);
    std::fprintf(stderr,
                 "usage: udp_pingpong [ITERATIONS > 0] [%s] [SENDER_ADDRESS@NETNS,RECEIVER_ADDRESS@NETNS]%s%s\n",
                 names.c_str(), unknown.empty() ? "" : ": unknown measurement ", unknown.c_str());
    return 2;
  }
  const auto wanted = [&](const char* part) { return parts.count(part) != 0; };
  uint16_t port_a, port_b;
  int a = bound_socket(port_a, sender), b = bound_socket(port_b, receiver);
  connect_to(a, port_b, receiver);
  connect_to(b, port_a, sender);
  static char buffer[kMessagesPerRound * kWritePackets * kWriteOnlyPacket] = {};  // 15 64 KiB WRITEs' packets
  if (wanted("busy"))
    print_one_way("udp_pingpong_one_way_us", ping_pong(a, b, iterations, buffer, sizeof buffer,
                                                       [](int fd, char* bytes) { send(fd, bytes, 2, 0); }));

  if (wanted("woken")) {
    std::fflush(stdout);
    const int woken_iterations = std::max(1000, iterations / 5);
    pid_t child = fork();
    if (child == 0) {
      woken_side(b, woken_iterations, false);
      _exit(0);
    }
    std::vector<double> woken = woken_side(a, woken_iterations, true);
    waitpid(child, nullptr, 0);
    print_one_way("udp_pingpong_woken_one_way_us", woken);
  }

  if (wanted("roce")) {
    // ib_write_lat's packets over RoCEv2: a 2-byte WRITE (BTH + RETH + 2 +
    // pad 2 + ICRC = 36 bytes) and an ACK (BTH + AETH + ICRC = 20 bytes).
    const Send write_and_ack{36, 1, 20};
    int on = 1, off = 0;
    setsockopt(a, SOL_UDP, UDP_GRO, &on, sizeof on);
    setsockopt(b, SOL_UDP, UDP_GRO, &on, sizeof on);
    print_one_way("udp_pingpong_roce_one_way_us",
                  ping_pong(a, b, iterations, buffer, sizeof buffer,
                            [&](int fd, char* bytes) { send_datagrams(fd, bytes, write_and_ack); }));
    setsockopt(a, SOL_UDP, UDP_GRO, &off, sizeof off);
    setsockopt(b, SOL_UDP, UDP_GRO, &off, sizeof off);
  }

  if (wanted("throughput")) throughput(a, b, buffer, {{65000, 1}}, "udp_throughput_GBps");
  if (wanted("mtu_throughput")) throughput(a, b, buffer, {{1472, 44}}, "udp_throughput_mtu_GBps");
  // 15 64 KiB WRITEs of 16 WRITE ONLY packets (4128 bytes each): 16 sends of 15.
  const std::vector<Send> write_only(kMessagesPerRound * kWritePackets / 15, Send{kWriteOnlyPacket, 15});
  if (wanted("roce_write")) throughput(a, b, buffer, write_only, "udp_throughput_roce_write_GBps");
  if (wanted("roce_write_software"))
    throughput(a, b, buffer, write_only, "udp_throughput_roce_write_software_GBps", true);
  // A 64 KiB WRITE as one message: first (4128) + middle (4112), then 13 middle + last.
  if (wanted("roce_write_message"))
    throughput(a, b, buffer, {{4128, 1, 4112}, {4112, 14}}, "udp_throughput_roce_write_message_GBps");
  return 0;
}
