// Locating the provider and the preload library: next to the binary in a
// build tree (bin/ and lib/), else where `cmake --install` put them.
#pragma once

#include <filesystem>
#include <string>

namespace softverbs::cli {

struct LibraryPaths {
  // RDMAV_DRIVERS value: the provider's path without "-rdmav34.so".
  std::string provider_stem;
  std::filesystem::path preload;
  std::filesystem::path rdmacm_dir;  // holds our librdmacm.so.1
  // libsoftverbs-trace.so (locate_trace_library), empty if it is nowhere.
  // Found with the others, before `softverbs run` enters its mount
  // namespace: inside a chroot, /proc/self/exe then names the binary by its
  // path outside the chroot.
  std::filesystem::path trace;
  bool found = false;
};

LibraryPaths locate_libraries();
// libsoftverbs-check.so, which `softverbs run` preloads in check mode.
std::filesystem::path check_preload_path(const LibraryPaths& libraries);

// libsoftverbs-trace.so, found the same way; empty if it is nowhere.
std::filesystem::path locate_trace_library();

}  // namespace softverbs::cli
