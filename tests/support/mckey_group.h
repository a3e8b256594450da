// rdma-core's mckey with several receivers and one sender in one multicast
// group, on a device already up in `environment`'s runtime directory.
#pragma once

#include <string>
#include <vector>

#include "process_runner.h"

namespace softverbs::test {

struct McKeyGroup {
  ProcessResult sender;
  std::vector<ProcessResult> receivers;
  std::vector<std::string> receiver_outputs;  // what each printed (stdout)
};

// One receiver per entry of `qps_per_receiver` (mckey -c), each expecting
// `count` datagrams; the sender starts once every receiver has joined.
McKeyGroup run_mckey_group(const std::string& cli, const std::vector<std::string>& environment,
                           const std::string& scratch_dir, const std::string& group, const std::string& bind_address,
                           const std::vector<int>& qps_per_receiver, int count);

}  // namespace softverbs::test
