#include "checker/registered_memory.h"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <string>

#include "checker/check_preload_interface.h"
#include "checker/report.h"

namespace softverbs::provider::check {

namespace {

std::atomic<int> live_regions{0};

void report_from_preload(const char* check, const char* what, const void* call_site) {
  Finding finding;
  finding.check = check;
  finding.what = what;
  finding.call_site = call_site;
  finding.backtrace_of_caller = true;
  report(finding);
}

const SoftverbsCheckReporter kReporter{kCheckPreloadVersion, report_from_preload};

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
  if (const SoftverbsCheckedRegions* preload = check_preload()) preload->deregistered(reinterpret_cast<uint64_t>(mr));
}

}  // namespace softverbs::provider::check
