// Runs a real process and captures what it prints: the integration tests'
// way of driving the `softverbs` command and rdma-core's tools.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace softverbs::test {

struct ProcessResult {
  int exit_code = -1;  // 128+N when killed by signal N
  std::string out;
  std::string err;
};

// argv[0] is looked up in PATH. `environment` entries ("NAME=value") are set
// on top of this process's environment. Killed after `timeout_seconds`.
ProcessResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& environment = {},
                          int timeout_seconds = 60);

struct PairResult {
  ProcessResult server;
  ProcessResult client;
};

// Runs `server` in the background and `client` once `ready()` says so (polled
// for up to 20 s), then waits for both.
template <typename Ready>
PairResult run_server_client(const std::vector<std::string>& server, const std::vector<std::string>& client,
                             const std::vector<std::string>& environment, Ready ready, int timeout_seconds = 60);

// The `sh -c` commands for a server that never exits by itself (cmtime's,
// io_demo's) and its client: the server's shell notes its pid in
// `pid_file`, and the client stops it once done, keeping its own status.
struct StoppedByClient {
  std::vector<std::string> server, client;
};
inline StoppedByClient server_stopped_by_client(const std::string& server, const std::string& client,
                                                const std::string& pid_file) {
  return {{"sh", "-c", server + " & echo $! > " + pid_file + "; wait $!"},
          {"sh", "-c", client + "; status=$?; kill $(cat " + pid_file + "); exit $status"}};
}

// A fresh empty directory under $TMPDIR (or /tmp), removed by the destructor.
class TemporaryDirectory {
 public:
  TemporaryDirectory();
  ~TemporaryDirectory();
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The whole of file `path` ("" if it cannot be read).
std::string read_file(const std::string& path);

// The unsigned number a process printed right after `label`; 0 if it
// printed no such line.
inline uint64_t number_after(const std::string& text, const std::string& label) {
  const size_t at = text.find(label);
  return at == std::string::npos ? 0 : std::strtoull(text.c_str() + at + label.size(), nullptr, 10);
}

}  // namespace softverbs::test

#include <chrono>
#include <future>
#include <thread>

template <typename Ready>
softverbs::test::PairResult softverbs::test::run_server_client(const std::vector<std::string>& server,
                                                               const std::vector<std::string>& client,
                                                               const std::vector<std::string>& environment, Ready ready,
                                                               int timeout_seconds) {
  auto background = std::async(std::launch::async, [&] { return run_process(server, environment, timeout_seconds); });
  for (int i = 0; i < 400 && !ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  PairResult result;
  result.client = run_process(client, environment, timeout_seconds);
  result.server = background.get();
  return result;
}
