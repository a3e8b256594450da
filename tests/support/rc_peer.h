// Two processes, each with an RC QP connected to the other's, for tests
// that start a peer process: the child is forked before either opens the
// device, as two programs would be. Each side is an Endpoint
// (rc_endpoint.h); they exchange ConnectInfos over a socket.
#pragma once

#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_status.h"
#include "process_runner.h"
#include "rc_endpoint.h"

namespace softverbs::test {

using Clock = std::chrono::steady_clock;

inline bool write_all(int fd, const void* data, size_t size) {
  return ::write(fd, data, size) == static_cast<ssize_t>(size);
}
inline bool read_all(int fd, void* data, size_t size) {
  auto* at = static_cast<char*>(data);
  while (size > 0) {
    ssize_t got = ::read(fd, at, size);
    if (got <= 0) return false;
    at += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

// A child process with an endpoint connected to the parent's; `body` runs
// in the child once connected, with the socket to the parent.
template <typename Body>
pid_t spawn_peer(int socket_fd, size_t buffer_bytes, int depth, uint8_t timeout, uint8_t retry_count, Body body) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // a test that fails or times out leaves no peer behind
  int code;
  {
    // Destroyed before the exit, as a program's resources are: its QP's
    // last ACK leaves then.
    Endpoint child;
    ConnectInfo mine, theirs;
    if (!child.open(buffer_bytes, depth)) _exit(10);
    mine = child.info();
    if (!write_all(socket_fd, &mine, sizeof mine) || !read_all(socket_fd, &theirs, sizeof theirs)) _exit(11);
    if (!child.connect(theirs, timeout, retry_count)) _exit(12);
    code = body(child, socket_fd);
  }
  _exit(code);
}

// The parent's side of the connection.
inline bool connect_to_peer(Endpoint& self, int socket_fd, uint8_t timeout, uint8_t retry_count, ConnectInfo& peer) {
  ConnectInfo mine = self.info();
  if (!read_all(socket_fd, &peer, sizeof peer) || !write_all(socket_fd, &mine, sizeof mine)) return false;
  return self.connect(peer, timeout, retry_count);
}

// The parent's endpoint, opened and connected, once the child says it is
// ready (one byte on the socket).
inline bool open_connected(Endpoint& self, int socket_fd, size_t buffer_bytes, int depth, uint8_t timeout,
                           uint8_t retry_count, ConnectInfo& peer) {
  char ready;
  return self.open(buffer_bytes, depth) && connect_to_peer(self, socket_fd, timeout, retry_count, peer) &&
         read_all(socket_fd, &ready, 1);
}

inline std::vector<ibv_wc> poll_for(Endpoint& endpoint, size_t count, std::chrono::milliseconds patience) {
  std::vector<ibv_wc> out;
  auto deadline = Clock::now() + patience;
  while (out.size() < count && Clock::now() < deadline) {
    ibv_wc wc[16];
    int got = endpoint.poll(wc, 16);
    out.insert(out.end(), wc, wc + std::max(got, 0));
  }
  return out;
}

// Polls busily for `how_long` (so that the background thread takes the
// application for a polling one and steps aside); false if a poll found a
// completion or failed.
inline bool polls_nothing_for(Endpoint& endpoint, std::chrono::milliseconds how_long) {
  const auto until = Clock::now() + how_long;
  while (Clock::now() < until) {
    ibv_wc wc;
    if (endpoint.poll(&wc, 1) != 0) return false;
  }
  return true;
}

// A counter of the device, as `softverbs stat` prints it (UINT64_MAX if it
// cannot be read).
inline uint64_t device_counter(const std::string& name) {
  const char* cli = std::getenv("SOFTVERBS_CLI");
  if (cli == nullptr) return UINT64_MAX;
  const auto stat = softverbs::test::run_process({cli, "stat", "softverbs0"});
  const auto counters = softverbs::test::parse_counters(stat.out);
  const auto it = counters.find(name);
  return stat.exit_code == 0 && it != counters.end() ? it->second : UINT64_MAX;
}

inline double implied_seconds(uint8_t timeout, uint8_t retry_count) {
  return (retry_count + 1) * 4.096e-6 * static_cast<double>(uint64_t{1} << timeout);
}

}  // namespace softverbs::test
