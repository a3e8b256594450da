// Baselines for applications that sleep until their peer's message arrives
// (ib_*_lat -e, which wait on completion channels): one-way ping-pong
// latency between two processes where each side blocks in the kernel until
// the other's message wakes it. Over UDP loopback (both block in recv),
// over a pair of pipes, and over a pair of eventfds (both block in read).
// The cost of one cross-process wake-up on this machine: the floor for any
// event-driven latency.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// One direction of the ping-pong: `send` wakes the side blocked in
// `receive`. Both are blocking calls on file descriptors.
struct Link {
  int send_fd = -1;
  int receive_fd = -1;
};

using Transfer = bool (*)(int fd);

bool udp_send(int fd) {
  const char message[2] = {};
  return send(fd, message, sizeof message, 0) == sizeof message;
}

bool udp_receive(int fd) {
  char buffer[64];
  return recv(fd, buffer, sizeof buffer, 0) > 0;
}

bool pipe_send(int fd) {
  const char message[2] = {};
  return write(fd, message, sizeof message) == sizeof message;
}

bool pipe_receive(int fd) {
  char buffer[2];
  return read(fd, buffer, sizeof buffer) == sizeof buffer;
}

bool eventfd_send(int fd) {
  const uint64_t one = 1;
  return write(fd, &one, sizeof one) == sizeof one;
}

bool eventfd_receive(int fd) {
  uint64_t count;
  return read(fd, &count, sizeof count) == sizeof count;
}

// The child echoes on `back` each message of `forth`; the parent measures.
// Returns the one-way times the parent saw, in us.
std::vector<double> ping_pong(Link forth, Link back, int iterations, Transfer send_one, Transfer receive_one) {
  std::fflush(stdout);  // before fork: the child must not repeat it
  pid_t child = fork();
  if (child == 0) {
    for (int i = 0; i < iterations; ++i)
      if (!receive_one(forth.receive_fd) || !send_one(back.send_fd)) _exit(1);
    _exit(0);
  }
  std::vector<double> samples;
  samples.reserve(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (!send_one(forth.send_fd) || !receive_one(back.receive_fd)) break;
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 2);
  }
  int status = 0;
  waitpid(child, &status, 0);
  if (samples.size() != static_cast<size_t>(iterations) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return {};
  return samples;
}

bool print_one_way(const char* name, std::vector<double> samples) {
  if (samples.empty()) {
    std::fprintf(stderr, "%s: the ping-pong failed: %s\n", name, std::strerror(errno));
    return false;
  }
  std::sort(samples.begin(), samples.end());
  std::printf("%s median=%.3f p99=%.3f\n", name, samples[samples.size() / 2], samples[samples.size() * 99 / 100]);
  return true;
}

int udp_socket(uint16_t& port) {
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  port = ntohs(address.sin_port);
  return fd;
}

void connect_to(int fd, uint16_t port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
}

bool udp(int iterations) {
  uint16_t port_a, port_b;
  const int a = udp_socket(port_a), b = udp_socket(port_b);
  if (a < 0 || b < 0) return false;
  connect_to(a, port_b);
  connect_to(b, port_a);
  return print_one_way("blocking_udp_one_way_us", ping_pong({a, b}, {b, a}, iterations, udp_send, udp_receive));
}

bool pipes(int iterations) {
  int forth[2], back[2];
  if (pipe(forth) != 0 || pipe(back) != 0) return false;
  return print_one_way("blocking_pipe_one_way_us",
                       ping_pong({forth[1], forth[0]}, {back[1], back[0]}, iterations, pipe_send, pipe_receive));
}

bool eventfds(int iterations) {
  const int forth = eventfd(0, EFD_CLOEXEC), back = eventfd(0, EFD_CLOEXEC);
  if (forth < 0 || back < 0) return false;
  return print_one_way("blocking_eventfd_one_way_us",
                       ping_pong({forth, forth}, {back, back}, iterations, eventfd_send, eventfd_receive));
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 20000;
  const std::string parts = argc > 2 ? argv[2] : "udp,pipe,eventfd";
  if (iterations <= 0 || parts.empty()) {
    std::fprintf(stderr, "usage: blocking_pingpong [ITERATIONS > 0] [udp,pipe,eventfd]\n");
    return 2;
  }
  size_t start = 0;
  bool ok = true;
  while (start <= parts.size()) {
    const size_t end = std::min(parts.find(',', start), parts.size());
    const std::string part = parts.substr(start, end - start);
    if (part == "udp")
      ok = udp(iterations) && ok;
    else if (part == "pipe")
      ok = pipes(iterations) && ok;
    else if (part == "eventfd")
      ok = eventfds(iterations) && ok;
    else {
      std::fprintf(stderr, "blocking_pingpong: unknown measurement '%s' (udp, pipe, eventfd)\n", part.c_str());
      return 2;
    }
    start = end + 1;
  }
  return ok ? 0 : 1;
}
