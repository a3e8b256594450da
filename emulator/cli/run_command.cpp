// `softverbs run -- CMD ARGS...`: runs an unmodified program with the
// softverbs devices available, replacing this process with it.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "cli_commands.h"
#include "host/sysfs_tree.h"
#include "library_paths.h"
#include "sandbox.h"

namespace softverbs::cli {

namespace {

std::string missing_device_fix(const std::vector<DeviceConfig>& devices, const std::string& why) {
  std::string entries;
  for (const auto& config : devices)
    entries += (entries.empty() ? "" : ", ") + ("/dev/infiniband/" + config.uverbs_name());
  return "cannot provide " + entries + " (" + why + ").\nFix: run `sudo softverbs up` once (root creates " + entries +
         "), or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu "
         "24.04 also sysctl kernel.apparmor_restrict_unprivileged_userns=0).";
}

// --check=error: the program's child, whose signals this process forwards.
volatile sig_atomic_t checked_child = 0;

void forward_signal(int signal_number) {
  if (checked_child > 0) kill(checked_child, signal_number);
}

// Runs `argv` as a child and returns its exit status, or 1 if it exited 0
// but a process of it reported a finding (a byte each in `count_file`).
int run_and_count_reports(std::vector<char*>& argv, const std::string& count_file) {
  const pid_t child = fork();
  if (child < 0) {
    report_error(std::string("run: fork: ") + std::strerror(errno));
    return kExitFailure;
  }
  if (child == 0) {
    execvp(argv[0], argv.data());
    const int saved = errno;
    report_error(std::string("run: cannot run '") + argv[0] + "': " + std::strerror(saved));
    _exit(saved == ENOENT ? 127 : 126);
  }
  checked_child = child;
  struct sigaction forward {};
  forward.sa_handler = forward_signal;
  sigemptyset(&forward.sa_mask);
  for (const int signal_number : {SIGINT, SIGTERM, SIGHUP}) sigaction(signal_number, &forward, nullptr);
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  struct stat counted {};
  const bool reported = stat(count_file.c_str(), &counted) == 0 && counted.st_size > 0;
  std::error_code ignored;
  std::filesystem::remove_all(std::filesystem::path(count_file).parent_path(), ignored);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  const int code = WEXITSTATUS(status);
  return code == 0 && reported ? 1 : code;
}

}  // namespace

int command_run(const RunOptions& options) {
  const bool use_namespace = options.use_namespace;
  LibraryPaths libraries = locate_libraries();
  if (!libraries.found) {
    report_error("run: cannot find libsoftverbs-rdmav34.so and libsoftverbs-preload.so (build or install softverbs)");
    return kExitFailure;
  }
  DeviceRegistry registry(default_runtime_dir());
  std::string error;
  auto devices = devices_or_default(registry, &error);
  if (!devices) {
    report_error("run: " + error);
    return kExitFailure;
  }
  link_real_devices(registry.sysfs_root(), "/sys");
  for (const auto& config : *devices) start_cm_watcher(config);  // before the program's namespaces
  for (const auto& config : *devices) {
    std::string ignored;  // another user's device: its entry is not ours to write, and stays as it is
    write_uverbs_entry(registry.sysfs_root(), config, &ignored);
  }
  if (geteuid() == 0) {
    for (const auto& config : *devices) {
      if (!ensure_dev_entry(config, &error)) {
        report_error("run: " + error);
        return kExitFailure;
      }
    }
  }

  bool namespaced = false;
  if (use_namespace) {
    switch (enter_device_namespace(registry, *devices, &error)) {
      case NamespaceOutcome::Entered:
        namespaced = true;
        break;
      case NamespaceOutcome::Unavailable:
        if (!dev_entries_exist(*devices)) {
          report_error("run: " + missing_device_fix(*devices, error));
          return kExitFailure;
        }
        break;  // the environment alone will do
      case NamespaceOutcome::Failed:
        report_error("run: " + missing_device_fix(*devices, error));
        return kExitFailure;
    }
  } else if (!dev_entries_exist(*devices)) {
    report_error("run: " + missing_device_fix(*devices, "--no-namespace was given"));
    return kExitFailure;
  }

  // Before the environment is made: check mode adds the check preload to it.
  if (options.check != CheckMode::Off) {
    setenv("SOFTVERBS_CHECK", options.check == CheckMode::Error ? "error" : "report", 1);
    if (!options.check_report.empty())
      setenv("SOFTVERBS_CHECK_REPORT", std::filesystem::absolute(options.check_report).c_str(), 1);
  }
  for (const auto& [name, value] : sandbox_environment(registry, libraries, namespaced))
    setenv(name.c_str(), value.c_str(), 1);
  if (options.rsockets) {
    // First of all: its socket() must be found before softverbs' preload's.
    std::string preload = (libraries.rdmacm_dir / "librspreload.so").string();
    if (const char* others = std::getenv("LD_PRELOAD"); others != nullptr && *others != '\0')
      preload += std::string(":") + others;
    setenv("LD_PRELOAD", preload.c_str(), 1);
  }
  if (options.trace_file && !prepare_trace(*options.trace_file, libraries.trace, &error)) {
    report_error("run: " + error);
    return kExitFailure;
  }
  if (options.adversarial_seed) setenv("SOFTVERBS_ADVERSARIAL", std::to_string(*options.adversarial_seed).c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& word : options.command) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  if (options.check == CheckMode::Error) {
    char directory[] = "/tmp/softverbs-check.XXXXXX";
    if (mkdtemp(directory) == nullptr) {
      report_error(std::string("run: cannot make a directory in /tmp: ") + std::strerror(errno));
      return kExitFailure;
    }
    const std::string count_file = std::string(directory) + "/reports";
    setenv("SOFTVERBS_CHECK_COUNT", count_file.c_str(), 1);
    return run_and_count_reports(argv, count_file);
  }
  execvp(argv[0], argv.data());
  int saved = errno;
  report_error(std::string("run: cannot run '") + argv[0] + "': " + std::strerror(saved));
  return saved == ENOENT ? 127 : 126;
}

}  // namespace softverbs::cli
