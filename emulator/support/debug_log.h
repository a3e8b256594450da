// Why a work request failed, for users chasing an error status:
// SOFTVERBS_DEBUG=1 prints one line per failure to stderr.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <cstdlib>

namespace softverbs {

inline bool debug_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("SOFTVERBS_DEBUG");
    return value != nullptr && *value != '\0' && *value != '0';
  }();
  return enabled;
}

__attribute__((format(printf, 1, 2))) inline void debug_log(const char* format, ...) {
  if (!debug_enabled()) return;
  va_list args;
  va_start(args, format);
  std::fputs("softverbs: ", stderr);
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  va_end(args);
}

}  // namespace softverbs
