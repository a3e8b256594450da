// Micro-benchmarks of the emulator's hot paths: MR key lookup, completion
// ring push/pop, and a whole work request (WRITE and SEND) through the
// requester between two QPs of this process.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "device/completion_ring.h"
#include "device/device_memory.h"
#include "device/memory_region_table.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "page_aligned.h"
#include "shm/requester.h"

namespace softverbs {
namespace {

void MrKeyLookup(benchmark::State& state) {
  auto table = std::make_unique<MemoryRegionTable>();
  std::vector<uint32_t> keys;
  for (int i = 0; i < 1000; ++i)
    keys.push_back(*table->register_region(1, 1, 0x10000 * (i + 1), 0x10000 * (i + 1), 4096,
                                           access::kRemoteWrite | access::kLocalWrite));
  size_t i = 0;
  ResolvedRange where;
  for (auto _ : state) {
    uint32_t key = keys[i++ % keys.size()];
    benchmark::DoNotOptimize(table->check_remote(
        key, 1, /*qpn=*/0, (key >> 8) * 0 + 0x10000 * ((i - 1) % 1000 + 1) + 64, 64, access::kRemoteWrite, &where));
  }
}
BENCHMARK(MrKeyLookup);

void CompletionRingPushPop(benchmark::State& state) {
  CompletionRingHeader header;
  std::vector<CompletionSlot> storage(1024);
  CompletionRing::initialize(header, storage);
  CompletionRing ring(header, storage);
  Completion c, out;
  for (auto _ : state) {
    ring.push(c);
    ring.pop(std::span(&out, 1));
    benchmark::DoNotOptimize(out);
  }
}
BENCHMARK(CompletionRingPushPop);

// Two RC QPs of this process connected to each other in a scratch device
// memory; the benchmark posts WRITEs or SENDs of `range(0)` bytes.
class LoopbackPair {
 public:
  LoopbackPair() {
    path_ = "/tmp/softverbs-bench-" + std::to_string(getpid()) + ".mem";
    std::string error;
    memory_ = DeviceMemory::open(path_, &error);
    a_ = &memory_->shared().qps[memory_->allocate_qp()];
    b_ = &memory_->shared().qps[memory_->allocate_qp()];
    cq_ = memory_->allocate_cq();
    if (!memory_->allocate_completion_ring(memory_->shared().cqs[cq_], 4096)) {
      std::fprintf(stderr, "datapath_bench: no room for the CQ in %s\n", path_.c_str());
      std::exit(1);
    }
    for (QpRecord* qp : {a_, b_}) {
      qp->type = QpType::Rc;
      qp->state = QpState::Rts;
      qp->pd_handle = 1;
      qp->send_cq = qp->recv_cq = cq_;
      qp->attributes.access_flags = access::kRemoteWrite | access::kLocalWrite;
      qp->rq = allocate_receive_queue(*memory_, 1024, 1);
    }
    a_->attributes.dest_qpn = b_->qpn;
    b_->attributes.dest_qpn = a_->qpn;
    // Page-aligned, as perftest's buffers are (glibc places two vectors of
    // 1 MiB wherever its heap has room, at any distance modulo 4 KiB).
    source_ = bench::page_aligned(1 << 20, 'a');
    sink_ = bench::page_aligned((1 << 20) + 4096);
    source_key_ =
        *memory_->shared().mrs.register_region(1, getpid(), reinterpret_cast<uint64_t>(source_.get()),
                                               reinterpret_cast<uint64_t>(source_.get()), 1 << 20, access::kLocalWrite);
    sink_key_ = *memory_->shared().mrs.register_region(1, getpid(), reinterpret_cast<uint64_t>(sink_.get()),
                                                       reinterpret_cast<uint64_t>(sink_.get()), (1 << 20) + 4096,
                                                       access::kLocalWrite | access::kRemoteWrite);
  }
  ~LoopbackPair() { std::filesystem::remove(path_); }

  // `offset` bytes into the sink: source and sink lie at the same place in
  // their pages, so an offset of 1 to 31 makes the string copy's slow case.
  void write(size_t length, size_t offset) {
    Sge sge{reinterpret_cast<uint64_t>(source_.get()), static_cast<uint32_t>(length), source_key_};
    SendWqe request;
    request.opcode = SendOpcode::RdmaWrite;
    request.sges.assign(1, sge);
    request.remote_address = reinterpret_cast<uint64_t>(sink_.get() + offset);
    request.rkey = sink_key_;
    Completion completion;
    execute_send(*memory_, *a_, request, completion);
  }

  void send(size_t length) {
    Sge recv_sge{reinterpret_cast<uint64_t>(sink_.get()), static_cast<uint32_t>(length), sink_key_};
    post_receive(*memory_, *b_, 1, std::span(&recv_sge, 1));
    Sge sge{reinterpret_cast<uint64_t>(source_.get()), static_cast<uint32_t>(length), source_key_};
    SendWqe request;
    request.opcode = SendOpcode::Send;
    request.sges.assign(1, sge);
    Completion completion, drained;
    execute_send(*memory_, *a_, request, completion);
    CompletionRing ring = memory_->completion_ring(memory_->shared().cqs[cq_]);
    ring.pop(std::span(&drained, 1));
  }

 private:
  std::string path_;
  std::shared_ptr<DeviceMemory> memory_;
  QpRecord* a_;
  QpRecord* b_;
  int cq_;
  bench::PageAligned source_, sink_;
  uint32_t source_key_, sink_key_;
};

void WorkRequestWrite(benchmark::State& state) {
  LoopbackPair pair;
  for (auto _ : state) pair.write(static_cast<size_t>(state.range(0)), static_cast<size_t>(state.range(1)));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(WorkRequestWrite)->ArgsProduct({{8, 4096, 65536}, {0}})->Args({4096, 16})->Args({65536, 16});

void WorkRequestSend(benchmark::State& state) {
  LoopbackPair pair;
  for (auto _ : state) pair.send(static_cast<size_t>(state.range(0)));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(WorkRequestSend)->Arg(8)->Arg(4096);

}  // namespace
}  // namespace softverbs
