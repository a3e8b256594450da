#include "checker/access_rules.h"

#include <optional>
#include <string>

#include "checker/report.h"
#include "verbs_objects.h"

namespace softverbs::provider::check {

namespace {

// Each rule is reported once per QP.
enum AccessRule : uint8_t {
  kNoInitiatorDepth = 1u << 0,
  kNoResponderResources = 1u << 1,
  kDepthBeyondResources = 1u << 2,
};

bool needs_rd_atomic_resources(ibv_wr_opcode opcode) {
  return opcode == IBV_WR_RDMA_READ || opcode == IBV_WR_ATOMIC_CMP_AND_SWP || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ||
         opcode == IBV_WR_ATOMIC_WRITE;
}

// The responder's limit, where the peer is a QP of this device connected
// back to this one.
std::optional<uint8_t> responder_resources(DeviceMemory& memory, uint32_t qpn, uint32_t dest_qpn) {
  QpRecord* peer = memory.qp_by_number(dest_qpn);
  if (peer == nullptr) return std::nullopt;
  SharedLock lock(peer->lock);
  if (!peer->live || peer->qpn != dest_qpn || peer->attributes.dest_qpn != qpn) return std::nullopt;
  return peer->attributes.max_dest_rd_atomic;
}

void report_rule(ProviderQp& qp, AccessRule rule, const ibv_send_wr& wr, const void* call_site, std::string what) {
  if (qp.reported_access_rules & rule) return;
  qp.reported_access_rules |= rule;
  Finding finding;
  finding.check = "access-rule";
  finding.what = std::move(what);
  finding.qp_num = qp.qpn;
  finding.wr_id = wr.wr_id;
  finding.opcode = send_opcode_name(wr.opcode);
  finding.call_site = call_site;
  report(finding);
}

}  // namespace

void access_rules_at_post(ibv_qp* ibv, const ibv_send_wr* wr, const void* call_site) {
  if (!enabled() || (ibv->qp_type != IBV_QPT_RC && ibv->qp_type != IBV_QPT_XRC_SEND)) return;
  ProviderQp* qp = to_qp(ibv);
  if (!qp->device) return;
  DeviceMemory& memory = memory_of(ibv->context);
  QpRecord& record = record_of(qp);
  for (; wr != nullptr; wr = wr->next) {
    if (!needs_rd_atomic_resources(wr->opcode)) continue;
    uint8_t depth;
    uint32_t dest_qpn;
    {
      SharedLock lock(record.lock);
      depth = record.attributes.max_rd_atomic;
      dest_qpn = record.attributes.dest_qpn;
    }
    if (depth == 0) {
      report_rule(*qp, kNoInitiatorDepth, *wr, call_site,
                  "an RDMA READ or atomic on a QP given max_rd_atomic 0: an HCA never sends it (no READ or atomic may "
                  "be outstanding), and the WR waits for ever; softverbs carries it out");
      continue;
    }
    const std::optional<uint8_t> resources = responder_resources(memory, qp->qpn, dest_qpn);
    if (!resources) continue;
    if (*resources == 0)
      report_rule(*qp, kNoResponderResources, *wr, call_site,
                  "an RDMA READ or atomic to a responder QP given max_dest_rd_atomic 0: an HCA responder rejects it, "
                  "and it completes with IBV_WC_REM_INV_REQ_ERR; softverbs carries it out");
    else if (depth > *resources)
      report_rule(*qp, kDepthBeyondResources, *wr, call_site,
                  "the QP may have " + std::to_string(depth) +
                      " RDMA READs or atomics outstanding (max_rd_atomic) but its responder takes " +
                      std::to_string(*resources) +
                      " (max_dest_rd_atomic): an HCA responder may reject the excess with IBV_WC_REM_INV_REQ_ERR "
                      "or lose what it needs to answer a retry; softverbs has no such limit");
  }
}

}  // namespace softverbs::provider::check
