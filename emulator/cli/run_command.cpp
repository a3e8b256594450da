// `softverbs run -- CMD ARGS...`: runs an unmodified program with the
// softverbs devices available, replacing this process with it.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <vector>

#include "cli_commands.h"
#include "host/sysfs_tree.h"
#include "library_paths.h"
#include "sandbox.h"

namespace softverbs::cli {

namespace {

constexpr const char* kRunHelp =
    "usage: softverbs run [--no-namespace] [--] CMD [ARGS...]\n"
    "\n"
    "Runs CMD with the softverbs devices available (softverbs0 on lo is brought up\n"
    "first if no device is up). CMD runs in a private mount namespace in which the\n"
    "devices appear under /sys/class/infiniband and /dev/infiniband, so tools that read\n"
    "/sys directly see them too; a non-root user gets a user namespace for that, and\n"
    "keeps their own uid inside.\n"
    "\n"
    "  --no-namespace  use only environment variables (SYSFS_PATH, RDMAV_DRIVERS,\n"
    "                  LD_PRELOAD); needs /dev/infiniband/uverbsN (`sudo softverbs up`).\n"
    "\n"
    "Exit status: CMD's; 127 if CMD cannot be found, 126 if it cannot be run,\n"
    "1 if the devices cannot be provided, 2 on bad usage.\n";

std::string missing_device_fix(const std::vector<DeviceConfig>& devices, const std::string& why) {
  std::string entries;
  for (const auto& config : devices)
    entries += (entries.empty() ? "" : ", ") + ("/dev/infiniband/" + config.uverbs_name());
  return "cannot provide " + entries + " (" + why + ").\nFix: run `sudo softverbs up` once (root creates " + entries +
         "), or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu "
         "24.04 also sysctl kernel.apparmor_restrict_unprivileged_userns=0).";
}

}  // namespace

int command_run(std::span<char*> args) {
  bool use_namespace = true;
  size_t first = 0;
  for (; first < args.size(); ++first) {
    const char* arg = args[first];
    if (std::strcmp(arg, "--") == 0) {
      ++first;
      break;
    }
    if (std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0) {
      std::cout << kRunHelp;
      return kExitOk;
    }
    if (std::strcmp(arg, "--no-namespace") == 0) {
      use_namespace = false;
      continue;
    }
    if (arg[0] == '-') {
      report_error(std::string("run: unknown option '") + arg + "'\n" + kRunHelp);
      return kExitUsage;
    }
    break;  // the command starts here
  }
  if (first >= args.size()) {
    report_error(std::string("run: no command given\n") + kRunHelp);
    return kExitUsage;
  }

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
  std::vector<char*> argv(args.begin() + static_cast<std::ptrdiff_t>(first), args.end());
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  int saved = errno;
  report_error(std::string("run: cannot run '") + argv[0] + "': " + std::strerror(saved));
  return saved == ENOENT ? 127 : 126;
}

}  // namespace softverbs::cli
