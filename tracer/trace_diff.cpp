#include "trace_diff.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "trace_format.h"

namespace softverbs::trace {

namespace {

constexpr size_t kContext = 3;
// Beyond this many differences in one stream, Myers' search stops and the
// rest of the stream is shown as replaced.
constexpr long kMaxEdits = 1000;

// Myers' O((N+M)D) shortest edit script on a[a0,a1) and b[b0,b1), appended to `script`.
void myers(const std::vector<std::string>& a, size_t a0, size_t a1, const std::vector<std::string>& b, size_t b0,
           size_t b1, std::vector<Edit>& script) {
  const long n = static_cast<long>(a1 - a0), m = static_cast<long>(b1 - b0);
  const long max = std::min(n + m, kMaxEdits);
  const long offset = max + 1;
  std::vector<long> v(2 * max + 3, 0);
  std::vector<std::vector<long>> history;
  long found = -1;
  for (long d = 0; d <= max && found < 0; ++d) {
    history.push_back(v);
    for (long k = -d; k <= d; k += 2) {
      long x =
          (k == -d || (k != d && v[offset + k - 1] < v[offset + k + 1])) ? v[offset + k + 1] : v[offset + k - 1] + 1;
      long y = x - k;
      while (x < n && y < m && a[a0 + x] == b[b0 + y]) ++x, ++y;
      v[offset + k] = x;
      if (x >= n && y >= m) {
        found = d;
        break;
      }
    }
  }
  if (found < 0) {  // too different: everything removed, then everything added
    for (size_t i = a0; i < a1; ++i) script.push_back({'-', i});
    for (size_t j = b0; j < b1; ++j) script.push_back({'+', j});
    return;
  }
  // Walk back through the saved frontiers.
  std::vector<Edit> reversed;
  long x = n, y = m;
  for (long d = found; d > 0; --d) {
    const std::vector<long>& before = history[d];  // the frontier d-1 left
    const long k = x - y;
    const bool down = k == -d || (k != d && before[offset + k - 1] < before[offset + k + 1]);
    const long previous_k = down ? k + 1 : k - 1;
    const long previous_x = before[offset + previous_k];
    const long previous_y = previous_x - previous_k;
    while (x > previous_x + (down ? 0 : 1) && y > previous_y + (down ? 1 : 0)) {
      --x, --y;
      reversed.push_back({' ', a0 + x});
    }
    if (down) {
      --y;
      reversed.push_back({'+', b0 + y});
    } else {
      --x;
      reversed.push_back({'-', a0 + x});
    }
  }
  while (x > 0 && y > 0) {
    --x, --y;
    reversed.push_back({' ', a0 + x});
  }
  script.insert(script.end(), reversed.rbegin(), reversed.rend());
}

// The streams of a trace, each with its lines in order, and the order in
// which the streams first appear.
struct Streams {
  std::vector<std::string> order;
  std::map<std::string, std::vector<std::string>> lines;
};

Streams split(const Trace& trace) {
  Streams streams;
  for (const std::string& line : trace.lines) {
    const std::string stream = stream_of(line);
    auto [it, added] = streams.lines.try_emplace(stream);
    if (added) streams.order.push_back(stream);
    it->second.push_back(line);
  }
  return streams;
}

void write_hunks(const std::string& stream, const std::vector<std::string>& a, const std::vector<std::string>& b,
                 const std::vector<Edit>& script, std::ostream& out) {
  out << "=== " << stream << '\n';
  // Positions (1-based) in a and b before each edit, for the hunk headers.
  std::vector<size_t> at_a(script.size() + 1), at_b(script.size() + 1);
  for (size_t i = 0; i < script.size(); ++i) {
    at_a[i + 1] = at_a[i] + (script[i].kind != '+');
    at_b[i + 1] = at_b[i] + (script[i].kind != '-');
  }
  size_t i = 0;
  while (i < script.size()) {
    if (script[i].kind == ' ') {
      ++i;
      continue;
    }
    // A hunk: from kContext before this change to kContext after the last
    // change that is within 2*kContext of the previous one.
    size_t start = i >= kContext ? i - kContext : 0;
    while (start < i && script[start].kind != ' ') ++start;
    size_t end = i;
    size_t last_change = i;
    while (end < script.size()) {
      if (script[end].kind != ' ') last_change = end;
      if (end - last_change > 2 * kContext) break;
      ++end;
    }
    end = std::min(script.size(), last_change + kContext + 1);
    out << "@@ -" << at_a[start] + 1 << ',' << at_a[end] - at_a[start] << " +" << at_b[start] + 1 << ','
        << at_b[end] - at_b[start] << " @@ " << stream << '\n';
    for (size_t e = start; e < end; ++e) {
      const Edit& edit = script[e];
      out << edit.kind << (edit.kind == '+' ? b[edit.index] : a[edit.index]) << '\n';
    }
    i = end;
  }
}

}  // namespace

std::vector<Edit> edit_script(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  std::vector<Edit> script;
  size_t prefix = 0;
  while (prefix < a.size() && prefix < b.size() && a[prefix] == b[prefix]) script.push_back({' ', prefix++});
  size_t suffix = 0;
  while (suffix < a.size() - prefix && suffix < b.size() - prefix &&
         a[a.size() - 1 - suffix] == b[b.size() - 1 - suffix])
    ++suffix;
  myers(a, prefix, a.size() - suffix, b, prefix, b.size() - suffix, script);
  for (size_t k = a.size() - suffix; k < a.size(); ++k) script.push_back({' ', k});
  return script;
}

std::optional<Trace> parse_trace(const std::string& label, const std::string& text, std::string* error) {
  std::istringstream input(text);
  std::string line;
  if (!std::getline(input, line) || !line.starts_with(kHeaderPrefix)) {
    *error = label + ": not a softverbs trace (it does not start with \"" + std::string(kHeaderPrefix) + "N\")";
    return std::nullopt;
  }
  const std::string version = line.substr(kHeaderPrefix.size());
  if (version != std::to_string(kFormatVersion)) {
    *error = label + ": a trace of format version " + version + "; this softverbs reads version " +
             std::to_string(kFormatVersion) + " only (record both traces with the same softverbs)";
    return std::nullopt;
  }
  Trace trace{label, {}};
  while (std::getline(input, line))
    if (!line.empty() && !line.starts_with('#')) trace.lines.push_back(line);
  return trace;
}

std::optional<Trace> read_trace(const std::string& path, std::string* error) {
  std::ifstream file(path);
  if (!file) {
    *error = path + ": cannot read it";
    return std::nullopt;
  }
  std::ostringstream text;
  text << file.rdbuf();
  return parse_trace(path, text.str(), error);
}

bool diff_traces(const Trace& a, const Trace& b, std::ostream& out) {
  const Streams streams_a = split(a), streams_b = split(b);
  std::vector<std::string> order = streams_a.order;
  for (const std::string& stream : streams_b.order)
    if (!streams_a.lines.contains(stream)) order.push_back(stream);
  static const std::vector<std::string> none;
  bool differs = false;
  for (const std::string& stream : order) {
    auto in_a = streams_a.lines.find(stream), in_b = streams_b.lines.find(stream);
    const auto& lines_a = in_a != streams_a.lines.end() ? in_a->second : none;
    const auto& lines_b = in_b != streams_b.lines.end() ? in_b->second : none;
    if (lines_a == lines_b) continue;
    if (!differs) out << "--- " << a.label << "\n+++ " << b.label << '\n';
    differs = true;
    write_hunks(stream, lines_a, lines_b, edit_script(lines_a, lines_b), out);
  }
  return differs;
}

}  // namespace softverbs::trace
