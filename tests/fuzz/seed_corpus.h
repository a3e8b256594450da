// libFuzzer targets seed an empty corpus directory (given on the command
// line) with inputs of their own, so that a first run starts from valid
// messages rather than from nothing.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace softverbs::fuzz {

inline void seed_empty_corpus(int argc, char** argv, const std::vector<std::vector<uint8_t>>& seeds) {
  namespace fs = std::filesystem;
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    if (arg[0] == '-' || !fs::is_directory(arg) || !fs::is_empty(arg)) continue;
    size_t n = 0;
    for (const auto& input : seeds) {
      std::ofstream out(fs::path(arg) / ("seed-" + std::to_string(n++)), std::ios::binary);
      out.write(reinterpret_cast<const char*>(input.data()), static_cast<std::streamsize>(input.size()));
    }
  }
}

}  // namespace softverbs::fuzz
