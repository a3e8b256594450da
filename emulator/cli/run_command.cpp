// `softverbs run -- CMD ARGS...`: runs an unmodified program with the
// softverbs devices available, replacing this process with it.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
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

  for (const auto& [name, value] : sandbox_environment(registry, libraries, namespaced))
    setenv(name.c_str(), value.c_str(), 1);
  if (options.trace_file && !prepare_trace(*options.trace_file, &error)) {
    report_error("run: " + error);
    return kExitFailure;
  }
  if (options.adversarial_seed) setenv("SOFTVERBS_ADVERSARIAL", std::to_string(*options.adversarial_seed).c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& word : options.command) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  int saved = errno;
  report_error(std::string("run: cannot run '") + argv[0] + "': " + std::strerror(saved));
  return saved == ENOENT ? 127 : 126;
}

}  // namespace softverbs::cli
