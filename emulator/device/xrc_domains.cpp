#include "device/xrc_domains.h"

#include <fcntl.h>

#include <cerrno>

namespace softverbs {

XrcDomainOpen XrcDomainTable::open(std::optional<InodeKey> inode, int oflags, int process) {
  XrcDomainRecord* domain = nullptr;
  if (inode) {
    for (XrcDomainRecord& candidate : domains_)
      if (candidate.id != 0 && candidate.by_inode && candidate.inode == *inode) domain = &candidate;
    if (domain == nullptr && !(oflags & O_CREAT)) return {EAGAIN};
    if (domain != nullptr && (oflags & O_EXCL)) return {EINVAL};
  }
  const bool fresh = domain == nullptr;
  if (fresh) {
    for (XrcDomainRecord& candidate : domains_)
      if (candidate.id == 0) {
        domain = &candidate;
        break;
      }
    if (domain == nullptr) return {ENOMEM};
  }
  XrcDomainRecord::Opener* slot = nullptr;
  for (auto& opener : domain->openers) {
    if (opener.opens != 0 && opener.process == process) {
      slot = &opener;
      break;
    }
    if (opener.opens == 0 && slot == nullptr) slot = &opener;
  }
  if (slot == nullptr) return {ENOMEM};
  if (fresh) {
    *domain = {};
    domain->id = next_id_++;
    if (next_id_ == 0) next_id_ = 1;
    domain->by_inode = inode.has_value();
    if (inode) domain->inode = *inode;
  }
  slot->process = process;
  ++slot->opens;
  return {0, static_cast<int>(domain - domains_), domain->id};
}

void XrcDomainTable::close(int index, uint32_t id, int process) {
  if (index < 0 || index >= kCapacity) return;
  XrcDomainRecord& domain = domains_[index];
  if (domain.id != id) return;
  for (auto& opener : domain.openers)
    if (opener.opens != 0 && opener.process == process) {
      if (--opener.opens == 0) opener = {};
      break;
    }
  free_if_unopened(domain);
}

void XrcDomainTable::free_if_unopened(XrcDomainRecord& domain) {
  for (const auto& opener : domain.openers)
    if (opener.opens != 0) return;
  domain.id = 0;
}

uint32_t XrcDomainTable::live_count() const {
  uint32_t count = 0;
  for (const XrcDomainRecord& domain : domains_) count += domain.id != 0;
  return count;
}

}  // namespace softverbs
