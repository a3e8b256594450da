#include "mckey_group.h"

#include <chrono>
#include <future>
#include <thread>

namespace softverbs::test {

McKeyGroup run_mckey_group(const std::string& cli, const std::vector<std::string>& environment,
                           const std::string& scratch_dir, const std::string& group, const std::string& bind_address,
                           const std::vector<int>& qps_per_receiver, int count) {
  // Receivers print as they go (stdbuf), so that the sender starts once
  // they have joined (mckey posts its receives before it joins, and waits
  // 3 s after joining before it sends).
  std::vector<std::string> outputs;
  std::vector<std::future<ProcessResult>> receiving;
  for (size_t i = 0; i < qps_per_receiver.size(); ++i) {
    outputs.push_back(scratch_dir + "/mckey-receiver-" + std::to_string(i) + ".out");
    const std::string command = cli + " run -- stdbuf -oL mckey -m " + group + " -b " + bind_address + " -C " +
                                std::to_string(count) + " -c " + std::to_string(qps_per_receiver[i]) + " > " +
                                outputs.back();
    receiving.push_back(std::async(std::launch::async, [command, environment] {
      return run_process({"sh", "-c", command}, environment, 60);
    }));
  }
  auto all_joined = [&] {
    for (const std::string& output : outputs)
      if (read_file(output).find("joined dgid") == std::string::npos) return false;
    return true;
  };
  for (int i = 0; i < 400 && !all_joined(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  McKeyGroup result;
  result.sender = run_process(
      {cli, "run", "--", "mckey", "-m", group, "-s", "-b", bind_address, "-C", std::to_string(count)}, environment, 60);
  for (auto& receiver : receiving) result.receivers.push_back(receiver.get());
  for (const std::string& output : outputs) result.receiver_outputs.push_back(read_file(output));
  return result;
}

}  // namespace softverbs::test
