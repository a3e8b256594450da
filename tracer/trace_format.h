// The trace file's format, shared by the recorder (libsoftverbs-trace.so) and
// `softverbs diff`. A trace is text: the header line, then one event a line,
// "<section> <event> <fields...>", where the section is the object the event
// belongs to (qp1, cq2, srq1, dev1) and orders matter only within a section.
// Lines starting with '#' after the header are comments.
#pragma once

#include <string>
#include <string_view>

namespace softverbs::trace {

// Bumped whenever a line's meaning changes; `softverbs diff` refuses to
// compare traces of different versions.
inline constexpr int kFormatVersion = 1;
inline constexpr std::string_view kHeaderPrefix = "# softverbs-trace ";

// The environment the trace library reads: the output file, and the pid of
// the process that writes it (its forked or exec'd children write FILE.<n>).
inline constexpr const char* kOutputVariable = "SOFTVERBS_TRACE_FILE";
inline constexpr const char* kRootPidVariable = "SOFTVERBS_TRACE_PID";

}  // namespace softverbs::trace

namespace softverbs::trace {

// The stream of a trace line: its section, split where the IB spec orders
// nothing between the parts. A QP's posted sends, send completions, posted
// receives and receive completions are each in order; how they interleave
// (and how different objects interleave) is timing.
inline std::string stream_of(std::string_view line) {
  auto word = [&line](size_t index) {
    size_t start = 0;
    for (size_t i = 0; i < index; ++i) {
      start = line.find(' ', start);
      if (start == std::string_view::npos) return std::string_view();
      ++start;
    }
    const size_t end = line.find(' ', start);
    return line.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
  };
  const std::string object(word(0));
  const std::string_view event = word(1);
  if (event == "post_send" || event == "wr_complete") return object + " posted sends";
  if (event == "post_recv") return object + " posted receives";
  // How many events a program waits for depends on how completions batch up.
  if (event == "req_notify_cq" || event == "get_cq_event" || event == "ack_cq_events") return object + " notifications";
  if (event == "wc") {
    const std::string_view work = word(2);
    if (work.starts_with("srq") || work.starts_with('r')) return object + " receive completions";
    if (work.starts_with('s')) return object + " send completions";
    return object + " completions";
  }
  return object;
}

}  // namespace softverbs::trace
