// The comparison of `softverbs diff` on hand-written traces: what counts as
// a difference (a QP's queue in order) and what does not (interleaving).
#include "trace_diff.h"

#include <gtest/gtest.h>

#include <sstream>

#include "trace_format.h"

namespace softverbs::trace {
namespace {

Trace parse(const std::string& label, const std::string& events) {
  std::string error;
  auto trace = parse_trace(label, "# softverbs-trace " + std::to_string(kFormatVersion) + "\n" + events, &error);
  EXPECT_TRUE(trace) << error;
  return trace.value_or(Trace{});
}

// The diff's output; empty when the traces are the same.
std::string compare(const std::string& a, const std::string& b) {
  std::ostringstream out;
  const bool differs = diff_traces(parse("a", a), parse("b", b), out);
  EXPECT_EQ(differs, !out.str().empty());
  return out.str();
}

TEST(TraceDiff, DifferentQpsInterleavedDifferentlyAreTheSame) {
  EXPECT_EQ(compare("qp1 post_send s1 SEND len=8\nqp2 post_send s1 SEND len=8\nqp1 wc s1 SUCCESS SEND cq=cq1\n"
                    "qp2 wc s1 SUCCESS SEND cq=cq1\n",
                    "qp2 post_send s1 SEND len=8\nqp2 wc s1 SUCCESS SEND cq=cq1\nqp1 post_send s1 SEND len=8\n"
                    "qp1 wc s1 SUCCESS SEND cq=cq1\n"),
            "");
}

TEST(TraceDiff, SendAndReceiveCompletionsOfAQpInterleaveFreely) {
  // The IB spec orders each queue, not the two queues of a QP between them;
  // nor posts against completions.
  EXPECT_EQ(compare("qp1 post_recv r1 len=8\nqp1 post_send s1 SEND len=8\nqp1 wc s1 SUCCESS SEND cq=cq1\n"
                    "qp1 wc r1 SUCCESS RECV len=8 cq=cq1\nqp1 post_send s2 SEND len=8\n",
                    "qp1 post_recv r1 len=8\nqp1 post_send s1 SEND len=8\nqp1 wc r1 SUCCESS RECV len=8 cq=cq1\n"
                    "qp1 post_send s2 SEND len=8\nqp1 wc s1 SUCCESS SEND cq=cq1\n"),
            "");
}

TEST(TraceDiff, TheOrderWithinAQueueMatters) {
  const std::string out = compare("qp1 wc s1 SUCCESS SEND cq=cq1\nqp1 wc s2 SUCCESS RDMA_WRITE cq=cq1\n",
                                  "qp1 wc s2 SUCCESS RDMA_WRITE cq=cq1\nqp1 wc s1 SUCCESS SEND cq=cq1\n");
  EXPECT_NE(out.find("=== qp1 send completions"), std::string::npos) << out;
}

TEST(TraceDiff, AChangedCompletionIsShownInItsQueueWithContext) {
  std::string common;
  for (int i = 1; i <= 10; ++i) common += "qp1 wc s" + std::to_string(i) + " SUCCESS SEND cq=cq1\n";
  std::string changed = common;
  const std::string old_line = "qp1 wc s5 SUCCESS SEND cq=cq1";
  changed.replace(changed.find(old_line), old_line.size(), "qp1 wc s5 REM_ACCESS_ERR cq=cq1");
  const std::string out = compare("dev1 open_device = ok\n" + common, "dev1 open_device = ok\n" + changed);
  EXPECT_EQ(out,
            "--- a\n+++ b\n"
            "=== qp1 send completions\n"
            "@@ -2,7 +2,7 @@ qp1 send completions\n"
            " qp1 wc s2 SUCCESS SEND cq=cq1\n qp1 wc s3 SUCCESS SEND cq=cq1\n qp1 wc s4 SUCCESS SEND cq=cq1\n"
            "-qp1 wc s5 SUCCESS SEND cq=cq1\n+qp1 wc s5 REM_ACCESS_ERR cq=cq1\n"
            " qp1 wc s6 SUCCESS SEND cq=cq1\n qp1 wc s7 SUCCESS SEND cq=cq1\n qp1 wc s8 SUCCESS SEND cq=cq1\n");
}

TEST(TraceDiff, AnObjectOnlyOneTraceHasIsAllAddedOrRemoved) {
  const std::string out = compare("dev1 open_device = ok\n", "dev1 open_device = ok\nqp1 create_qp type=RC = ok\n");
  EXPECT_NE(out.find("=== qp1\n@@ -1,0 +1,1 @@ qp1\n+qp1 create_qp type=RC = ok\n"), std::string::npos) << out;
}

TEST(TraceDiff, EditScriptIsMinimal) {
  const std::vector<std::string> a = {"x", "a", "b", "c", "y"}, b = {"x", "b", "c", "d", "y"};
  std::string kinds;
  for (const Edit& edit : edit_script(a, b)) kinds += edit.kind;
  EXPECT_EQ(kinds, " -  + ");
}

TEST(TraceDiff, CommentsAreIgnored) {
  EXPECT_EQ(compare("# program one\ndev1 open_device = ok\n", "dev1 open_device = ok\n# another\n"), "");
}

TEST(TraceDiff, OtherFormatVersionsAndNonTracesAreRefused) {
  std::string error;
  EXPECT_FALSE(parse_trace("old", "# softverbs-trace 999\ndev1 open_device = ok\n", &error));
  EXPECT_NE(error.find("version 999"), std::string::npos) << error;
  EXPECT_FALSE(parse_trace("text", "hello\n", &error));
  EXPECT_NE(error.find("not a softverbs trace"), std::string::npos) << error;
  EXPECT_FALSE(read_trace("/nonexistent/trace", &error));
}

TEST(TraceDiff, StreamsFollowTheQueues) {
  EXPECT_EQ(stream_of("qp3 post_send s1 SEND len=8"), "qp3 posted sends");
  EXPECT_EQ(stream_of("qp3 wr_complete s1 SEND flags=-"), "qp3 posted sends");
  EXPECT_EQ(stream_of("qp3 post_recv r1 len=8"), "qp3 posted receives");
  EXPECT_EQ(stream_of("qp3 wc s1 SUCCESS SEND cq=cq1"), "qp3 send completions");
  EXPECT_EQ(stream_of("qp3 wc r1 SUCCESS RECV cq=cq1"), "qp3 receive completions");
  EXPECT_EQ(stream_of("qp3 wc srq1 SUCCESS RECV cq=cq1"), "qp3 receive completions");
  EXPECT_EQ(stream_of("qp3 modify_qp mask=STATE state=RTS = 0"), "qp3");
  EXPECT_EQ(stream_of("cq1 req_notify_cq solicited=0 = 0"), "cq1 notifications");
  EXPECT_EQ(stream_of("cq1 destroy_cq = 0"), "cq1");
}

}  // namespace
}  // namespace softverbs::trace
