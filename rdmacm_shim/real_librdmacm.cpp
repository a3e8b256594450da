#include "real_librdmacm.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace softverbs::cm {

namespace {

// Where distributions put librdmacm; ours sits elsewhere (found first
// through LD_LIBRARY_PATH), so these are the real one.
constexpr const char* kCandidates[] = {"/usr/lib/x86_64-linux-gnu/librdmacm.so.1",
                                       "/usr/lib/aarch64-linux-gnu/librdmacm.so.1", "/usr/lib64/librdmacm.so.1",
                                       "/usr/lib/librdmacm.so.1"};

bool kernel_rdma_cm_available() {
  int fd = open("/dev/infiniband/rdma_cm", O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  close(fd);
  return true;
}

std::string own_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&real_librdmacm), &info) == 0 || info.dli_fname == nullptr) return {};
  char resolved[4096];
  return realpath(info.dli_fname, resolved) ? resolved : info.dli_fname;
}

void* load_real() {
  const char* mode = std::getenv("SOFTVERBS_RDMACM");
  std::string choice = mode ? mode : "auto";
  if (choice == "emu") return nullptr;
  if (choice == "auto" && !kernel_rdma_cm_available()) return nullptr;
  if (choice != "auto" && choice != "real") {
    std::fprintf(stderr, "softverbs: SOFTVERBS_RDMACM=%s is not auto, emu or real; emulating\n", choice.c_str());
    return nullptr;
  }
  std::string self = own_path();
  auto try_load = [&](const char* path) -> void* {
    char resolved[4096];
    if (realpath(path, resolved) == nullptr || self == resolved) return nullptr;
      // RTLD_DEEPBIND: the real library's internal calls must reach its own
      // functions, not ours, which come first in the global scope. (ASan
      // refuses RTLD_DEEPBIND; sanitizer builds only load the tests' stand-in.)
#if defined(__SANITIZE_ADDRESS__)
    constexpr int kBinding = 0;
#else
    constexpr int kBinding = RTLD_DEEPBIND;
#endif
    return dlopen(resolved, RTLD_NOW | RTLD_LOCAL | kBinding);
  };
  if (const char* explicit_path = std::getenv("SOFTVERBS_RDMACM_REAL")) {
    if (void* handle = try_load(explicit_path)) return handle;
    std::fprintf(stderr, "softverbs: cannot load %s: %s; emulating\n", explicit_path, dlerror());
    return nullptr;
  }
  for (const char* path : kCandidates)
    if (void* handle = try_load(path)) return handle;
  if (choice == "real") std::fprintf(stderr, "softverbs: no real librdmacm.so.1 found; emulating\n");
  return nullptr;
}

}  // namespace

void* real_librdmacm() {
  static void* handle = load_real();
  return handle;
}

void* real_symbol(const char* name, const char* version) {
  void* symbol = dlvsym(real_librdmacm(), name, version);
  if (symbol == nullptr) symbol = dlsym(real_librdmacm(), name);
  if (symbol == nullptr) {
    std::fprintf(stderr, "softverbs: the real librdmacm has no %s@%s\n", name, version);
    std::abort();
  }
  return symbol;
}

}  // namespace softverbs::cm
