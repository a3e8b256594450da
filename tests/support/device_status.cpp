#include "device_status.h"

#include <cstdio>
#include <filesystem>
#include <regex>
#include <sstream>

namespace softverbs::test {

std::string ipv4_mapped_gid(const std::string& address) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (std::sscanf(address.c_str(), "%u.%u.%u.%u", &a, &b, &c, &d) != 4) return "";
  char text[48];
  std::snprintf(text, sizeof text, "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x", a, b, c, d);
  return text;
}

std::string roce_v2_gid_index(const std::string& status, const std::string& gid) {
  std::smatch match;
  if (gid.empty() || !std::regex_search(status, match, std::regex("GID\\[(\\d+)\\] " + gid + "  RoCE v2"))) return "";
  return match[1].str();
}

std::map<std::string, uint64_t> parse_counters(const std::string& stat) {
  std::map<std::string, uint64_t> counters;
  std::istringstream in(stat);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name;
    uint64_t value;
    if (fields >> name >> value) counters[name] = value;
  }
  return counters;
}

bool rdmacm_listening(const std::string& runtime) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(runtime + "/cm", ec))
    if (entry.path().filename().string().find(".tmp") == std::string::npos) return true;
  return false;
}

}  // namespace softverbs::test
