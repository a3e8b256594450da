#include "device/work_request.h"

#include <array>

namespace softverbs {

void SendWqe::reset() {
  std::vector<Sge> kept_sges = std::move(sges);
  std::vector<uint8_t> kept_bytes = std::move(inline_bytes);
  kept_sges.clear();
  kept_bytes.clear();
  *this = SendWqe{};
  sges = std::move(kept_sges);
  inline_bytes = std::move(kept_bytes);
}

void SendWqe::keep_inline() {
  if (!(flags & send_flag::kInline)) return;
  inline_bytes.clear();
  for (const Sge& sge : sges) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(sge.address);
    inline_bytes.insert(inline_bytes.end(), bytes, bytes + sge.length);
  }
  sges.assign(1, Sge{reinterpret_cast<uint64_t>(inline_bytes.data()), static_cast<uint32_t>(inline_bytes.size()), 0});
}

}  // namespace softverbs
