#include "checker/work_checks.h"

#include <isa-l/crc64.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "checker/report.h"

namespace softverbs::provider::check {

namespace {

// A receive's bytes are kept at post up to this many, per work request: the
// bytes beyond the message's byte_len are compared within them.
constexpr size_t kReceiveSnapshotBytes = 4096;

// A 64-bit CRC of a buffer: notices any change of it, and ISA-L's folding
// code reads at close to memory speed (the checker hashes every source byte
// twice, at post and at completion).
uint64_t hash_bytes(const uint8_t* data, size_t length, uint64_t seed) { return crc64_ecma_refl(seed, data, length); }

// Work request opcodes whose local buffers the device reads.
bool reads_local_buffers(int opcode) {
  switch (opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_SEND_WITH_INV:
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_ATOMIC_WRITE:
      return true;
    default:
      return false;
  }
}

struct Key {
  const void* context;
  uint32_t id;  // a QP number or an lkey
  bool operator==(const Key&) const = default;
};
struct KeyHash {
  size_t operator()(const Key& key) const {
    return std::hash<uint64_t>()(reinterpret_cast<uintptr_t>(key.context) * 0x9e3779b97f4a7c15ULL ^ key.id);
  }
};

struct RegionInfo {
  uint64_t address = 0;  // where the region is in this process
  uint64_t iova = 0;     // what its SGEs say
  uint64_t length = 0;
};

// A local buffer as this process sees it.
struct Span {
  const uint8_t* data;
  size_t length;
};

struct SendRecord {
  uint64_t wr_id = 0;
  const void* call_site = nullptr;
  int opcode = 0;
  bool signaled = false;
  std::optional<uint64_t> hash;  // of the source buffers at post (SEND, WRITE, ATOMIC WRITE; not inline)
  std::vector<ibv_sge> sges;     // as posted (none for inline data)
};

struct ReceiveRecord {
  uint64_t wr_id = 0;
  const void* call_site = nullptr;
  std::vector<Span> buffers;      // empty: not followed (a key the checker does not know)
  std::vector<uint8_t> snapshot;  // the first kReceiveSnapshotBytes at post
};

struct QpTrack {
  ibv_qp* qp = nullptr;
  uint32_t max_send_wr = 0;
  // Posted sends whose completion (or a later signaled one) is not polled,
  // in post order: the slots an HCA still holds.
  std::deque<SendRecord> sends;
  size_t signaled_in_sends = 0;
  bool unreaped_reported = false;
  std::deque<ReceiveRecord> receives;
};

struct CheckerState {
  std::mutex mutex;
  std::unordered_map<Key, QpTrack, KeyHash> qps;
  std::unordered_map<Key, RegionInfo, KeyHash> regions;
  std::unordered_map<const ibv_srq*, std::deque<ReceiveRecord>> srq_receives;
  // Destroyed objects kept allocated, and how to free them at context close.
  std::unordered_map<const void*, ObjectKind> destroyed;
  std::unordered_map<const ibv_context*, std::vector<std::pair<const void*, std::function<void()>>>> quarantined;
  std::atomic<size_t> destroyed_count{0};
  // Snapshot buffers of retired receives, reused by the next posts: a
  // receive then costs a copy, not an allocation.
  std::vector<std::vector<uint8_t>> spare_snapshots;
};

constexpr size_t kSpareSnapshots = 1024;

void recycle(CheckerState& state, ReceiveRecord& record) {
  if (record.snapshot.capacity() == 0 || state.spare_snapshots.size() >= kSpareSnapshots) return;
  record.snapshot.clear();
  state.spare_snapshots.push_back(std::move(record.snapshot));
}

CheckerState& checker() {
  static auto* state = new CheckerState;  // never destroyed: polls may come during exit
  return *state;
}

// The SGEs' bytes in this process; nullopt if one is not within a region
// the checker knows (device memory, on-demand or invalid keys are left to
// the device).
std::optional<std::vector<Span>> resolve(CheckerState& state, const ibv_context* context,
                                         std::span<const ibv_sge> sges) {
  std::vector<Span> spans;
  spans.reserve(sges.size());
  for (const ibv_sge& sge : sges) {
    if (sge.length == 0) continue;
    auto found = state.regions.find(Key{context, sge.lkey});
    if (found == state.regions.end()) return std::nullopt;
    const RegionInfo& region = found->second;
    if (sge.addr < region.iova || sge.addr - region.iova > region.length ||
        sge.length > region.length - (sge.addr - region.iova))
      return std::nullopt;
    spans.push_back({reinterpret_cast<const uint8_t*>(region.address + (sge.addr - region.iova)), sge.length});
  }
  return spans;
}

std::optional<uint64_t> hash_of(CheckerState& state, const ibv_context* context, std::span<const ibv_sge> sges) {
  auto spans = resolve(state, context, sges);
  if (!spans) return std::nullopt;
  uint64_t hash = 0x51ed27;
  for (const Span& span : *spans) hash = hash_bytes(span.data, span.length, hash);
  return hash;
}

std::string_view opcode_of(const SendRecord& record) { return send_opcode_name(record.opcode); }

// A send retired by a polled completion: were its source bytes the same?
void retire(CheckerState& state, const QpTrack& track, const SendRecord& record, bool succeeded) {
  if (!succeeded || !record.hash) return;
  const auto now = hash_of(state, track.qp->context, record.sges);
  if (!now || *now == *record.hash) return;
  report({.check = "send-buffer-modified",
          .what = "the source buffer of this work request changed between its post and its completion: an HCA "
                  "reads it by DMA at any moment until the completion, so the peer may receive the old bytes, the "
                  "new ones or a mix",
          .qp_num = track.qp->qp_num,
          .wr_id = record.wr_id,
          .opcode = opcode_of(record),
          .call_site = record.call_site});
}

void send_completed(CheckerState& state, QpTrack& track, const ibv_wc& wc) {
  auto& sends = track.sends;
  // A completion retires its WR and every unsignaled one before it; an
  // error flushes unsignaled WRs with completions of their own.
  auto match =
      std::find_if(sends.begin(), sends.end(), [&](const SendRecord& r) { return r.signaled && r.wr_id == wc.wr_id; });
  if (match == sends.end())
    match = std::find_if(sends.begin(), sends.end(), [&](const SendRecord& r) { return r.wr_id == wc.wr_id; });
  if (match == sends.end()) return;
  const auto end = match + 1;
  for (auto it = sends.begin(); it != end; ++it) {
    retire(state, track, *it, wc.status == IBV_WC_SUCCESS);
    if (it->signaled) {
      --track.signaled_in_sends;
      track.unreaped_reported = false;
    }
  }
  sends.erase(sends.begin(), end);
}

void receive_completed(CheckerState& state, QpTrack& track, const ibv_wc& wc) {
  // A message from the peer answers what this QP sent before (a request
  // and its response, as rping's): the sends' buffers are checked now, and
  // no longer. An application may reuse them once the answer is in, though
  // its CQ may list the answer before the send's own completion.
  for (SendRecord& record : track.sends) {
    retire(state, track, record, true);
    record.hash.reset();
  }
  std::deque<ReceiveRecord>* receives = &track.receives;
  if (track.qp->srq != nullptr) {
    auto found = state.srq_receives.find(track.qp->srq);
    if (found == state.srq_receives.end()) return;
    receives = &found->second;
  }
  auto match =
      std::find_if(receives->begin(), receives->end(), [&](const ReceiveRecord& r) { return r.wr_id == wc.wr_id; });
  if (match == receives->end()) return;
  if (wc.status == IBV_WC_SUCCESS) {
    // The device wrote byte_len bytes from the start; nothing beyond.
    size_t offset = 0, changed_at = SIZE_MAX;
    const size_t kept = match->snapshot.size();
    for (const Span& span : match->buffers) {
      if (offset >= kept) break;
      const size_t length = std::min(span.length, kept - offset);
      if (offset + length > wc.byte_len) {
        const size_t skip = wc.byte_len > offset ? wc.byte_len - offset : 0;
        const uint8_t* now = span.data + skip;
        const uint8_t* then = match->snapshot.data() + offset + skip;
        if (std::memcmp(now, then, length - skip) != 0) {
          changed_at = offset + skip + (std::mismatch(now, now + (length - skip), then).first - now);
          break;
        }
      }
      offset += length;
    }
    if (changed_at != SIZE_MAX)
      report({.check = "receive-buffer-written",
              .what = "the application wrote into this receive buffer (at byte " + std::to_string(changed_at) +
                      ", beyond the " + std::to_string(wc.byte_len) +
                      " bytes received) while the device owned it: an HCA may place the message over it at any "
                      "moment until the completion",
              .qp_num = wc.qp_num,
              .wr_id = match->wr_id,
              .opcode = "ibv_post_recv",
              .call_site = match->call_site});
  }
  recycle(state, *match);
  receives->erase(match);
}

ReceiveRecord make_receive_record(CheckerState& state, const ibv_context* context, const ibv_recv_wr& wr,
                                  const void* call_site) {
  ReceiveRecord record{wr.wr_id, call_site, {}, {}};
  if (wr.num_sge <= 0) return record;
  auto spans = resolve(state, context, std::span(wr.sg_list, static_cast<size_t>(wr.num_sge)));
  if (!spans) return record;
  record.buffers = std::move(*spans);
  if (!state.spare_snapshots.empty()) {
    record.snapshot = std::move(state.spare_snapshots.back());
    state.spare_snapshots.pop_back();
  }
  for (const Span& span : record.buffers) {
    const size_t take = std::min(span.length, kReceiveSnapshotBytes - record.snapshot.size());
    record.snapshot.insert(record.snapshot.end(), span.data, span.data + take);
    if (record.snapshot.size() == kReceiveSnapshotBytes) break;
  }
  return record;
}

}  // namespace

void send_posted(ibv_qp* qp, const ibv_send_wr& wr, bool signaled, uint32_t max_send_wr, const void* call_site) {
  CheckerState& state = checker();
  std::lock_guard guard(state.mutex);
  QpTrack& track = state.qps[Key{qp->context, qp->qp_num}];
  track.qp = qp;
  track.max_send_wr = max_send_wr;
  SendRecord& record = track.sends.emplace_back();
  record.wr_id = wr.wr_id;
  record.call_site = call_site;
  record.opcode = wr.opcode;
  record.signaled = signaled;
  const bool has_buffers = wr.opcode != IBV_WR_LOCAL_INV && wr.opcode != IBV_WR_BIND_MW && wr.num_sge > 0;
  if (has_buffers && !(wr.send_flags & IBV_SEND_INLINE)) {
    record.sges.assign(wr.sg_list, wr.sg_list + wr.num_sge);
    if (reads_local_buffers(wr.opcode)) record.hash = hash_of(state, qp->context, record.sges);
  }
  if (signaled) ++track.signaled_in_sends;
  if (!track.unreaped_reported && track.signaled_in_sends == 0 && track.sends.size() >= track.max_send_wr) {
    track.unreaped_reported = true;
    report({.check = "unsignaled-sends-not-reaped",
            .what = "this post fills the send queue (max_send_wr " + std::to_string(track.max_send_wr) +
                    ") with unsignaled work requests only: an HCA frees send queue slots only when a later "
                    "signaled completion is polled, so the next post fails with ENOMEM",
            .qp_num = qp->qp_num,
            .wr_id = wr.wr_id,
            .opcode = send_opcode_name(wr.opcode),
            .call_site = call_site});
  }
  // Past a full queue the oldest are dropped (an HCA's post would fail).
  while (track.sends.size() > track.max_send_wr) {
    if (track.sends.front().signaled) --track.signaled_in_sends;
    track.sends.pop_front();
  }
}

void receives_posting(ibv_qp* qp, ibv_srq* srq, const ibv_recv_wr* chain, const void* call_site) {
  CheckerState& state = checker();
  std::lock_guard guard(state.mutex);
  std::deque<ReceiveRecord>* receives;
  ibv_context* context;
  if (srq != nullptr) {
    receives = &state.srq_receives[srq];
    context = srq->context;
  } else {
    QpTrack& track = state.qps[Key{qp->context, qp->qp_num}];
    track.qp = qp;
    receives = &track.receives;
    context = qp->context;
  }
  for (const ibv_recv_wr* wr = chain; wr != nullptr; wr = wr->next)
    receives->push_back(make_receive_record(state, context, *wr, call_site));
}

void receives_not_posted(ibv_qp* qp, ibv_srq* srq, const ibv_recv_wr* first_refused) {
  CheckerState& state = checker();
  std::lock_guard guard(state.mutex);
  std::deque<ReceiveRecord>* receives = nullptr;
  if (srq != nullptr) {
    receives = &state.srq_receives[srq];
  } else if (auto found = state.qps.find(Key{qp->context, qp->qp_num}); found != state.qps.end()) {
    receives = &found->second.receives;
  }
  for (const ibv_recv_wr* wr = first_refused; wr != nullptr && receives != nullptr && !receives->empty();
       wr = wr->next) {
    recycle(state, receives->back());
    receives->pop_back();
  }
}

bool refuses_post(ibv_qp* qp, const ibv_send_wr* chain, const void* call_site) {
  if (used_after_destroy(ObjectKind::Qp, qp, "ibv_post_send", call_site)) return true;
  if (qp->qp_type != IBV_QPT_UD) return false;
  for (const ibv_send_wr* wr = chain; wr != nullptr; wr = wr->next)
    if (used_after_destroy(ObjectKind::Ah, wr->wr.ud.ah, "ibv_post_send", call_site)) return true;
  return false;
}

void completions_polled(ibv_cq* cq, const ibv_wc* completions, int count) {
  CheckerState& state = checker();
  std::lock_guard guard(state.mutex);
  for (int i = 0; i < count; ++i) {
    const ibv_wc& wc = completions[i];
    auto found = state.qps.find(Key{cq->context, wc.qp_num});
    if (found == state.qps.end()) continue;
    if (wc.opcode & IBV_WC_RECV)
      receive_completed(state, found->second, wc);
    else
      send_completed(state, found->second, wc);
  }
}

void mr_registered(const ibv_mr* mr, uint64_t iova, int access_flags) {
  if (access_flags & IBV_ACCESS_ON_DEMAND) return;  // its pages need not be there: not read by the checker
  CheckerState& state = checker();
  std::lock_guard guard(state.mutex);
  state.regions[Key{mr->context, mr->lkey}] = {reinterpret_cast<uint64_t>(mr->addr), iova, mr->length};
}

void mr_deregistering(const ibv_mr* mr, const std::function<size_t(ibv_qp*)>& outstanding_sends,
                      const void* call_site) {
  CheckerState& state = checker();
  std::vector<ibv_qp*> naming;
  {
    std::lock_guard guard(state.mutex);
    state.regions.erase(Key{mr->context, mr->lkey});
    for (auto& [key, track] : state.qps) {
      if (key.context != mr->context) continue;
      for (const SendRecord& record : track.sends)
        if (std::any_of(record.sges.begin(), record.sges.end(),
                        [&](const ibv_sge& sge) { return sge.lkey == mr->lkey; })) {
          naming.push_back(track.qp);
          break;
        }
    }
  }
  // The device's count, asked without the checker's lock (a post holds its
  // QP's lock while it reports to the checker).
  std::vector<size_t> outstanding;
  for (ibv_qp* qp : naming) outstanding.push_back(outstanding_sends(qp));
  std::lock_guard guard(state.mutex);
  for (size_t i = 0; i < naming.size(); ++i) {
    auto found = state.qps.find(Key{naming[i]->context, naming[i]->qp_num});
    if (found == state.qps.end() || outstanding[i] == 0) continue;
    const auto& sends = found->second.sends;
    // The device completes in order: the last `outstanding` are its own.
    for (size_t j = sends.size() - std::min(outstanding[i], sends.size()); j < sends.size(); ++j) {
      const SendRecord& record = sends[j];
      if (std::none_of(record.sges.begin(), record.sges.end(),
                       [&](const ibv_sge& sge) { return sge.lkey == mr->lkey; }))
        continue;
      report({.check = "mr-deregistered-in-use",
              .what = "the memory region (lkey " + std::to_string(mr->lkey) +
                      ") was deregistered while this work request, which names it, was outstanding: an HCA "
                      "completes it with a protection error, or reads or writes memory that is no longer yours",
              .qp_num = naming[i]->qp_num,
              .wr_id = record.wr_id,
              .opcode = opcode_of(record),
              .call_site = record.call_site,
              .backtrace_of_caller = true});
      break;
    }
  }
  (void)call_site;
}

void qp_destroying(ibv_qp* qp, const std::function<size_t()>& count_outstanding, const void* call_site) {
  // Up to a second for what is in flight (over UDP a send stays outstanding
  // until its ACK, later on a loaded machine): the report is for sends that
  // would never complete.
  size_t outstanding_sends = count_outstanding();
  for (int i = 0; i < 1000 && outstanding_sends > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    outstanding_sends = count_outstanding();
  }
  CheckerState& state = checker();
  std::lock_guard guard(state.mutex);
  auto found = state.qps.find(Key{qp->context, qp->qp_num});
  if (outstanding_sends > 0) {
    Finding finding{.check = "qp-destroyed-with-outstanding-sends",
                    .what = std::to_string(outstanding_sends) +
                            " send work request(s) of this QP were still outstanding at ibv_destroy_qp: they never "
                            "complete, and an HCA may still be reading their buffers",
                    .qp_num = qp->qp_num,
                    .call_site = call_site,
                    .backtrace_of_caller = true};
    if (found != state.qps.end() && !found->second.sends.empty()) {
      const auto& sends = found->second.sends;
      const SendRecord& oldest = sends[sends.size() - std::min(outstanding_sends, sends.size())];
      finding.wr_id = oldest.wr_id;
      finding.opcode = opcode_of(oldest);
      finding.call_site = oldest.call_site;
    }
    report(finding);
  }
  if (found != state.qps.end()) state.qps.erase(found);
}

void cq_destroying(ibv_cq*, int qp_references, const void*) {
  if (qp_references <= 0) return;
  report({.check = "cq-destroyed-in-use",
          .what = "ibv_destroy_cq on a CQ that live QPs still complete on (" + std::to_string(qp_references) +
                  " send or receive queues): destroy the QPs first (an HCA refuses with EBUSY)",
          .backtrace_of_caller = true});
}

void srq_destroying(ibv_srq* srq, int qp_references, const void*) {
  {
    CheckerState& state = checker();
    std::lock_guard guard(state.mutex);
    if (qp_references <= 0) state.srq_receives.erase(srq);
  }
  if (qp_references <= 0) return;
  report({.check = "srq-destroyed-in-use",
          .what = "ibv_destroy_srq on an SRQ that " + std::to_string(qp_references) +
                  " live QP(s) still receive from: destroy them first (an HCA refuses with EBUSY)",
          .backtrace_of_caller = true});
}

void pd_deallocating(ibv_pd*, int users, const void*) {
  if (users <= 0) return;
  report({.check = "pd-deallocated-in-use",
          .what = "ibv_dealloc_pd on a protection domain that still has " + std::to_string(users) +
                  " object(s) (MRs, QPs, SRQs, AHs, windows): free them first (an HCA refuses with EBUSY)",
          .backtrace_of_caller = true});
}

void quarantine(ibv_context* context, ObjectKind kind, const void* handle, std::function<void()> release) {
  CheckerState& state = checker();
  std::lock_guard guard(state.mutex);
  state.destroyed[handle] = kind;
  state.quarantined[context].emplace_back(handle, std::move(release));
  state.destroyed_count.fetch_add(1, std::memory_order_release);
}

bool used_after_destroy(ObjectKind kind, const void* handle, const char* verb, const void* call_site) {
  CheckerState& state = checker();
  if (state.destroyed_count.load(std::memory_order_acquire) == 0) return false;
  {
    std::lock_guard guard(state.mutex);
    auto found = state.destroyed.find(handle);
    if (found == state.destroyed.end() || found->second != kind) return false;
  }
  static constexpr const char* kNames[] = {"QP", "CQ", "MR", "AH", "SRQ"};
  report({.check = "use-after-destroy",
          .what = std::string(verb) + " through a" + (kind == ObjectKind::Ah ? "n " : " ") +
                  kNames[static_cast<int>(kind)] +
                  " handle that was destroyed before: on an HCA its memory is freed and the call reads garbage or "
                  "crashes (softverbs keeps it under --check and fails the call with EINVAL)",
          .call_site = call_site,
          .backtrace_of_caller = true});
  return true;
}

void release_quarantine(ibv_context* context) {
  CheckerState& state = checker();
  std::vector<std::pair<const void*, std::function<void()>>> releases;
  {
    std::lock_guard guard(state.mutex);
    auto found = state.quarantined.find(context);
    if (found == state.quarantined.end()) return;
    releases = std::move(found->second);
    state.quarantined.erase(found);
    // Freed, the addresses may come back as new objects: forget them.
    for (const auto& [handle, release] : releases) state.destroyed.erase(handle);
  }
  for (auto& [handle, release] : releases) release();
}

}  // namespace softverbs::provider::check
