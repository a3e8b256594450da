// Reading what `softverbs status` prints, for tests that must name a GID
// index to rdma-core's tools (-g, perftest -x), and what `softverbs stat`
// prints, for tests that count packets, NAKs and waits.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace softverbs::test {

// The full form in which `softverbs status` lists the IPv4-mapped GID of
// `address` (a.b.c.d): 0000:0000:0000:0000:0000:ffff:7f00:0001 for 127.0.0.1.
std::string ipv4_mapped_gid(const std::string& address);

// The index of the RoCE v2 GID `gid` (in that full form) in `status`, the
// output of `softverbs status`; "" if it lists no such GID.
std::string roce_v2_gid_index(const std::string& status, const std::string& gid);

// The counters in `stat`, the output of `softverbs stat DEVICE`, by name.
std::map<std::string, uint64_t> parse_counters(const std::string& stat);

// Whether a process of the device in runtime directory `runtime` has an
// rdma_cm listener (its entry in the directory's cm/): a client may start.
bool rdmacm_listening(const std::string& runtime);

}  // namespace softverbs::test
