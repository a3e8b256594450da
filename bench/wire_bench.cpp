// Micro-benchmarks of the UDP transport's per-packet work: building and
// parsing transport headers, the ICRC (ISA-L's CRC-32 or the 256-bit fold underneath),
// finding the packets of a coalesced read, and copying a payload out.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "page_aligned.h"
#include "support/payload_copy.h"
#include "udp/coalesced_read.h"
#include "wire/icrc.h"
#include "wire/roce_headers.h"
#include "wire/roce_packet.h"

namespace {

using namespace softverbs::wire;

TransportPacket write_first(std::span<const uint8_t> payload) {
  TransportPacket p;
  p.bth.opcode = opcode(Service::Rc, op::kWriteFirst);
  p.bth.dest_qp = 0x12;
  p.bth.psn = 0x345678;
  p.reth = {0x7f0000001000ull, 0x1234, 1 << 20};
  p.payload = payload;
  return p;
}

FlowAddress flow() {
  FlowAddress f;
  f.source = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
  f.destination = f.source;
  f.source_port = 0xc001;
  f.destination_port = kRoceV2Port;
  return f;
}

void BuildHeaders(benchmark::State& state) {
  std::vector<uint8_t> payload(4096);
  TransportPacket packet = write_first(payload);
  std::array<uint8_t, kMaxHeaderBytes> out;
  for (auto _ : state) {
    packet.bth.psn = (packet.bth.psn + 1) & 0xffffff;
    benchmark::DoNotOptimize(build_headers(packet, payload.size(), out));
  }
}
BENCHMARK(BuildHeaders);

void ParsePacket(benchmark::State& state) {
  std::vector<uint8_t> payload(static_cast<size_t>(state.range(0)));
  std::vector<uint8_t> bytes = build(write_first(payload));
  for (auto _ : state) benchmark::DoNotOptimize(parse(bytes));
}
BENCHMARK(ParsePacket)->Arg(2)->Arg(64)->Arg(4096);

void IcrcSeal(benchmark::State& state) {
  std::vector<uint8_t> payload(static_cast<size_t>(state.range(0)));
  std::vector<uint8_t> bytes = build(write_first(payload));
  const FlowAddress f = flow();
  for (auto _ : state) {
    std::vector<uint8_t> copy = bytes;
    seal(f, copy);
    benchmark::DoNotOptimize(copy.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes.size()));
}
BENCHMARK(IcrcSeal)->Arg(64)->Arg(1024)->Arg(4096);

void IcrcCheck(benchmark::State& state) {
  std::vector<uint8_t> payload(static_cast<size_t>(state.range(0)));
  std::vector<uint8_t> bytes = build(write_first(payload));
  const FlowAddress f = flow();
  seal(f, bytes);
  IcrcHeaderCache cache;  // as the UDP engine keeps one
  for (auto _ : state) benchmark::DoNotOptimize(check_icrc(f, bytes, cache));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes.size()));
}
BENCHMARK(IcrcCheck)->Arg(2)->Arg(64)->Arg(4096);

// The payload CRC alone (crc32: the 256-bit folding where the CPU has it,
// else ISA-L), and the sender's pass that copies a payload into
// its send batch: crc32_copy, against a CRC and then a memcpy.
void Crc32(benchmark::State& state) {
  std::vector<uint8_t> bytes(static_cast<size_t>(state.range(0)), 0x5a);
  for (auto _ : state) benchmark::DoNotOptimize(crc32(0xffffffffu, bytes));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(Crc32)->Arg(64)->Arg(128)->Arg(192)->Arg(256)->Arg(512)->Arg(1024)->Arg(4096)->Arg(65536);

using softverbs::bench::page_aligned;

void Crc32Copy(benchmark::State& state) {
  const auto length = static_cast<size_t>(state.range(0));
  auto bytes = page_aligned(length, 0x5a), copy = page_aligned(length);
  for (auto _ : state) {
    benchmark::DoNotOptimize(crc32_copy(0xffffffffu, copy.get(), std::span<const uint8_t>(bytes.get(), length)));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(Crc32Copy)->Arg(1024)->Arg(4096);

void Crc32ThenMemcpy(benchmark::State& state) {
  const auto length = static_cast<size_t>(state.range(0));
  auto bytes = page_aligned(length, 0x5a), copy = page_aligned(length);
  for (auto _ : state) {
    benchmark::DoNotOptimize(crc32(0xffffffffu, std::span<const uint8_t>(bytes.get(), length)));
    std::memcpy(copy.get(), bytes.get(), length);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(Crc32ThenMemcpy)->Arg(1024)->Arg(4096);

// A payload's copy from a receive buffer into registered memory, the
// destination `distance` bytes after the source modulo 4 KiB (range 1):
// glibc's memcpy against copy_payload (payload_copy.h). The source sits
// 12 bytes into a page, as a payload after a BTH.
template <bool kPayloadCopy>
void ReceiveCopy(benchmark::State& state) {
  const auto length = static_cast<size_t>(state.range(0));
  const auto distance = static_cast<size_t>(state.range(1));
  auto source_page = page_aligned(length + 4096, 0x5a), target_page = page_aligned(length + 4096);
  const uint8_t* source = source_page.get() + 12;
  uint8_t* target = target_page.get() + 12 + distance;
  for (auto _ : state) {
    if constexpr (kPayloadCopy)
      softverbs::copy_payload(target, source, length);
    else
      std::memcpy(target, source, length);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(ReceiveCopy<false>)->Name("Memcpy")->ArgsProduct({{4096, 65536}, {0, 16, 100}});
BENCHMARK(ReceiveCopy<true>)->Name("PayloadCopy")->ArgsProduct({{4096, 65536}, {0, 16, 100}});

// Where the first packet of a read ends (coalesced_read.h), for the reads
// the latency tests make: a WRITE or SEND of `range(0)` bytes and the ACK
// held for it (range(1) 1: a WRITE, 0: a SEND, whose length only its end
// tells). The first packet's ICRC check is part of it, and the receive path
// then skips it.
void FindFirstPacket(benchmark::State& state) {
  const FlowAddress f = flow();
  const size_t length = static_cast<size_t>(state.range(0));
  std::vector<uint8_t> payload(length, 0x5a);
  TransportPacket request;
  request.bth.opcode = opcode(Service::Rc, state.range(1) ? op::kWriteOnly : op::kSendOnly);
  request.bth.dest_qp = 0x12;
  request.reth = {0x7f0000001000ull, 0x1234, static_cast<uint32_t>(length)};
  request.payload = payload;
  TransportPacket ack;
  ack.bth.opcode = opcode(Service::Rc, op::kAcknowledge);
  ack.bth.dest_qp = 0x12;
  std::vector<uint8_t> read = build(request);
  seal(f, read);
  std::vector<uint8_t> ack_bytes = build(ack);
  seal(f, ack_bytes);
  read.insert(read.end(), ack_bytes.begin(), ack_bytes.end());
  IcrcHeaderCache cache;
  for (auto _ : state) benchmark::DoNotOptimize(find_first_packet(f, read, {0x12, 4096}, cache));
}
BENCHMARK(FindFirstPacket)->Args({2, 1})->Args({2, 0})->Args({1024, 0})->Args({4096, 0});

// The same for a read of `range(0)` SENDs of 2 bytes (a stream GRO or a
// GSO send coalesced), whose length only a packet's end tells.
void FindFirstPacketOfStream(benchmark::State& state) {
  const FlowAddress f = flow();
  std::vector<uint8_t> payload(2, 0x5a);
  std::vector<uint8_t> read;
  for (int64_t i = 0; i < state.range(0); ++i) {
    TransportPacket send;
    send.bth.opcode = opcode(Service::Rc, op::kSendOnly);
    send.bth.dest_qp = 0x12;
    send.bth.psn = static_cast<uint32_t>(i);
    send.payload = payload;
    std::vector<uint8_t> bytes = build(send);
    seal(f, bytes);
    read.insert(read.end(), bytes.begin(), bytes.end());
  }
  IcrcHeaderCache cache;
  for (auto _ : state) benchmark::DoNotOptimize(find_first_packet(f, read, {0x12, 4096}, cache));
}
BENCHMARK(FindFirstPacketOfStream)->Arg(2)->Arg(7)->Arg(64);

}  // namespace
