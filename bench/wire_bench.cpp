// Micro-benchmarks of the UDP transport's per-packet work: building and
// parsing transport headers, and the ICRC (zlib's CRC-32 underneath).
#include <benchmark/benchmark.h>

#include <vector>

#include "icrc.h"
#include "roce_headers.h"
#include "roce_packet.h"

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

}  // namespace
