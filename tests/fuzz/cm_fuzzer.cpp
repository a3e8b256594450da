// libFuzzer entry point (scripts/fuzz): the CM MAD parser, which reads what
// any host may send to a device's QP1, and the routing that reads the same
// bytes first. Whatever parses must build back to bytes that parse to the
// same message, and routing must agree with the parse.
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "seed_corpus.h"
#include "wire/cm_mad.h"

namespace {

using namespace softverbs::wire::cm;

std::vector<std::vector<uint8_t>> seeds() {
  std::vector<std::vector<uint8_t>> out;
  for (Attribute attribute : {Attribute::Req, Attribute::Mra, Attribute::Rej, Attribute::Rep, Attribute::Rtu,
                              Attribute::Dreq, Attribute::Drep, Attribute::SidrReq, Attribute::SidrRep}) {
    Mad mad;
    mad.attribute = attribute;
    mad.transaction_id = 0x0102030405060708;
    mad.req.service_id = service_id(kPortSpaceTcp, 7471);
    mad.req.local_comm_id = 0x11223344;
    put_ip_header(IpHeader{4, 40000, {}, {}}, mad.req.private_data);
    mad.rep.remote_comm_id = 0x11223344;
    mad.rej.reason = reject::kConsumer;
    const auto bytes = build_cm_mad(mad);
    out.emplace_back(bytes.begin(), bytes.end());
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  softverbs::fuzz::seed_empty_corpus(*argc, *argv, seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> input(data, size);
  const std::optional<CmRoute> route = cm_route(input);
  const std::optional<Mad> mad = parse_cm_mad(input);
  if (mad && !route) std::abort();  // whatever parses can be routed
  if (mad) {
    const auto again = build_cm_mad(*mad);
    const std::optional<Mad> reread = parse_cm_mad(again);
    if (!reread || build_cm_mad(*reread) != again) std::abort();
    if (route->attribute != mad->attribute) std::abort();
    if (mad->attribute == Attribute::Req && route->service_id != mad->req.service_id) std::abort();
    if (mad->attribute == Attribute::Rep && route->receiver_id != mad->rep.remote_comm_id) std::abort();
    if (mad->rej.reject_info_length > kRejAriBytes) std::abort();
  }
  if (size >= kIpHeaderBytes) {
    if (const auto ip = get_ip_header(input); ip && ip->ip_version != 4 && ip->ip_version != 6) std::abort();
  }
  return 0;
}
