#include "cm_protocol.h"

#include <cstring>
#include <type_traits>

namespace softverbs::cm {

namespace {

constexpr uint32_t kMagic = 0x53564d43;  // "SVMC"
constexpr uint8_t kVersion = 1;

struct Header {
  uint32_t magic;
  uint8_t type;
  uint8_t version;
  uint16_t body_length;
};
static_assert(sizeof(Header) == kHeaderBytes);

template <typename Body>
void append(std::vector<uint8_t>& out, const Body& body) {
  static_assert(std::is_trivially_copyable_v<Body>);
  const auto* bytes = reinterpret_cast<const uint8_t*>(&body);
  out.insert(out.end(), bytes, bytes + sizeof body);
}

size_t body_size(MessageType type) {
  switch (type) {
    case MessageType::Req:
      return sizeof(ConnectRequest);
    case MessageType::Rep:
      return sizeof(ConnectReply);
    case MessageType::Rej:
      return sizeof(Reject);
    case MessageType::SidrReq:
      return sizeof(SidrRequest);
    case MessageType::SidrRep:
      return sizeof(SidrReply);
    case MessageType::Rtu:
    case MessageType::Dreq:
    case MessageType::Drep:
      return 0;
  }
  return SIZE_MAX;
}

template <typename Body>
bool read_body(std::span<const uint8_t> body, Body& out, uint8_t Body::*length, size_t limit) {
  if (body.size() != sizeof(Body)) return false;
  std::memcpy(&out, body.data(), sizeof(Body));
  return out.*length <= limit;
}

}  // namespace

std::vector<uint8_t> encode(const Message& message) {
  std::vector<uint8_t> out;
  Header header{kMagic, static_cast<uint8_t>(message.type), kVersion, static_cast<uint16_t>(body_size(message.type))};
  append(out, header);
  switch (message.type) {
    case MessageType::Req:
      append(out, message.req);
      break;
    case MessageType::Rep:
      append(out, message.rep);
      break;
    case MessageType::Rej:
      append(out, message.rej);
      break;
    case MessageType::SidrReq:
      append(out, message.sidr_req);
      break;
    case MessageType::SidrRep:
      append(out, message.sidr_rep);
      break;
    case MessageType::Rtu:
    case MessageType::Dreq:
    case MessageType::Drep:
      break;
  }
  return out;
}

std::optional<size_t> framed_length(std::span<const uint8_t> received) {
  if (received.size() < kHeaderBytes) return kHeaderBytes;
  Header header;
  std::memcpy(&header, received.data(), sizeof header);
  if (header.magic != kMagic || header.version != kVersion) return std::nullopt;
  size_t expected = body_size(static_cast<MessageType>(header.type));
  if (expected == SIZE_MAX || header.body_length != expected) return std::nullopt;
  return kHeaderBytes + header.body_length;
}

std::optional<Message> decode(std::span<const uint8_t> frame) {
  auto length = framed_length(frame);
  if (!length || frame.size() != *length || frame.size() < kHeaderBytes) return std::nullopt;
  Header header;
  std::memcpy(&header, frame.data(), sizeof header);
  Message message;
  message.type = static_cast<MessageType>(header.type);
  std::span<const uint8_t> body = frame.subspan(kHeaderBytes);
  bool ok = true;
  switch (message.type) {
    case MessageType::Req:
      ok = read_body(body, message.req, &ConnectRequest::private_data_length, kReqPrivateData);
      break;
    case MessageType::Rep:
      ok = read_body(body, message.rep, &ConnectReply::private_data_length, kRepPrivateData);
      break;
    case MessageType::Rej:
      ok = read_body(body, message.rej, &Reject::private_data_length, kRejPrivateData);
      break;
    case MessageType::SidrReq:
      ok = read_body(body, message.sidr_req, &SidrRequest::private_data_length, kSidrReqPrivateData);
      break;
    case MessageType::SidrRep:
      ok = read_body(body, message.sidr_rep, &SidrReply::private_data_length, kSidrRepPrivateData);
      break;
    case MessageType::Rtu:
    case MessageType::Dreq:
    case MessageType::Drep:
      ok = body.empty();
      break;
    default:
      ok = false;
  }
  if (!ok) return std::nullopt;
  return message;
}

}  // namespace softverbs::cm
