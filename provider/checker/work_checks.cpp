#include "checker/work_checks.h"

#include <isa-l/crc64.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "checker/report.h"
#include "verbs_objects.h"

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

// A queue of records in slots that are reused: a slot keeps its vectors'
// buffers, so a post costs no allocation once the ring went round once.
// Made with the queue's own depth; grows only past it.
template <typename T>
class Ring {
 public:
  explicit Ring(size_t capacity = 0) : slots_(std::max<size_t>(capacity, 1)) {}
  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  T& operator[](size_t i) { return slots_[wrap(head_ + i)]; }
  const T& operator[](size_t i) const { return slots_[wrap(head_ + i)]; }
  T& front() { return (*this)[0]; }
  T& back() { return (*this)[count_ - 1]; }
  // A slot at the back, holding what it held before: the caller sets it.
  T& push_back() {
    if (count_ == slots_.size()) grow();
    ++count_;
    return back();
  }
  void pop_back() { --count_; }
  void pop_front(size_t n = 1) {
    head_ = wrap(head_ + n);
    count_ -= n;
  }
  // Out of order (an SRQ's receives): the ones behind move up a place.
  void erase(size_t i) {
    for (; i + 1 < count_; ++i) std::swap((*this)[i], (*this)[i + 1]);
    pop_back();
  }

 private:
  size_t wrap(size_t i) const { return i >= slots_.size() ? i - slots_.size() : i; }
  void grow() {
    std::vector<T> bigger(slots_.size() * 2);
    for (size_t i = 0; i < slots_.size(); ++i) bigger[i] = std::move((*this)[i]);
    slots_ = std::move(bigger);
    head_ = 0;
  }
  std::vector<T> slots_;
  size_t head_ = 0;
  size_t count_ = 0;
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
  bool followed = false;          // false: a key the checker does not know
  std::vector<Span> buffers;      // when followed
  std::vector<uint8_t> snapshot;  // the first kReceiveSnapshotBytes at post
};

}  // namespace

// One QP's outstanding work, reached from the provider's QP at a post and
// through the table of QPs at a poll. Posts to one queue are serialized by
// the application; the mutex orders them with polls on other threads.
struct QpTracker {
  QpTracker(ibv_qp* qp, uint32_t max_send_wr, uint32_t max_recv_wr)
      : qp(qp), max_send_wr(max_send_wr), sends(max_send_wr + 1), receives(max_recv_wr + 1) {}
  std::mutex mutex;
  ibv_qp* const qp;
  const uint32_t max_send_wr;
  // Posted sends whose completion (or a later signaled one) is not polled,
  // in post order: the slots an HCA still holds.
  Ring<SendRecord> sends;
  size_t signaled_in_sends = 0;
  bool unreaped_reported = false;
  Ring<ReceiveRecord> receives;
};

namespace {

struct CheckerState {
  // The tables of QPs and regions: read at posts and polls, written at
  // creates, registrations and destroys.
  std::shared_mutex tables_mutex;
  std::unordered_map<Key, std::shared_ptr<QpTracker>, KeyHash> qps;
  std::unordered_map<Key, RegionInfo, KeyHash> regions;
  std::mutex srq_mutex;  // taken after a QP's, never before
  std::unordered_map<const ibv_srq*, Ring<ReceiveRecord>> srq_receives;
  // The SRQ of every QP made on one, kept past the QP's destroy until the
  // SRQ's: a QP that never posted has no tracker, and a destroyed one's
  // receive completions may still be polled, yet each took an SRQ receive.
  std::unordered_map<Key, const ibv_srq*, KeyHash> srq_of_qp;
  // Destroyed objects kept allocated, and how to free them at context close.
  std::mutex mutex;
  std::unordered_map<const void*, ObjectKind> destroyed;
  std::unordered_map<const ibv_context*, std::vector<std::pair<const void*, std::function<void()>>>> quarantined;
  std::atomic<size_t> destroyed_count{0};
};

CheckerState& checker() {
  static auto* state = new CheckerState;  // never destroyed: polls may come during exit
  return *state;
}

// The QP's tracker, made at its first post (sends and receives may be
// posted from two threads at once).
QpTracker& tracker_of(CheckerState& state, ibv_qp* qp) {
  ProviderQp* provider_qp = to_qp(qp);
  if (QpTracker* tracker = provider_qp->checker.load(std::memory_order_acquire)) return *tracker;
  std::unique_lock lock(state.tables_mutex);
  if (QpTracker* tracker = provider_qp->checker.load(std::memory_order_relaxed)) return *tracker;
  const auto& caps = record_of(provider_qp).caps;
  auto tracker = std::make_shared<QpTracker>(qp, caps.max_send_wr, caps.max_recv_wr);
  state.qps[Key{qp->context, qp->qp_num}] = tracker;
  provider_qp->checker.store(tracker.get(), std::memory_order_release);
  return *tracker;
}

std::shared_ptr<QpTracker> find_tracker(CheckerState& state, const void* context, uint32_t qp_num) {
  std::shared_lock lock(state.tables_mutex);
  auto found = state.qps.find(Key{context, qp_num});
  return found == state.qps.end() ? nullptr : found->second;
}

// Where an SGE's bytes are in this process; null if it is not within a
// region the checker knows (device memory, on-demand or invalid keys are
// left to the device). Called with tables_mutex held.
const uint8_t* locate(CheckerState& state, const ibv_context* context, const ibv_sge& sge) {
  auto found = state.regions.find(Key{context, sge.lkey});
  if (found == state.regions.end()) return nullptr;
  const RegionInfo& region = found->second;
  if (sge.addr < region.iova || sge.addr - region.iova > region.length ||
      sge.length > region.length - (sge.addr - region.iova))
    return nullptr;
  return reinterpret_cast<const uint8_t*>(region.address + (sge.addr - region.iova));
}

// The SGEs' bytes in this process, into `spans`; false if one is not
// within a region the checker knows.
bool resolve(CheckerState& state, const ibv_context* context, std::span<const ibv_sge> sges, std::vector<Span>& spans) {
  spans.clear();
  std::shared_lock lock(state.tables_mutex);
  for (const ibv_sge& sge : sges) {
    if (sge.length == 0) continue;
    const uint8_t* data = locate(state, context, sge);
    if (data == nullptr) return false;
    spans.push_back({data, sge.length});
  }
  return true;
}

// Hashed under the tables' lock: a region is not deregistered (and its
// memory freed) while it is read.
std::optional<uint64_t> hash_of(CheckerState& state, const ibv_context* context, std::span<const ibv_sge> sges) {
  std::shared_lock lock(state.tables_mutex);
  uint64_t hash = 0x51ed27;
  for (const ibv_sge& sge : sges) {
    if (sge.length == 0) continue;
    const uint8_t* data = locate(state, context, sge);
    if (data == nullptr) return std::nullopt;
    hash = hash_bytes(data, sge.length, hash);
  }
  return hash;
}

std::string_view opcode_of(const SendRecord& record) { return send_opcode_name(record.opcode); }

// The source bytes as a poll finds them. The sends one poll retires often
// name the same buffer (an application posting one buffer again and
// again): it is hashed once for them all, at the moment it would have been
// for the first.
class CurrentHashes {
 public:
  std::optional<uint64_t> of(CheckerState& state, const ibv_context* context, const std::vector<ibv_sge>& sges) {
    if (last_sges_ == nullptr || !same(*last_sges_, sges)) {
      last_hash_ = hash_of(state, context, sges);
      last_sges_ = &sges;
    }
    return last_hash_;
  }

 private:
  static bool same(const std::vector<ibv_sge>& a, const std::vector<ibv_sge>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const ibv_sge& x, const ibv_sge& y) {
      return x.addr == y.addr && x.length == y.length && x.lkey == y.lkey;
    });
  }
  const std::vector<ibv_sge>* last_sges_ = nullptr;
  std::optional<uint64_t> last_hash_;
};

// A send retired by a polled completion: were its source bytes the same?
void retire(CheckerState& state, const QpTracker& track, const SendRecord& record, bool succeeded,
            CurrentHashes& current) {
  if (!succeeded || !record.hash) return;
  const auto now = current.of(state, track.qp->context, record.sges);
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

// With the tracker's mutex held.
void send_completed(CheckerState& state, QpTracker& track, const ibv_wc& wc) {
  auto& sends = track.sends;
  // A completion retires its WR and every unsignaled one before it; an
  // error flushes unsignaled WRs with completions of their own.
  size_t match = 0;
  while (match < sends.size() && !(sends[match].signaled && sends[match].wr_id == wc.wr_id)) ++match;
  if (match == sends.size()) {
    match = 0;
    while (match < sends.size() && sends[match].wr_id != wc.wr_id) ++match;
  }
  if (match == sends.size()) return;
  CurrentHashes current;
  for (size_t i = 0; i <= match; ++i) {
    const SendRecord& record = sends[i];
    retire(state, track, record, wc.status == IBV_WC_SUCCESS, current);
    if (record.signaled) {
      --track.signaled_in_sends;
      track.unreaped_reported = false;
    }
  }
  sends.pop_front(match + 1);
}

void check_receive_tail(const ReceiveRecord& record, const ibv_wc& wc) {
  // The device wrote byte_len bytes from the start; nothing beyond.
  size_t offset = 0, changed_at = SIZE_MAX;
  const size_t kept = record.snapshot.size();
  for (const Span& span : record.buffers) {
    if (offset >= kept) break;
    const size_t length = std::min(span.length, kept - offset);
    if (offset + length > wc.byte_len) {
      const size_t skip = wc.byte_len > offset ? wc.byte_len - offset : 0;
      const uint8_t* now = span.data + skip;
      const uint8_t* then = record.snapshot.data() + offset + skip;
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
            .wr_id = record.wr_id,
            .opcode = "ibv_post_recv",
            .call_site = record.call_site});
}

void complete_receive(Ring<ReceiveRecord>& receives, const ibv_wc& wc) {
  size_t match = 0;
  while (match < receives.size() && receives[match].wr_id != wc.wr_id) ++match;
  if (match == receives.size()) return;
  if (wc.status == IBV_WC_SUCCESS && receives[match].followed) check_receive_tail(receives[match], wc);
  if (match == 0)
    receives.pop_front();
  else
    receives.erase(match);
}

// A receive completion of a QP with no tracker (it never posted, or it is
// destroyed): only an SRQ's receive has a record to retire.
void receive_of_untracked_qp(CheckerState& state, const ibv_context* context, const ibv_wc& wc) {
  std::lock_guard guard(state.srq_mutex);
  auto srq = state.srq_of_qp.find(Key{context, wc.qp_num});
  if (srq == state.srq_of_qp.end()) return;
  auto found = state.srq_receives.find(srq->second);
  if (found != state.srq_receives.end()) complete_receive(found->second, wc);
}

// With the tracker's mutex held.
void receive_completed(CheckerState& state, QpTracker& track, const ibv_wc& wc) {
  // A message from the peer answers what this QP sent before (a request
  // and its response, as rping's): the sends' buffers are checked now, and
  // no longer. An application may reuse them once the answer is in, though
  // its CQ may list the answer before the send's own completion.
  CurrentHashes current;
  for (size_t i = 0; i < track.sends.size(); ++i) {
    SendRecord& record = track.sends[i];
    retire(state, track, record, true, current);
    record.hash.reset();
  }
  if (track.qp->srq == nullptr) {
    complete_receive(track.receives, wc);
    return;
  }
  std::lock_guard guard(state.srq_mutex);
  auto found = state.srq_receives.find(track.qp->srq);
  if (found != state.srq_receives.end()) complete_receive(found->second, wc);
}

void fill_receive_record(CheckerState& state, const ibv_context* context, const ibv_recv_wr& wr, const void* call_site,
                         ReceiveRecord& record) {
  record.wr_id = wr.wr_id;
  record.call_site = call_site;
  record.snapshot.clear();
  record.followed =
      wr.num_sge > 0 && resolve(state, context, std::span(wr.sg_list, static_cast<size_t>(wr.num_sge)), record.buffers);
  if (!record.followed) return;
  record.snapshot.reserve(kReceiveSnapshotBytes);
  for (const Span& span : record.buffers) {
    const size_t take = std::min(span.length, kReceiveSnapshotBytes - record.snapshot.size());
    record.snapshot.insert(record.snapshot.end(), span.data, span.data + take);
    if (record.snapshot.size() == kReceiveSnapshotBytes) break;
  }
}

}  // namespace

void send_posting(ibv_qp* qp, const ibv_send_wr& wr, bool signaled, const void* call_site) {
  CheckerState& state = checker();
  QpTracker& track = tracker_of(state, qp);
  const bool has_buffers = wr.opcode != IBV_WR_LOCAL_INV && wr.opcode != IBV_WR_BIND_MW && wr.num_sge > 0 &&
                           !(wr.send_flags & IBV_SEND_INLINE);
  const std::span<const ibv_sge> sges(wr.sg_list, has_buffers ? static_cast<size_t>(wr.num_sge) : 0);
  // Hashed before the QP's lock: a poll on another thread need not wait for it.
  std::optional<uint64_t> hash;
  if (has_buffers && reads_local_buffers(wr.opcode)) hash = hash_of(state, qp->context, sges);
  std::lock_guard guard(track.mutex);
  // Past a full queue the oldest are dropped (an HCA's post would fail);
  // one more is kept until the next post, in case this one is refused.
  while (track.sends.size() > track.max_send_wr) {
    if (track.sends.front().signaled) --track.signaled_in_sends;
    track.sends.pop_front();
  }
  SendRecord& record = track.sends.push_back();
  record.wr_id = wr.wr_id;
  record.call_site = call_site;
  record.opcode = wr.opcode;
  record.signaled = signaled;
  record.hash = hash;
  record.sges.assign(sges.begin(), sges.end());
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
}

void send_not_posted(ibv_qp* qp) {
  QpTracker& track = tracker_of(checker(), qp);
  std::lock_guard guard(track.mutex);
  if (track.sends.empty()) return;
  if (track.sends.back().signaled) --track.signaled_in_sends;
  track.sends.pop_back();
}

void receives_posting(ibv_qp* qp, ibv_srq* srq, const ibv_recv_wr* chain, const void* call_site) {
  CheckerState& state = checker();
  if (srq != nullptr) {
    std::lock_guard guard(state.srq_mutex);
    auto& receives = state.srq_receives[srq];
    for (const ibv_recv_wr* wr = chain; wr != nullptr; wr = wr->next)
      fill_receive_record(state, srq->context, *wr, call_site, receives.push_back());
    return;
  }
  QpTracker& track = tracker_of(state, qp);
  std::lock_guard guard(track.mutex);
  for (const ibv_recv_wr* wr = chain; wr != nullptr; wr = wr->next)
    fill_receive_record(state, qp->context, *wr, call_site, track.receives.push_back());
}

void receives_not_posted(ibv_qp* qp, ibv_srq* srq, const ibv_recv_wr* first_refused) {
  CheckerState& state = checker();
  auto drop = [&](Ring<ReceiveRecord>& receives) {
    for (const ibv_recv_wr* wr = first_refused; wr != nullptr && !receives.empty(); wr = wr->next) receives.pop_back();
  };
  if (srq != nullptr) {
    std::lock_guard guard(state.srq_mutex);
    drop(state.srq_receives[srq]);
    return;
  }
  QpTracker& track = tracker_of(state, qp);
  std::lock_guard guard(track.mutex);
  drop(track.receives);
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
  // A CQ's completions come mostly from one QP: its tracker is looked up once per run of them.
  std::shared_ptr<QpTracker> track;
  std::unique_lock<std::mutex> held;
  for (int i = 0; i < count; ++i) {
    const ibv_wc& wc = completions[i];
    if (!track || track->qp->qp_num != wc.qp_num) {
      if (held) held.unlock();
      track = find_tracker(state, cq->context, wc.qp_num);
      if (!track) {
        if (wc.opcode & IBV_WC_RECV) receive_of_untracked_qp(state, cq->context, wc);
        continue;
      }
      held = std::unique_lock(track->mutex);
    }
    if (wc.opcode & IBV_WC_RECV)
      receive_completed(state, *track, wc);
    else
      send_completed(state, *track, wc);
  }
}

void mr_registered(const ibv_mr* mr, uint64_t iova, int access_flags) {
  if (access_flags & IBV_ACCESS_ON_DEMAND) return;  // its pages need not be there: not read by the checker
  CheckerState& state = checker();
  std::unique_lock lock(state.tables_mutex);
  state.regions[Key{mr->context, mr->lkey}] = {reinterpret_cast<uint64_t>(mr->addr), iova, mr->length};
}

namespace {

bool names_key(const SendRecord& record, uint32_t lkey) {
  return std::any_of(record.sges.begin(), record.sges.end(), [&](const ibv_sge& sge) { return sge.lkey == lkey; });
}

}  // namespace

void mr_deregistering(const ibv_mr* mr, const std::function<size_t(ibv_qp*)>& outstanding_sends,
                      const void* call_site) {
  CheckerState& state = checker();
  std::vector<std::shared_ptr<QpTracker>> trackers, naming;
  {
    std::unique_lock lock(state.tables_mutex);
    state.regions.erase(Key{mr->context, mr->lkey});
    for (auto& [key, track] : state.qps)
      if (key.context == mr->context) trackers.push_back(track);
  }
  // A QP's lock is taken without the tables' (a poll takes them the other way round).
  for (auto& track : trackers) {
    std::lock_guard guard(track->mutex);
    for (size_t i = 0; i < track->sends.size(); ++i)
      if (names_key(track->sends[i], mr->lkey)) {
        naming.push_back(track);
        break;
      }
  }
  // The device's count, asked without the checker's locks (a post holds its
  // QP's lock while it reports to the checker).
  std::vector<size_t> outstanding;
  for (const auto& track : naming) outstanding.push_back(outstanding_sends(track->qp));
  for (size_t i = 0; i < naming.size(); ++i) {
    if (outstanding[i] == 0) continue;
    QpTracker& track = *naming[i];
    std::lock_guard guard(track.mutex);
    const auto& sends = track.sends;
    // The device completes in order: the last `outstanding` are its own.
    for (size_t j = sends.size() - std::min(outstanding[i], sends.size()); j < sends.size(); ++j) {
      const SendRecord& record = sends[j];
      if (!names_key(record, mr->lkey)) continue;
      report({.check = "mr-deregistered-in-use",
              .what = "the memory region (lkey " + std::to_string(mr->lkey) +
                      ") was deregistered while this work request, which names it, was outstanding: an HCA "
                      "completes it with a protection error, or reads or writes memory that is no longer yours",
              .qp_num = track.qp->qp_num,
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
  std::shared_ptr<QpTracker> track;
  {
    std::unique_lock lock(state.tables_mutex);
    auto found = state.qps.find(Key{qp->context, qp->qp_num});
    if (found != state.qps.end() && found->second->qp == qp) {
      track = std::move(found->second);
      state.qps.erase(found);
      to_qp(qp)->checker.store(nullptr, std::memory_order_release);
    }
  }
  if (outstanding_sends == 0) return;
  Finding finding{.check = "qp-destroyed-with-outstanding-sends",
                  .what = std::to_string(outstanding_sends) +
                          " send work request(s) of this QP were still outstanding at ibv_destroy_qp: they never "
                          "complete, and an HCA may still be reading their buffers",
                  .qp_num = qp->qp_num,
                  .call_site = call_site,
                  .backtrace_of_caller = true};
  if (track) {
    std::lock_guard guard(track->mutex);
    const auto& sends = track->sends;
    if (!sends.empty()) {
      const SendRecord& oldest = sends[sends.size() - std::min(outstanding_sends, sends.size())];
      finding.wr_id = oldest.wr_id;
      finding.opcode = opcode_of(oldest);
      finding.call_site = oldest.call_site;
    }
  }
  report(finding);
}

void cq_destroying(ibv_cq*, int qp_references, const void*) {
  if (qp_references <= 0) return;
  report({.check = "cq-destroyed-in-use",
          .what = "ibv_destroy_cq on a CQ that live QPs still complete on (" + std::to_string(qp_references) +
                  " send or receive queues): destroy the QPs first (an HCA refuses with EBUSY)",
          .backtrace_of_caller = true});
}

void qp_created(ibv_qp* qp) {
  if (qp->srq == nullptr) return;
  CheckerState& state = checker();
  std::lock_guard guard(state.srq_mutex);
  state.srq_of_qp[Key{qp->context, qp->qp_num}] = qp->srq;
}

void srq_destroying(ibv_srq* srq, int qp_references, const void*) {
  {
    CheckerState& state = checker();
    std::lock_guard guard(state.srq_mutex);
    if (qp_references <= 0) {
      state.srq_receives.erase(srq);
      std::erase_if(state.srq_of_qp, [srq](const auto& entry) { return entry.second == srq; });
    }
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
