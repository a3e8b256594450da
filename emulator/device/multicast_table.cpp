#include "device/multicast_table.h"

#include <algorithm>
#include <cerrno>

#include "host/gid.h"

namespace softverbs {

MulticastTable::Group* MulticastTable::find(const Gid& gid) {
  for (Group& group : groups_)
    if (group.count != 0 && group.gid == gid) return &group;
  return nullptr;
}

const MulticastTable::Group* MulticastTable::find(const Gid& gid) const {
  for (const Group& group : groups_)
    if (group.count != 0 && group.gid == gid) return &group;
  return nullptr;
}

int MulticastTable::attach(const Gid& gid, uint32_t qpn) {
  if (!softverbs::Gid{gid}.is_multicast()) return EINVAL;
  Group* group = find(gid);
  if (group == nullptr) {
    auto empty = std::find_if(std::begin(groups_), std::end(groups_), [](const Group& g) { return g.count == 0; });
    if (empty == std::end(groups_)) return ENOMEM;
    group = &*empty;
    group->gid = gid;
  }
  if (std::find(group->qpns, group->qpns + group->count, qpn) != group->qpns + group->count) return 0;
  if (group->count == limits::kMaxMcastQpAttach) return ENOMEM;
  group->qpns[group->count++] = qpn;
  return 0;
}

int MulticastTable::detach(const Gid& gid, uint32_t qpn) {
  Group* group = find(gid);
  if (group == nullptr) return EINVAL;
  uint32_t* end = group->qpns + group->count;
  uint32_t* at = std::find(group->qpns, end, qpn);
  if (at == end) return EINVAL;
  *at = *(end - 1);
  --group->count;
  return 0;
}

void MulticastTable::detach_everywhere(uint32_t qpn) {
  for (Group& group : groups_) {
    if (group.count == 0) continue;
    uint32_t* end = group.qpns + group.count;
    uint32_t* at = std::find(group.qpns, end, qpn);
    if (at == end) continue;
    *at = *(end - 1);
    --group.count;
  }
}

std::vector<uint32_t> MulticastTable::members(const Gid& gid) const {
  const Group* group = find(gid);
  if (group == nullptr) return {};
  return std::vector<uint32_t>(group->qpns, group->qpns + group->count);
}

}  // namespace softverbs
