#include "library_paths.h"

#include <unistd.h>

#include <system_error>

#include "install_paths.h"

namespace softverbs::cli {

namespace fs = std::filesystem;

LibraryPaths locate_libraries() {
  LibraryPaths paths;
  paths.trace = locate_trace_library();
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path build_lib = exe.parent_path().parent_path() / "lib";
    if (fs::exists(build_lib / "libsoftverbs-rdmav34.so", ec) &&
        fs::exists(build_lib / "libsoftverbs-preload.so", ec)) {
      paths.provider_stem = (build_lib / "libsoftverbs").string();
      paths.preload = build_lib / "libsoftverbs-preload.so";
      paths.rdmacm_dir = build_lib / "rdmacm";
      paths.found = true;
      return paths;
    }
  }
  fs::path provider_dir = SOFTVERBS_INSTALLED_PROVIDER_DIR;
  paths.provider_stem = (provider_dir / "libsoftverbs").string();
  paths.preload = SOFTVERBS_INSTALLED_PRELOAD;
  paths.rdmacm_dir = SOFTVERBS_INSTALLED_RDMACM_DIR;
  paths.found = fs::exists(provider_dir / "libsoftverbs-rdmav34.so", ec) && fs::exists(paths.preload, ec);
  return paths;
}

fs::path locate_trace_library() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path built = exe.parent_path().parent_path() / "lib" / "libsoftverbs-trace.so";
    if (fs::exists(built, ec)) return built;
  }
  fs::path installed = SOFTVERBS_INSTALLED_TRACE;
  return fs::exists(installed, ec) ? installed : fs::path();
}

std::filesystem::path check_preload_path(const LibraryPaths& libraries) {
  return libraries.preload.parent_path() / "libsoftverbs-check.so";
}

}  // namespace softverbs::cli
