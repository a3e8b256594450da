#include "checker/registered_memory.h"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "checker/check_preload_interface.h"
#include "checker/report.h"

namespace softverbs::provider::check {

namespace {

std::atomic<int> live_regions{0};

// Regions whose memory the application gave back while they were live.
// Memory caches (UCX's, libfabric's) keep regions over memory the
// application frees and deregister them on the unmap, after it: that is
// harmless as long as no work request uses such a region again, so the
// report waits for one that does.
struct FreedRegion {
  const ibv_mr* mr;
  uint32_t lkey;
  std::string what;
  const void* freed_at;
  bool reported = false;
};
std::mutex freed_mutex;
std::vector<FreedRegion> freed_regions;
std::atomic<int> freed_count{0};

void region_freed(uint64_t identity, const char* what, const void* call_site) {
  const auto* mr = reinterpret_cast<const ibv_mr*>(identity);
  std::lock_guard guard(freed_mutex);
  for (const FreedRegion& region : freed_regions)
    if (region.mr == mr) return;  // the first give-back is the one to tell
  freed_regions.push_back(FreedRegion{mr, mr->lkey, what, call_site});
  freed_count.fetch_add(1, std::memory_order_release);
}

const SoftverbsCheckReporter kReporter{kCheckPreloadVersion, region_freed};

void report_use(const FreedRegion& region, ibv_qp* qp, uint64_t wr_id, std::string_view opcode, const void* call_site) {
  char lkey[16];
  std::snprintf(lkey, sizeof lkey, "0x%x", region.lkey);
  Finding finding;
  finding.check = "registered-memory-freed";
  finding.what = std::string("this work request uses the memory region of lkey ") + lkey +
                 ", whose memory was given back while it was registered (" + region.what + " at " +
                 describe_call_site(region.freed_at) +
                 "): an HCA keeps the old pages pinned and reads and writes them, unseen by whatever is mapped "
                 "there now (deregister the region before giving its memory back)";
  finding.qp_num = qp != nullptr ? qp->qp_num : 0;
  finding.wr_id = wr_id;
  finding.opcode = opcode;
  finding.call_site = call_site;
  report(finding);
}

// Reports the SGEs of one work request that name a region freed under it.
void check_sges(const ibv_sge* sges, int count, ibv_qp* qp, uint64_t wr_id, std::string_view opcode,
                const void* call_site) {
  std::lock_guard guard(freed_mutex);
  for (int i = 0; i < count; ++i)
    for (FreedRegion& region : freed_regions)
      if (!region.reported && region.lkey == sges[i].lkey) {
        region.reported = true;
        report_use(region, qp, wr_id, opcode, call_site);
      }
}

// The check preload, if `softverbs run` loaded it.
const SoftverbsCheckedRegions* check_preload() {
  static const SoftverbsCheckedRegions* const attached = []() -> const SoftverbsCheckedRegions* {
    auto attach = reinterpret_cast<SoftverbsAttachCheckPreload>(dlsym(RTLD_DEFAULT, kAttachCheckPreloadSymbol));
    return attach ? attach(&kReporter) : nullptr;
  }();
  return attached;
}

// On an HCA, the pages of a region are pinned in the parent: after fork()
// the first write to one (by either process) copies it, and the device
// goes on with the page the parent no longer has; ibv_fork_init (or
// RDMAV_FORK_SAFE) marks registered pages MADV_DONTFORK against that.
void before_fork() {
  if (live_regions.load(std::memory_order_relaxed) == 0 || ibv_is_fork_initialized() != IBV_FORK_DISABLED) return;
  Finding finding;
  finding.check = "fork-with-registered-memory";
  const int regions = live_regions.load(std::memory_order_relaxed);
  finding.what = "fork() with " + std::to_string(regions) + (regions == 1 ? " memory region" : " memory regions") +
                 " registered, without ibv_fork_init() or RDMAV_FORK_SAFE: on an HCA the parent's next write to a "
                 "registered page copies it, and the device goes on reading and writing the page the parent "
                 "lost";
  finding.backtrace_of_caller = true;
  report(finding);
}

}  // namespace

void region_registered(const ibv_mr* mr, const void* address, size_t length) {
  if (!enabled()) return;
  static const bool watching_fork = [] { return pthread_atfork(before_fork, nullptr, nullptr) == 0; }();
  (void)watching_fork;
  live_regions.fetch_add(1, std::memory_order_relaxed);
  if (const SoftverbsCheckedRegions* preload = check_preload())
    preload->registered(reinterpret_cast<uint64_t>(mr), reinterpret_cast<uint64_t>(address), length);
}

void region_deregistered(const ibv_mr* mr) {
  if (!enabled()) return;
  live_regions.fetch_sub(1, std::memory_order_relaxed);
  if (freed_count.load(std::memory_order_acquire) != 0) {
    std::lock_guard guard(freed_mutex);
    if (std::erase_if(freed_regions, [mr](const FreedRegion& region) { return region.mr == mr; }) != 0)
      freed_count.fetch_sub(1, std::memory_order_release);
  }
  if (const SoftverbsCheckedRegions* preload = check_preload()) preload->deregistered(reinterpret_cast<uint64_t>(mr));
}

void freed_regions_at_send(ibv_qp* qp, const ibv_send_wr* chain, const void* call_site) {
  if (freed_count.load(std::memory_order_acquire) == 0) return;
  for (const ibv_send_wr* wr = chain; wr != nullptr; wr = wr->next)
    if (!(wr->send_flags & IBV_SEND_INLINE))
      check_sges(wr->sg_list, wr->num_sge, qp, wr->wr_id, send_opcode_name(wr->opcode), call_site);
}

void freed_regions_at_receive(ibv_qp* qp, const ibv_recv_wr* chain, const void* call_site) {
  if (freed_count.load(std::memory_order_acquire) == 0) return;
  for (const ibv_recv_wr* wr = chain; wr != nullptr; wr = wr->next)
    check_sges(wr->sg_list, wr->num_sge, qp, wr->wr_id, "receive", call_site);
}

}  // namespace softverbs::provider::check
