// Source GIDs and paths: which GIDs packets can leave from (an address of
// the netdev), and the path from one to a peer's GID.
#include "host/netdev.h"
#include "udp/engine.h"

namespace softverbs::udp {

using namespace wire;

bool PortEngine::source_gid_set(int sgid_index, std::string* error) const {
  if (sgid_index >= 0 && static_cast<size_t>(sgid_index) < gids_.size() && !gids_[sgid_index].gid.is_zero())
    return true;
  *error = "source GID index " + std::to_string(sgid_index) + " is empty";
  return false;
}

bool PortEngine::usable_source_gid(int sgid_index, std::string* error) const {
  if (!source_gid_set(sgid_index, error)) return false;
  const IpAddress& local = gids_[sgid_index].gid.raw;
  if (netdev_has_address(local)) return true;
  *error = "source GID index " + std::to_string(sgid_index) + " (" + format_address(local) + ") is not an address of " +
           config_.netdev +
           ": the UDP transport sends from and receives at the GID's IP address; the RoCE v2 GIDs of " +
           config_.netdev + "'s addresses are";
  const char* separator = " index ";
  for (size_t index = 0; index < gids_.size(); ++index) {
    if (gids_[index].type != GidType::RoceV2 || gids_[index].gid.is_zero() || !netdev_has_address(gids_[index].gid.raw))
      continue;
    *error += separator + std::to_string(index) + " (" + format_address(gids_[index].gid.raw) + ")";
    separator = ", ";
  }
  return false;
}

std::optional<Path> PortEngine::resolve_path(int sgid_index, const Gid& dgid, uint8_t traffic_class, uint8_t hop_limit,
                                             uint32_t flow_label, std::string* error) const {
  if (!source_gid_set(sgid_index, error)) return std::nullopt;
  const IpAddress& local = gids_[sgid_index].gid.raw;
  if (dgid.is_zero()) {
    *error = "the destination GID is zero";
    return std::nullopt;
  }
  if (is_ipv4_mapped(local) != is_ipv4_mapped(dgid.raw)) {
    *error = "source GID " + format_address(local) + " and destination GID " + format_address(dgid.raw) +
             " are of different IP families";
    return std::nullopt;
  }
  Path path;
  path.local = local;
  path.remote = dgid.raw;
  path.scope_id = is_link_local(dgid.raw) ? ifindex_ : 0;
  path.traffic_class = traffic_class;
  path.hop_limit = hop_limit != 0 ? hop_limit : 64;
  path.flow_label = flow_label;
  return path;
}

bool PortEngine::netdev_has_address(const IpAddress& address) const {
  std::lock_guard guard(netdev_addresses_mutex_);
  auto known = [&] {
    return std::find(netdev_addresses_.begin(), netdev_addresses_.end(), address) != netdev_addresses_.end();
  };
  if (known()) return true;
  auto netdev = query_netdev(config_.netdev);
  if (!netdev) return true;  // gone, or not readable here: sends will say
  netdev_addresses_.clear();
  for (const auto& v4 : netdev->ipv4_addresses) netdev_addresses_.push_back(Gid::from_ipv4(v4).raw);
  for (const auto& v6 : netdev->ipv6_addresses) netdev_addresses_.push_back(v6);
  return known();
}

}  // namespace softverbs::udp
