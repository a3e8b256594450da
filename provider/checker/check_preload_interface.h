// How the provider and libsoftverbs-check.so (the check preload, loaded by
// `softverbs run` in check mode only) talk: the provider tells it which
// ranges registered regions cover; it interposes munmap and free, and
// tells the provider of each live region a range freed lies under. The
// provider finds the preload's attach function with dlsym, as it finds the
// event preload's (preload_interface.h).
#pragma once

#include <cstdint>

extern "C" {

// What the provider offers the check preload.
struct SoftverbsCheckReporter {
  uint32_t version;  // kCheckPreloadVersion
  // Memory under the region `identity` was given back (`what`: by which
  // call, which range); `call_site` is the application's return address in
  // munmap or free. Called on the freeing thread.
  void (*freed)(uint64_t identity, const char* what, const void* call_site);
};

// What the check preload offers the provider: the live regions, each named
// by an identity of the provider's (its ibv_mr).
struct SoftverbsCheckedRegions {
  uint32_t version;  // kCheckPreloadVersion
  void (*registered)(uint64_t identity, uint64_t start, uint64_t length);
  void (*deregistered)(uint64_t identity);
};

using SoftverbsAttachCheckPreload = const SoftverbsCheckedRegions* (*)(const SoftverbsCheckReporter* reporter);
}

namespace softverbs {
inline constexpr uint32_t kCheckPreloadVersion = 2;
inline constexpr const char* kAttachCheckPreloadSymbol = "softverbs_check_preload_attach";
}  // namespace softverbs
