// The `softverbs` command: brings emulated RDMA devices up and down, runs
// programs on them and shows their state. CLI11 parses and checks the
// command line and writes every --help; the commands get checked values.
#include <CLI/CLI.hpp>
#include <iostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cli_commands.h"
#include "host/device_config.h"
#include "host/netdev.h"
#include "install_paths.h"
#include "udp/fault_injection.h"

namespace {

using namespace softverbs;
using namespace softverbs::cli;

std::string joined(const std::vector<std::string>& items) {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : ", ") + item;
  return text;
}

const CLI::Validator kDeviceName(
    [](std::string& name) {
      return is_valid_device_name(name)
                 ? std::string()
                 : "invalid device name '" + name +
                       "': use 1 to 63 of the characters A-Z a-z 0-9 _ . -, starting with a letter or digit";
    },
    "NAME");

const CLI::Validator kNetdev(
    [](std::string& netdev) {
      return query_netdev(netdev)
                 ? std::string()
                 : "no network device '" + netdev + "' (this namespace has: " + joined(list_netdevs()) + ")";
    },
    "IF");

const CLI::Validator kFaultSpec(
    [](std::string& spec) {
      std::string why;
      return FaultSettings::parse(spec, &why) ? std::string() : why;
    },
    "SPEC");

// A SPEC has '=' or is "none"; anything else names a device.
bool is_fault_spec(const std::string& word) { return word.find('=') != std::string::npos || word == "none"; }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "Emulated RDMA devices: bring them up and down, run unmodified RDMA programs on them, "
      "and show their state, counters and traffic.",
      "softverbs");
  app.set_version_flag("--version", std::string("softverbs ") + SOFTVERBS_VERSION);
  app.require_subcommand(1, 1);
  app.footer("`softverbs COMMAND --help` describes each command.");

  UpOptions up;
  std::string transport_text, faults_text;
  CLI::App* up_command = app.add_subcommand("up", "create or refresh an emulated RDMA device");
  up_command->footer(
      "Creates the device NAME on network device IF, or refreshes it if it exists (its GIDs follow IF's current\n"
      "addresses). Run as root it also creates /dev/infiniband/uverbsN, which lets programs use the device\n"
      "without `softverbs run` (see `softverbs env`). A refresh without --transport or --faults keeps the\n"
      "device's settings.");
  up_command->add_option("--name", up.name, "the device's name")->capture_default_str()->check(kDeviceName);
  up_command->add_option("--netdev", up.netdev, "the network device its port sits on")
      ->capture_default_str()
      ->check(kNetdev);
  up_command
      ->add_option("--transport", transport_text,
                   "auto: shared memory for peers on this device, UDP (RoCEv2) for GIDs elsewhere when IF is not a "
                   "loopback device (a new device's default); shm: shared memory only; udp: RoCEv2 over UDP port "
                   "4791 for every connection, even on this host")
      ->check(CLI::IsMember({"auto", "shm", "udp"}));
  up_command->add_option("--faults", faults_text, "fault injection on the UDP transport (see `softverbs faults`)")
      ->check(kFaultSpec);

  DownOptions down;
  CLI::App* down_command = app.add_subcommand("down", "remove a device");
  down_command->footer(
      "Programs that have the device open see what an HCA's removal gives them: IBV_EVENT_DEVICE_FATAL,\n"
      "their QPs in the error state with their work flushed, and EIO from verbs that create objects.");
  CLI::Option* down_name =
      down_command->add_option("NAME", down.name, "the device")->capture_default_str()->check(kDeviceName);
  down_command->add_flag("--all", down.all, "every device")->excludes(down_name);

  std::string status_name;
  CLI::App* status_command = app.add_subcommand("status", "show devices, ports, GIDs and the processes using them");
  status_command->add_option("NAME", status_name, "only this device")->check(kDeviceName);

  CLI::App* env_command = app.add_subcommand("env", "print export lines for `eval \"$(softverbs env)\"`");
  env_command->footer(
      "The lines make libibverbs in this shell find softverbs devices. Programs started this way need\n"
      "/dev/infiniband/uverbsN (`sudo softverbs up` creates it); `softverbs run` needs neither.");

  RunOptions run;
  bool no_namespace = false;
  CLI::App* run_command =
      app.add_subcommand("run", "run an unmodified RDMA program with the devices available: run [--] CMD [ARGS...]");
  run_command->footer(
      "Runs CMD (softverbs0 on lo is brought up first if no device is up) in a private mount namespace in\n"
      "which the devices appear under /sys/class/infiniband and /dev/infiniband, so tools that read /sys\n"
      "directly see them too; a non-root user gets a user namespace for that and keeps their uid inside.\n"
      "Exit status: CMD's; 127 if CMD cannot be found, 126 if it cannot be run, 1 if the devices cannot\n"
      "be provided, 2 on bad usage.");
  run_command->add_flag("--no-namespace", no_namespace,
                        "use only environment variables (SYSFS_PATH, RDMAV_DRIVERS, LD_PRELOAD); needs "
                        "/dev/infiniband/uverbsN (`sudo softverbs up`)");
  // CMD and everything after it are CMD's, its options included: they are
  // split off before CLI11 parses (see below), which sees run's own options.
  std::vector<std::string> run_cmd_placeholder;
  run_command->add_option("CMD", run_cmd_placeholder, "the program and its arguments (after `--` if it starts with -)");

  StatOptions stat;
  CLI::App* stat_command =
      app.add_subcommand("stat", "show the UDP transport's counters (packets, retransmissions, NAKs, drops)");
  stat_command->footer(
      "The counters are summed over every process that used the device: packets and bytes sent and\n"
      "received, retransmissions, ACK timeouts, NAKs sent and received (PSN sequence, RNR, errors),\n"
      "duplicates, drops (bad ICRC, malformed, unknown QP, wrong source) and injected faults; then what\n"
      "the device holds: live processes, QPs, CQs, SRQs, MRs and the bytes of device memory in use.");
  stat_command->add_option("NAME", stat.name, "only this device (default: every device)")->check(kDeviceName);
  stat_command->add_flag("--reset", stat.reset, "set the counters to zero");

  std::vector<std::string> faults_words;
  CLI::App* faults_command =
      app.add_subcommand("faults", "show or set fault injection (loss, duplicate, reorder, delay, corrupt)");
  faults_command->footer(
      "Running processes follow a change at once. SPEC is a comma-separated list of KEY=VALUE, or `none`:\n"
      "  loss=R       drop a packet           duplicate=R  send a packet twice\n"
      "  reorder=R    hold a packet back behind the next one of its QP\n"
      "  delay=R      hold a packet for delay_us microseconds (default 1000)\n"
      "  corrupt=R    flip a byte (the receiver's ICRC check drops it and counts it)\n"
      "  seed=N       the generator's seed: the same seed and traffic, the same faults\n"
      "Rates R are fractions (0.1) or percentages (10%) of the packets each QP sends.\n"
      "SOFTVERBS_FAULTS=SPEC in a program's environment overrides the device's setting for that program.");
  faults_command->add_option("WORDS", faults_words, "[NAME] [SPEC]: the device (default softverbs0), the settings")
      ->expected(0, 2)
      ->type_name("");

  CaptureOptions capture;
  CLI::App* capture_command = app.add_subcommand("capture", "write the device's RoCEv2 traffic to a pcap file");
  capture_command->footer(
      "Writes the RoCEv2 packets the device sends and receives over UDP, in every process that uses it,\n"
      "to FILE (pcap, raw IP frames) until interrupted (Ctrl-C) or for SECONDS. tshark and Wireshark\n"
      "decode them as InfiniBand over UDP port 4791. The shared-memory transport sends no packets.");
  capture_command->add_option("NAME", capture.name, "the device")->capture_default_str()->check(kDeviceName);
  capture_command->add_option("-w", capture.file, "the pcap file")->required()->type_name("FILE");
  capture_command->add_option("--duration", capture.seconds, "stop after this many seconds (default: at Ctrl-C)")
      ->check(CLI::PositiveNumber);

  CLI::App* version_command = app.add_subcommand("version", "print the version");

  // `run`'s command starts at `--` or at the first word that is not one of
  // run's options; CLI11 parses only what comes before it.
  int parsed_argc = argc;
  if (argc > 1 && std::string_view(argv[1]) == "run") {
    for (int i = 2; i < argc; ++i) {
      const std::string_view word = argv[i];
      if (word == "--") {
        run.command.assign(argv + i + 1, argv + argc);
        parsed_argc = i;
        break;
      }
      if (!word.starts_with('-')) {
        run.command.assign(argv + i, argv + argc);
        parsed_argc = i;
        break;
      }
    }
  }

  try {
    app.parse(parsed_argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help, --version
    const bool no_command = app.get_subcommands().empty();
    if (no_command && argc > 1 && argv[1][0] != '-')
      report_error(std::string("unknown command '") + argv[1] + "'");
    else
      report_error((no_command ? std::string() : app.get_subcommands().front()->get_name() + ": ") + e.what());
    CLI::App* where = no_command ? &app : app.get_subcommands().front();
    std::cerr << '\n' << where->help(no_command ? "" : "softverbs");
    return kExitUsage;
  }

  if (up_command->parsed()) {
    if (!transport_text.empty()) up.transport = parse_transport(transport_text);
    if (!faults_text.empty()) {
      std::string unused;  // checked by kFaultSpec
      const auto settings = FaultSettings::parse(faults_text, &unused);
      up.faults = settings->any() ? settings->to_string() : "none";
    }
    return command_up(up);
  }
  if (down_command->parsed()) return command_down(down);
  if (status_command->parsed()) return command_status(status_name);
  if (env_command->parsed()) return command_env();
  if (run_command->parsed()) {
    run.use_namespace = !no_namespace;
    if (run.command.empty()) {
      report_error("run: no command given");
      std::cerr << '\n' << run_command->help("softverbs");
      return kExitUsage;
    }
    return command_run(run);
  }
  if (stat_command->parsed()) return command_stat(stat);
  if (faults_command->parsed()) {
    FaultsOptions faults;
    bool named = false;
    for (const std::string& word : faults_words) {
      std::string* slot = is_fault_spec(word) ? (faults.spec ? nullptr : &faults.spec.emplace())
                                              : (std::exchange(named, true) ? nullptr : &faults.name);
      if (slot == nullptr) {
        report_error("faults: unexpected argument '" + word + "'");
        std::cerr << '\n' << faults_command->help("softverbs");
        return kExitUsage;
      }
      *slot = word;
    }
    return command_faults(faults);
  }
  if (capture_command->parsed()) return command_capture(capture);
  if (version_command->parsed()) {
    std::cout << "softverbs " << SOFTVERBS_VERSION << '\n';
    return kExitOk;
  }
  return kExitUsage;
}
