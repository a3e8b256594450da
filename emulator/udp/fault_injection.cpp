#include "udp/fault_injection.h"

#include <charconv>
#include <cmath>
#include <sstream>
#include <vector>

namespace softverbs {

namespace {

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  while (!text.empty()) {
    size_t at = text.find(separator);
    parts.push_back(text.substr(0, at));
    if (at == std::string_view::npos) break;
    text.remove_prefix(at + 1);
  }
  return parts;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\n')) text.remove_suffix(1);
  return text;
}

// "0.1", "10%", "1e-3" -> parts per million.
std::optional<uint32_t> parse_rate(std::string_view text) {
  bool percent = !text.empty() && text.back() == '%';
  if (percent) text.remove_suffix(1);
  double value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || !std::isfinite(value)) return std::nullopt;
  if (percent) value /= 100;
  if (value < 0 || value > 1) return std::nullopt;
  return static_cast<uint32_t>(std::llround(value * 1e6));
}

template <typename Integer>
std::optional<Integer> parse_integer(std::string_view text) {
  Integer value{};
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::string format_rate(uint32_t ppm) {
  std::ostringstream out;
  out << static_cast<double>(ppm) / 1e6;
  return out.str();
}

}  // namespace

std::optional<FaultSettings> FaultSettings::parse(std::string_view text, std::string* error) {
  FaultSettings settings;
  text = trim(text);
  if (text.empty() || text == "none") return settings;
  for (std::string_view item : split(text, ',')) {
    item = trim(item);
    if (item.empty()) {
      *error = "empty fault setting in '" + std::string(text) + "' (settings are KEY=VALUE, separated by commas)";
      return std::nullopt;
    }
    size_t equals = item.find('=');
    if (equals == std::string_view::npos) {
      *error = "fault setting '" + std::string(item) + "' is not KEY=VALUE";
      return std::nullopt;
    }
    std::string_view key = trim(item.substr(0, equals));
    std::string_view value = trim(item.substr(equals + 1));
    uint32_t* rate = key == "loss"        ? &settings.loss_ppm
                     : key == "duplicate" ? &settings.duplicate_ppm
                     : key == "reorder"   ? &settings.reorder_ppm
                     : key == "delay"     ? &settings.delay_ppm
                     : key == "corrupt"   ? &settings.corrupt_ppm
                                          : nullptr;
    if (rate != nullptr) {
      auto parsed = parse_rate(value);
      if (!parsed) {
        *error = "fault rate " + std::string(key) + "='" + std::string(value) +
                 "' is not a fraction in [0, 1] or a percentage";
        return std::nullopt;
      }
      *rate = *parsed;
    } else if (key == "delay_us") {
      auto parsed = parse_integer<uint32_t>(value);
      if (!parsed || *parsed > 10'000'000) {
        *error = "delay_us='" + std::string(value) + "' is not a number of microseconds up to 10000000";
        return std::nullopt;
      }
      settings.delay_us = *parsed;
    } else if (key == "seed") {
      auto parsed = parse_integer<uint64_t>(value);
      if (!parsed) {
        *error = "seed='" + std::string(value) + "' is not an unsigned integer";
        return std::nullopt;
      }
      settings.seed = *parsed;
    } else {
      *error = "unknown fault setting '" + std::string(key) +
               "' (known: loss, duplicate, reorder, delay, delay_us, corrupt, seed)";
      return std::nullopt;
    }
  }
  return settings;
}

std::string FaultSettings::to_string() const {
  return "loss=" + format_rate(loss_ppm) + ",duplicate=" + format_rate(duplicate_ppm) +
         ",reorder=" + format_rate(reorder_ppm) + ",delay=" + format_rate(delay_ppm) +
         ",delay_us=" + std::to_string(delay_us) + ",corrupt=" + format_rate(corrupt_ppm) +
         ",seed=" + std::to_string(seed);
}

FaultSettings SharedFaultSettings::load() const {
  FaultSettings s;
  s.loss_ppm = loss_ppm.load(std::memory_order_relaxed);
  s.duplicate_ppm = duplicate_ppm.load(std::memory_order_relaxed);
  s.reorder_ppm = reorder_ppm.load(std::memory_order_relaxed);
  s.delay_ppm = delay_ppm.load(std::memory_order_relaxed);
  s.corrupt_ppm = corrupt_ppm.load(std::memory_order_relaxed);
  s.delay_us = delay_us.load(std::memory_order_relaxed);
  s.seed = seed.load(std::memory_order_relaxed);
  return s;
}

void SharedFaultSettings::store(const FaultSettings& s) {
  loss_ppm.store(s.loss_ppm, std::memory_order_relaxed);
  duplicate_ppm.store(s.duplicate_ppm, std::memory_order_relaxed);
  reorder_ppm.store(s.reorder_ppm, std::memory_order_relaxed);
  delay_ppm.store(s.delay_ppm, std::memory_order_relaxed);
  corrupt_ppm.store(s.corrupt_ppm, std::memory_order_relaxed);
  delay_us.store(s.delay_us, std::memory_order_relaxed);
  seed.store(s.seed, std::memory_order_relaxed);
}

FaultGenerator::FaultGenerator(uint64_t seed, uint32_t qpn) : state_(seed ^ (uint64_t{qpn} * 0x9e3779b97f4a7c15ull)) {}

uint64_t FaultGenerator::next() {
  // splitmix64: small, fast and good enough for coin flips.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool FaultGenerator::chance(uint32_t ppm) { return ppm != 0 && next() % 1'000'000 < ppm; }

FaultDecision FaultGenerator::decide(const FaultSettings& settings) {
  FaultDecision decision;
  if (!settings.any()) return decision;
  // Every coin is thrown for every packet, so that one rate's change does
  // not shift the decisions of the others.
  bool lose = chance(settings.loss_ppm);
  bool duplicate = chance(settings.duplicate_ppm);
  bool reorder = chance(settings.reorder_ppm);
  bool delay = chance(settings.delay_ppm);
  decision.corrupt = chance(settings.corrupt_ppm);
  decision.corrupt_offset_seed = static_cast<uint32_t>(next());
  if (lose)
    decision.action = FaultAction::Drop;
  else if (duplicate)
    decision.action = FaultAction::Duplicate;
  else if (reorder)
    decision.action = FaultAction::Reorder;
  else if (delay)
    decision.action = FaultAction::Delay;
  return decision;
}

}  // namespace softverbs
