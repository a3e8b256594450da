#include "process_runner.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <system_error>

extern char** environ;

namespace softverbs::test {

namespace {

// A /proc file of one line (or NUL-separated words, as cmdline) as one line.
std::string proc_line(const std::filesystem::path& path) {
  std::string text = read_file(path);
  std::replace(text.begin(), text.end(), '\0', ' ');
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

// What the processes of group `group` were doing when the run timed out:
// each thread's name, system call and kernel wait channel, and, where gdb is
// installed, every thread's stack, so that a hang seen once in CI can be
// told from the log.
std::string describe_hung_group(pid_t group) {
  std::string report = "[run_process: the processes of the timed-out run]\n";
  const bool have_gdb = std::system("command -v gdb >/dev/null 2>&1") == 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    if (getpgid(pid) != group) continue;
    report += "pid " + name + ": " + proc_line(entry.path() / "cmdline") + "\n";
    for (const auto& task : std::filesystem::directory_iterator(entry.path() / "task", ec))
      report += "  tid " + task.path().filename().string() + " " + proc_line(task.path() / "comm") + ": syscall " +
                proc_line(task.path() / "syscall") + ", wchan " + proc_line(task.path() / "wchan") + "\n";
    if (!have_gdb) continue;
    const std::string command =
        "timeout 30 gdb -nx -batch -p " + name + " -ex 'thread apply all bt' 2>/dev/null | grep -E '^(Thread|#)'";
    if (FILE* gdb = popen(command.c_str(), "r")) {
      char line[1024];
      while (std::fgets(line, sizeof line, gdb) != nullptr) report += std::string("  ") + line;
      pclose(gdb);
    }
  }
  return report;
}

}  // namespace

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

ProcessResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& environment,
                          int timeout_seconds) {
  ProcessResult result;
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) return result;

  std::map<std::string, std::string> variables;
  for (char** entry = environ; *entry; ++entry) {
    std::string text = *entry;
    size_t eq = text.find('=');
    if (eq != std::string::npos) variables[text.substr(0, eq)] = text.substr(eq + 1);
  }
  for (const auto& text : environment) {
    size_t eq = text.find('=');
    if (eq != std::string::npos) variables[text.substr(0, eq)] = text.substr(eq + 1);
  }
  std::vector<std::string> env_strings;
  for (const auto& [name, value] : variables) env_strings.push_back(name + "=" + value);
  std::vector<char*> envp, args;
  for (auto& text : env_strings) envp.push_back(text.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& text : argv_copy) args.push_back(text.data());
  args.push_back(nullptr);

  pid_t pid = fork();
  if (pid == 0) {
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    int null_fd = open("/dev/null", O_RDONLY);
    dup2(null_fd, 0);
    setpgid(0, 0);
    execvpe(args[0], args.data(), envp.data());
    dprintf(2, "exec %s: %s\n", args[0], strerror(errno));
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_count = 2;
  bool timed_out = false;
  while (open_count > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    if (poll(fds, 2, static_cast<int>(left.count())) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP))) continue;
      char buffer[4096];
      ssize_t n = read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<size_t>(n));
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_count;
      }
    }
  }
  if (timed_out) {
    result.err += describe_hung_group(pid);
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
    result.err += "\n[run_process: killed after " + std::to_string(timeout_seconds) + " s]\n";
  }
  for (auto& fd : fds)
    if (fd.fd >= 0) close(fd.fd);
  int status = 0;
  waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

TemporaryDirectory::TemporaryDirectory() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/softverbs-test-XXXXXX";
  if (char* made = mkdtemp(pattern.data())) path_ = made;
  // Readable by other users: some tests run the CLI as nobody.
  chmod(path_.c_str(), 0755);
}

TemporaryDirectory::~TemporaryDirectory() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace softverbs::test
