#include "checker/cq_overrun.h"

#include <atomic>
#include <string>

#include "checker/report.h"

namespace softverbs::provider::check {

void report_cq_overrun(ProviderCq& cq) {
  if (!enabled() || cq.overrun_reported.load(std::memory_order_relaxed)) return;
  CqRecord& record = memory_of(cq.verbs.cq.context).shared().cqs[cq.index];
  if (std::atomic_ref<uint32_t>(record.lost_completions).load(std::memory_order_relaxed) == 0) return;
  uint32_t lost;
  Completion first;
  {
    SharedLock lock(record.lock);
    lost = record.lost_completions;
    first = record.first_lost;
  }
  if (cq.overrun_reported.exchange(true)) return;  // another polling thread reports it
  Finding finding;
  finding.check = "cq-overrun";
  finding.what = "the CQ (" + std::to_string(cq.verbs.cq.cqe) + " entries) overran: " + std::to_string(lost) +
                 (lost == 1 ? " completion" : " completions") +
                 " lost, the first of them this WR's; as an HCA, the device raised IBV_EVENT_CQ_ERR and moved the "
                 "QP to the error state (size a CQ for every completion its queues can have outstanding)";
  finding.qp_num = first.qp_num;
  finding.wr_id = first.wr_id;
  finding.opcode = completion_opcode_name(static_cast<int>(first.opcode));
  finding.backtrace_of_caller = true;
  report(finding);
}

}  // namespace softverbs::provider::check
