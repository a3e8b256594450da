// Delegation to the real librdmacm where a kernel rdma_cm and real devices
// exist, so that one binary drives emulated and real NICs alike.
// SOFTVERBS_RDMACM=emu (always emulate), real (always delegate) or auto
// (delegate when /dev/infiniband/rdma_cm can be opened; the default).
// SOFTVERBS_RDMACM_REAL names the library to load; else the distribution's.
#pragma once

#include <dlfcn.h>

namespace softverbs::cm {

// The real library's handle, or nullptr when this process emulates.
void* real_librdmacm();

// The real library's `name` in version node `version`; aborts with a message
// if it is missing (the real library would have it).
void* real_symbol(const char* name, const char* version);

}  // namespace softverbs::cm

// In an exported function: hands the call to the real librdmacm when
// delegating. `version` is the symbol's node in librdmacm.map.
#define SOFTVERBS_FORWARD(name, version, ...)                                                                  \
  do {                                                                                                         \
    if (::softverbs::cm::real_librdmacm() != nullptr) {                                                        \
      static auto forwarded = reinterpret_cast<decltype(&name)>(::softverbs::cm::real_symbol(#name, version)); \
      return forwarded(__VA_ARGS__);                                                                           \
    }                                                                                                          \
  } while (0)
