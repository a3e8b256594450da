// `softverbs diff`: reads two traces and shows, stream by stream (see
// stream_of in trace_format.h), where they differ, as unified-diff hunks.
#pragma once

#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace softverbs::trace {

struct Trace {
  std::string label;               // what the output calls it (its path)
  std::vector<std::string> lines;  // the events, comments and header left out
};

// Reads a trace file; nullopt and the reason if it cannot be read, is no
// trace, or is of another format version.
std::optional<Trace> read_trace(const std::string& path, std::string* error);
// The same from text (the tests' hand-written traces).
std::optional<Trace> parse_trace(const std::string& label, const std::string& text, std::string* error);

// Writes the differences to `out`; true if there were any.
bool diff_traces(const Trace& a, const Trace& b, std::ostream& out);

// The edit script between two sequences: for each output line, ' ', '-' or
// '+' and the index into a (for ' ' and '-') or b (for '+').
struct Edit {
  char kind;
  size_t index;
};
std::vector<Edit> edit_script(const std::vector<std::string>& a, const std::vector<std::string>& b);

}  // namespace softverbs::trace
