#include "host/device_config.h"

#include <charconv>
#include <cstdio>
#include <sstream>

#include "udp/fault_injection.h"

namespace softverbs {

std::string_view transport_name(TransportChoice transport) {
  switch (transport) {
    case TransportChoice::SharedMemory:
      return "shm";
    case TransportChoice::Udp:
      return "udp";
    case TransportChoice::Auto:
      break;
  }
  return "auto";
}

std::optional<TransportChoice> parse_transport(std::string_view text) {
  if (text == "auto") return TransportChoice::Auto;
  if (text == "shm") return TransportChoice::SharedMemory;
  if (text == "udp") return TransportChoice::Udp;
  return std::nullopt;
}

std::string DeviceConfig::serialize() const {
  std::ostringstream out;
  out << "name=" << name << '\n'
      << "netdev=" << netdev << '\n'
      << "uverbs_index=" << uverbs_index << '\n'
      << "node_guid=" << format_guid(node_guid) << '\n'
      << "netdev_mtu=" << netdev_mtu << '\n'
      << "transport=" << transport_name(transport) << '\n'
      << "faults=" << faults << '\n'
      << "runtime_dir=" << runtime_dir.string() << '\n';
  return out.str();
}

namespace {

template <typename Integer>
bool parse_integer(std::string_view text, Integer& value, int base = 10) {
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, base);
  return error == std::errc() && end == text.data() + text.size();
}

bool parse_guid(std::string_view text, uint64_t& guid) {
  // four groups of four hex digits separated by ':'
  if (text.size() != 19) return false;
  uint64_t value = 0;
  for (size_t group = 0; group < 4; ++group) {
    if (group != 0 && text[group * 5 - 1] != ':') return false;
    uint16_t part = 0;
    if (!parse_integer(text.substr(group * 5, 4), part, 16)) return false;
    value = (value << 16) | part;
  }
  guid = value;
  return true;
}

}  // namespace

std::optional<DeviceConfig> DeviceConfig::parse(std::string_view text, std::string* error) {
  DeviceConfig config;
  bool have_name = false, have_index = false, have_guid = false;
  size_t line_number = 0;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    ++line_number;
    if (line.empty() || line[0] == '#') continue;
    size_t equals = line.find('=');
    auto fail = [&](const char* why) -> std::optional<DeviceConfig> {
      if (error != nullptr)
        *error = "line " + std::to_string(line_number) + ": " + why + ": '" + std::string(line) + "'";
      return std::nullopt;
    };
    if (equals == std::string_view::npos) return fail("expected key=value");
    std::string_view key = line.substr(0, equals);
    std::string_view value = line.substr(equals + 1);
    if (key == "name") {
      if (!is_valid_device_name(value)) return fail("invalid device name");
      config.name = value;
      have_name = true;
    } else if (key == "netdev") {
      config.netdev = value;
    } else if (key == "uverbs_index") {
      if (!parse_integer(value, config.uverbs_index) || config.uverbs_index < 0) return fail("invalid uverbs index");
      have_index = true;
    } else if (key == "node_guid") {
      if (!parse_guid(value, config.node_guid)) return fail("invalid GUID");
      have_guid = true;
    } else if (key == "netdev_mtu") {
      if (!parse_integer(value, config.netdev_mtu)) return fail("invalid MTU");
    } else if (key == "transport") {
      auto transport = parse_transport(value);
      if (!transport) return fail("invalid transport (auto, shm or udp)");
      config.transport = *transport;
    } else if (key == "faults") {
      std::string why;
      if (!FaultSettings::parse(value, &why)) return fail("invalid fault settings");
      config.faults = std::string(value);
    } else if (key == "runtime_dir") {
      config.runtime_dir = std::string(value);
    }
    // Unknown keys are ignored so that an older provider can read a newer
    // record.
  }
  if (!have_name || !have_index || !have_guid) {
    if (error != nullptr) *error = "incomplete device record (needs name, uverbs_index and node_guid)";
    return std::nullopt;
  }
  return config;
}

bool is_valid_device_name(std::string_view name) {
  // A name starts with a letter or digit: "-x" would read as an option to
  // every command that takes a device name, "." and ".." as directories.
  if (name.empty() || name.size() > 63) return false;
  const char first = name.front();
  if (!((first >= 'a' && first <= 'z') || (first >= 'A' && first <= 'Z') || (first >= '0' && first <= '9')))
    return false;
  for (char c : name) {
    bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

uint64_t derive_node_guid(std::string_view host_identity, std::string_view device_name) {
  // FNV-1a over both strings: stable, cheap, and well spread.
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&](std::string_view text) {
    for (unsigned char c : text) {
      hash ^= c;
      hash *= 0x100000001b3ull;
    }
    hash ^= 0xff;
    hash *= 0x100000001b3ull;
  };
  mix(host_identity);
  mix(device_name);
  // EUI-64 shape: OUI-like top 24 bits with the local bit (0x02 in the first
  // byte) set and the group bit clear; "ff:fe" in the middle as MAC-derived
  // GUIDs have.
  uint64_t oui = ((hash >> 40) & 0xfcffff) | 0x020000;
  uint64_t tail = hash & 0xffffff;
  return (oui << 40) | (uint64_t{0xfffe} << 24) | tail;
}

std::string format_guid(uint64_t guid) {
  char text[20];
  std::snprintf(text, sizeof text, "%04x:%04x:%04x:%04x", static_cast<unsigned>((guid >> 48) & 0xffff),
                static_cast<unsigned>((guid >> 32) & 0xffff), static_cast<unsigned>((guid >> 16) & 0xffff),
                static_cast<unsigned>(guid & 0xffff));
  return text;
}

}  // namespace softverbs
