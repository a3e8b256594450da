// Baselines over UDP loopback: one-way ping-pong latency with busy-polling
// (non-blocking recv in a loop); the same ping-pong where each side's main
// thread spins on memory and a second thread, blocked in recv, sets it (what
// a software transport must do for an application, such as ib_write_lat,
// that waits for an RDMA WRITE by spinning on its buffer); one-way throughput with 64 KiB datagrams,
// and one-way throughput with datagrams the size of RoCEv2 packets at path
// MTU 4096 (4112 bytes: BTH + 4096 + ICRC), sent 14 at a time with UDP GSO
// and received with UDP_GRO, as the transport does. The floors for the
// RoCEv2-over-UDP transport.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

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

void spin_recv(int fd, char* buffer, size_t length) {
  while (recv(fd, buffer, length, MSG_DONTWAIT) < 0) {
  }
}

// The parent sends `per_send` datagrams of `size` bytes per send (UDP GSO
// when more than one) as fast as it can; the child counts the bytes that
// arrive between its first and last receive and prints GB/s as `name`.
void throughput(int a, int b, char* buffer, size_t size, int per_send, const char* name) {
  const long sends = 40000;
  const size_t bytes_per_send = size * per_send;
  if (per_send > 1) {
    int segment = static_cast<int>(size), on = 1;
    setsockopt(a, SOL_UDP, UDP_SEGMENT, &segment, sizeof segment);
    setsockopt(b, SOL_UDP, UDP_GRO, &on, sizeof on);
  }
  std::fflush(stdout);  // before fork: the child must not repeat it
  pid_t child = fork();
  if (child == 0) {
    long received = 0;
    double bytes = 0;
    std::chrono::steady_clock::time_point first{}, last{};
    auto idle_since = std::chrono::steady_clock::now();
    while (received < sends * per_send) {
      ssize_t got = recv(b, buffer, 65536, MSG_DONTWAIT);
      if (got > 0) {
        last = std::chrono::steady_clock::now();
        if (received == 0)
          first = last;
        else
          bytes += got;  // what arrived after the clock started
        received += (got + size - 1) / size;
        idle_since = last;
      } else if (std::chrono::steady_clock::now() - idle_since > std::chrono::milliseconds(500)) {
        break;  // the sender is done; the rest was dropped
      }
    }
    double seconds = std::chrono::duration<double>(last - first).count();
    std::printf("%s value=%.3f\n", name, seconds > 0 ? bytes / seconds / 1e9 : 0.0);
    std::fflush(stdout);
    _exit(0);
  }
  for (long i = 0; i < sends; ++i) send(a, buffer, bytes_per_send, 0);
  waitpid(child, nullptr, 0);
  int off = 0;
  setsockopt(a, SOL_UDP, UDP_SEGMENT, &off, sizeof off);
  setsockopt(b, SOL_UDP, UDP_GRO, &off, sizeof off);
}

// Prints the median and 99th percentile of one-way times as `name`.
void print_one_way(const char* name, std::vector<double>& samples) {
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

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 50000;
  uint16_t port_a, port_b;
  int a = bound_socket(port_a), b = bound_socket(port_b);
  connect_to(a, port_b);
  connect_to(b, port_a);
  char buffer[65536] = {};
  pid_t child = fork();
  if (child == 0) {
    for (int i = 0; i < iterations; ++i) {
      spin_recv(b, buffer, sizeof buffer);
      send(b, buffer, 2, 0);
    }
    _exit(0);
  }
  std::vector<double> samples;
  for (int i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    send(a, buffer, 2, 0);
    spin_recv(a, buffer, sizeof buffer);
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 2);
  }
  waitpid(child, nullptr, 0);
  print_one_way("udp_pingpong_one_way_us", samples);

  std::fflush(stdout);
  const int woken_iterations = std::max(1000, iterations / 5);
  child = fork();
  if (child == 0) {
    woken_side(b, woken_iterations, false);
    _exit(0);
  }
  std::vector<double> woken = woken_side(a, woken_iterations, true);
  waitpid(child, nullptr, 0);
  print_one_way("udp_pingpong_woken_one_way_us", woken);

  throughput(a, b, buffer, 65000, 1, "udp_throughput_GBps");
  throughput(a, b, buffer, 4112, 14, "udp_throughput_roce_sized_GBps");
  return 0;
}
