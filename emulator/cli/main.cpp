// The `softverbs` command: brings emulated RDMA devices up and down, runs
// programs on them and shows their state.
#include <cstring>
#include <iostream>
#include <span>

#include "cli_commands.h"
#include "install_paths.h"

namespace {

constexpr const char* kUsage =
    "usage: softverbs COMMAND [ARGS...]\n"
    "\n"
    "Commands:\n"
    "  up [--name NAME] [--netdev IF] [--transport auto|shm|udp] [--faults SPEC]\n"
    "                     create or refresh an emulated RDMA device (default softverbs0 on lo)\n"
    "  down [NAME|--all]  remove a device\n"
    "  status [NAME]      show devices, ports, GIDs and the processes using them\n"
    "  env                print export lines for `eval \"$(softverbs env)\"`\n"
    "  run [--] CMD ...   run an unmodified RDMA program with the devices available\n"
    "  stat [NAME]        show the UDP transport's counters (packets, retransmissions, NAKs, drops)\n"
    "  faults [NAME] [SPEC]  show or set fault injection (loss, duplicate, reorder, delay, corrupt)\n"
    "  capture [NAME] -w FILE  write the device's RoCEv2 traffic to a pcap file\n"
    "  version            print the version\n"
    "\n"
    "`softverbs COMMAND --help` describes each command.\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace softverbs::cli;
  if (argc < 2) {
    std::cerr << kUsage;
    return kExitUsage;
  }
  const char* command = argv[1];
  std::span<char*> rest(argv + 2, static_cast<size_t>(argc - 2));
  if (std::strcmp(command, "--help") == 0 || std::strcmp(command, "-h") == 0 || std::strcmp(command, "help") == 0) {
    std::cout << kUsage;
    return kExitOk;
  }
  if (std::strcmp(command, "version") == 0 || std::strcmp(command, "--version") == 0) {
    std::cout << "softverbs " << SOFTVERBS_VERSION << '\n';
    return kExitOk;
  }
  if (std::strcmp(command, "up") == 0) return command_up(rest);
  if (std::strcmp(command, "down") == 0) return command_down(rest);
  if (std::strcmp(command, "status") == 0) return command_status(rest);
  if (std::strcmp(command, "env") == 0) return command_env(rest);
  if (std::strcmp(command, "run") == 0) return command_run(rest);
  if (std::strcmp(command, "stat") == 0) return command_stat(rest);
  if (std::strcmp(command, "faults") == 0) return command_faults(rest);
  if (std::strcmp(command, "capture") == 0) return command_capture(rest);
  std::cerr << "softverbs: unknown command '" << command << "'\n\n" << kUsage;
  return kExitUsage;
}
