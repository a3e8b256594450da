// The verbs checker's reports (`softverbs run --check`). Every check in the
// provider and in the check preload reports through here, so that all
// reports share one format on stderr, one JSON-lines file and one count
// that `softverbs run --check=error` turns into the exit status.
//
// The environment `softverbs run` sets:
//   SOFTVERBS_CHECK         present: the checks are on
//   SOFTVERBS_CHECK_REPORT  a file each report is appended to as one JSON line
//   SOFTVERBS_CHECK_COUNT   a file that gets one byte per report (its size is the count)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace softverbs::provider::check {

namespace detail {
extern const bool kEnabled;
}

// Whether this process runs under `softverbs run --check` (SOFTVERBS_CHECK
// is set in its environment): read once at load, one load and branch on
// every post and poll.
inline bool enabled() { return detail::kEnabled; }

struct Finding {
  std::string_view check;  // stable identifier, e.g. "send-buffer-modified" (documented in docs/checking.md)
  std::string what{};      // one sentence: what the application did and why it is wrong on an HCA
  uint32_t qp_num = 0;     // 0 when no QP is concerned
  std::optional<uint64_t> wr_id{};
  std::string_view opcode{};         // e.g. "IBV_WR_RDMA_WRITE"; empty when no WR is concerned
  const void* call_site = nullptr;   // the application's return address at the verb call (the post)
  bool backtrace_of_caller = false;  // also print the stack of the thread reporting
};

void report(const Finding& finding);

// Where `return_address` (an application's call) is: function, file:line, object.
std::string describe_call_site(const void* return_address);

// The name of a send opcode and a work completion opcode, for reports.
std::string_view send_opcode_name(int ibv_wr_opcode);
std::string_view completion_opcode_name(int ibv_wc_opcode);

// Where a code address is: its object, the function around it and, when
// addr2line (binutils) is installed and the object has line information,
// its source file and line.
struct CodeLocation {
  std::string object;
  std::string function;  // empty when unknown
  std::string file;      // empty when unknown
  unsigned line = 0;
  uintptr_t offset_in_object = 0;
};
// `return_address` is a return address: the call it returns from is looked up.
CodeLocation locate_call(const void* return_address);

}  // namespace softverbs::provider::check
