// libFuzzer entry point (scripts/fuzz): the rdmacm shim's connection-manager
// message decoder, which reads what any local process may send to a
// listener's port. Whatever it accepts must encode back to the same bytes
// and keep its private data within its area.
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "cm_protocol.h"
#include "seed_corpus.h"

namespace {

using namespace softverbs::cm;

std::vector<std::vector<uint8_t>> seeds() {
  std::vector<std::vector<uint8_t>> out;
  for (uint8_t type = 1; type <= 8; ++type) {
    Message m;
    m.type = static_cast<MessageType>(type);
    m.req.private_data_length = 3;
    m.rep.private_data_length = 5;
    m.rej.reason = 28;
    m.sidr_req.private_data_length = 1;
    m.sidr_rep.qkey = 0x11111111;
    out.push_back(encode(m));
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
  const std::optional<size_t> framed = size >= kHeaderBytes ? framed_length(input) : std::nullopt;
  if (framed && *framed < kHeaderBytes) std::abort();  // a frame is at least its header
  if (const std::optional<Message> message = decode(input)) {
    if (message->req.private_data_length > kReqPrivateData || message->rep.private_data_length > kRepPrivateData ||
        message->rej.private_data_length > kRejPrivateData ||
        message->sidr_req.private_data_length > kSidrReqPrivateData ||
        message->sidr_rep.private_data_length > kSidrRepPrivateData)
      std::abort();
    const std::vector<uint8_t> again = encode(*message);
    const std::optional<Message> reread = decode(again);
    if (!reread || encode(*reread) != again) std::abort();
    if (!framed || *framed != size) std::abort();  // decode took exactly one frame
  }
  return 0;
}
