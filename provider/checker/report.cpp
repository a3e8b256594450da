#include "checker/report.h"

#include <infiniband/verbs.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace softverbs::provider::check {

bool enabled() {
  static const bool on = std::getenv("SOFTVERBS_CHECK") != nullptr;
  return on;
}

void report(const Finding& finding) {
  std::string line = "softverbs check: " + std::string(finding.check) + ": " + finding.what;
  if (finding.qp_num != 0) {
    char qpn[32];
    std::snprintf(qpn, sizeof qpn, " (QP 0x%06x", finding.qp_num);
    line += qpn;
    if (finding.wr_id) line += ", WR id " + std::to_string(*finding.wr_id);
    if (!finding.opcode.empty()) line += ", " + std::string(finding.opcode);
    line += ")";
  }
  line += "\n";
  std::fputs(line.c_str(), stderr);
}

std::string_view send_opcode_name(int opcode) {
  switch (opcode) {
    case IBV_WR_RDMA_WRITE:
      return "IBV_WR_RDMA_WRITE";
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return "IBV_WR_RDMA_WRITE_WITH_IMM";
    case IBV_WR_SEND:
      return "IBV_WR_SEND";
    case IBV_WR_SEND_WITH_IMM:
      return "IBV_WR_SEND_WITH_IMM";
    case IBV_WR_RDMA_READ:
      return "IBV_WR_RDMA_READ";
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return "IBV_WR_ATOMIC_CMP_AND_SWP";
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return "IBV_WR_ATOMIC_FETCH_AND_ADD";
    case IBV_WR_LOCAL_INV:
      return "IBV_WR_LOCAL_INV";
    case IBV_WR_BIND_MW:
      return "IBV_WR_BIND_MW";
    case IBV_WR_SEND_WITH_INV:
      return "IBV_WR_SEND_WITH_INV";
    case IBV_WR_TSO:
      return "IBV_WR_TSO";
    case IBV_WR_DRIVER1:
      return "IBV_WR_DRIVER1";
    case IBV_WR_ATOMIC_WRITE:
      return "IBV_WR_ATOMIC_WRITE";
    default:
      return "unknown opcode";
  }
}

std::string_view completion_opcode_name(int opcode) {
  switch (opcode) {
    case IBV_WC_SEND:
      return "IBV_WC_SEND";
    case IBV_WC_RDMA_WRITE:
      return "IBV_WC_RDMA_WRITE";
    case IBV_WC_RDMA_READ:
      return "IBV_WC_RDMA_READ";
    case IBV_WC_COMP_SWAP:
      return "IBV_WC_COMP_SWAP";
    case IBV_WC_FETCH_ADD:
      return "IBV_WC_FETCH_ADD";
    case IBV_WC_BIND_MW:
      return "IBV_WC_BIND_MW";
    case IBV_WC_LOCAL_INV:
      return "IBV_WC_LOCAL_INV";
    case IBV_WC_TSO:
      return "IBV_WC_TSO";
    case IBV_WC_ATOMIC_WRITE:
      return "IBV_WC_ATOMIC_WRITE";
    case IBV_WC_RECV:
      return "IBV_WC_RECV";
    case IBV_WC_RECV_RDMA_WITH_IMM:
      return "IBV_WC_RECV_RDMA_WITH_IMM";
    default:
      return "unknown opcode";
  }
}

}  // namespace softverbs::provider::check
