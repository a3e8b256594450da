#include "verbs/adversary.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "device/device_memory.h"
#include "device/event_socket.h"
#include "support/random_bits.h"

namespace softverbs::adversary {

namespace {

// The most completions a CQ stages: the ring keeps the rest, so a CQ
// overrun still happens about where it would.
constexpr size_t kMaxStaged = 16;
// A staged completion waits at most this many polls of its CQ.
constexpr uint32_t kMaxHeldPolls = 3;

std::optional<uint64_t> run_seed_from_environment() {
  const char* text = std::getenv("SOFTVERBS_ADVERSARIAL");
  if (text == nullptr) return std::nullopt;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (*text == '\0' || *end != '\0') return random_u64() >> 1;  // no number given: one at random
  return value;
}

// splitmix64: small, good enough, and the same everywhere.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The process's command line: what tells the two sides of a run apart, the
// same at every replay (a pid is not).
uint64_t command_line_hash() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t hash = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ULL;
  return hash;
}

struct Staged {
  Completion completion;
  uint32_t polls_held = 0;
  uint32_t hold_for = 0;  // polls before it may be returned
};

struct StagedCq {
  std::vector<Staged> entries;  // in the order the CQ produced them
  uint32_t budget = 0;          // what the current start/next_poll may still return
  bool delivered = false;       // has returned a completion: spurious events may follow
};

class Adversary {
 public:
  Adversary() : run_seed_(run_seed_from_environment().value_or(0)) {
    reseed(command_line_hash());
    pthread_atfork([] { instance().mutex.lock(); }, [] { instance().mutex.unlock(); },
                   [] {
                     instance().mutex.unlock();
                     instance().forked();
                   });
  }

  static Adversary& instance() {
    static Adversary* adversary = new Adversary();  // never destroyed: used to the last poll
    return *adversary;
  }

  uint64_t run_seed() const { return run_seed_; }
  uint64_t process_seed() const { return process_seed_; }

  uint64_t next() {
    state_ = mix(state_);
    return state_;
  }
  uint32_t below(uint32_t bound) { return static_cast<uint32_t>(next() % bound); }
  bool one_in(uint32_t n) { return below(n) == 0; }

  std::mutex mutex;
  std::map<std::pair<const DeviceMemory*, int>, StagedCq> cqs;
  std::map<uint32_t, bool> naked_targets;
  bool slow = false;

 private:
  void reseed(uint64_t salt) {
    process_seed_ = mix(run_seed_ ^ mix(salt));
    state_ = process_seed_;
    slow = (mix(process_seed_) & 1) != 0;
  }
  // A forked child goes on with a generator of its own: the parent's and
  // the number of children it made before.
  void forked() {
    reseed(process_seed_ ^ mix(++children_));
    cqs.clear();
  }

  uint64_t run_seed_;
  uint64_t process_seed_ = 0;
  uint64_t state_ = 0;
  uint64_t children_ = 0;
};

// Whether `entry` may be returned before `earlier`, which the CQ produced
// first: only if they are of different work queues. The send and receive
// queues of one QP are two; an error completion (whose opcode says nothing)
// keeps its QP's order whole.
bool may_pass(const Completion& entry, const Completion& earlier) {
  if (entry.qp_num != earlier.qp_num) return true;
  if (entry.status != WcStatus::Success || earlier.status != WcStatus::Success) return false;
  const bool receive = static_cast<uint32_t>(entry.opcode) & 0x80;
  const bool earlier_receive = static_cast<uint32_t>(earlier.opcode) & 0x80;
  return receive != earlier_receive;
}

// Takes what the ring has into the staging area and counts one poll.
void refill(StagedCq& cq, CqPoller& ring, Adversary& adversary) {
  for (Staged& staged : cq.entries) ++staged.polls_held;
  if (cq.entries.size() >= kMaxStaged) return;
  Completion fresh[kMaxStaged];
  const size_t got = ring.pop_ready(std::span(fresh, kMaxStaged - cq.entries.size()));
  for (size_t i = 0; i < got; ++i) {
    // Most completions are held a poll or more: delayed past the poll that
    // would have found them.
    cq.entries.push_back({fresh[i], 0, adversary.one_in(4) ? 0 : 1 + adversary.below(kMaxHeldPolls)});
  }
}

// Takes out one completion that may be returned now, chosen at random
// among the heads of the work queues; false if none may.
bool take_one(StagedCq& cq, Adversary& adversary, Completion& out) {
  size_t eligible[kMaxStaged];
  size_t count = 0;
  for (size_t i = 0; i < cq.entries.size(); ++i) {
    const Staged& staged = cq.entries[i];
    if (staged.polls_held < staged.hold_for) continue;
    bool blocked = false;
    for (size_t j = 0; j < i && !blocked; ++j) blocked = !may_pass(staged.completion, cq.entries[j].completion);
    if (!blocked) eligible[count++] = i;
  }
  if (count == 0) return false;
  const size_t chosen = eligible[adversary.below(static_cast<uint32_t>(count))];
  out = cq.entries[chosen].completion;
  cq.delivered = true;
  cq.entries.erase(cq.entries.begin() + static_cast<ptrdiff_t>(chosen));
  return true;
}

// How many of the ready completions this poll returns, at most.
uint32_t poll_budget(Adversary& adversary, size_t asked) {
  if (asked <= 1) return static_cast<uint32_t>(asked);
  return adversary.one_in(2) ? static_cast<uint32_t>(asked) : 1 + adversary.below(static_cast<uint32_t>(asked));
}

// Sends the CQ's completion event if it is armed (and disarms it), as a
// completion arriving would.
void wake_if_armed(DeviceMemory& memory, int cq_index) {
  CqRecord& cq = memory.shared().cqs[cq_index];
  SocketAddress channel;
  uint64_t handle = 0;
  {
    SharedLock lock(cq.lock);
    if (!cq.live || cq.armed == CqArm::None || cq.channel.length == 0) return;
    cq.armed = CqArm::None;
    channel = cq.channel;
    handle = cq.owner_handle;
  }
  send_datagram(channel, &handle, sizeof handle);
}

}  // namespace

namespace detail {
const bool kEnabled = std::getenv("SOFTVERBS_ADVERSARIAL") != nullptr;
}

uint64_t process_seed() { return Adversary::instance().process_seed(); }

void announce() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::fprintf(stderr, "softverbs adversarial: seed %llu\n",
                 static_cast<unsigned long long>(Adversary::instance().run_seed()));
  });
}

size_t poll(DeviceMemory& memory, int cq_index, CqPoller& ring, std::span<Completion> out) {
  Adversary& adversary = Adversary::instance();
  bool wake;
  size_t returned = 0;
  {
    std::lock_guard guard(adversary.mutex);
    StagedCq& cq = adversary.cqs[{&memory, cq_index}];
    refill(cq, ring, adversary);
    const uint32_t budget = poll_budget(adversary, out.size());
    while (returned < budget && take_one(cq, adversary, out[returned])) ++returned;
    wake = !cq.entries.empty();
  }
  // What stays staged must not leave a waiting program without its event.
  if (wake) wake_if_armed(memory, cq_index);
  return returned;
}

bool start_poll(DeviceMemory& memory, int cq_index, CqPoller& ring, Completion& out) {
  Adversary& adversary = Adversary::instance();
  bool taken, wake;
  {
    std::lock_guard guard(adversary.mutex);
    StagedCq& cq = adversary.cqs[{&memory, cq_index}];
    refill(cq, ring, adversary);
    cq.budget = poll_budget(adversary, kMaxStaged);
    taken = take_one(cq, adversary, out);
    if (taken) --cq.budget;
    wake = !cq.entries.empty();
  }
  if (wake) wake_if_armed(memory, cq_index);
  return taken;
}

bool next_poll(DeviceMemory& memory, int cq_index, Completion& out) {
  Adversary& adversary = Adversary::instance();
  std::lock_guard guard(adversary.mutex);
  StagedCq& cq = adversary.cqs[{&memory, cq_index}];
  if (cq.budget == 0 || !take_one(cq, adversary, out)) return false;
  --cq.budget;
  return true;
}

void armed(DeviceMemory& memory, int cq_index) {
  Adversary& adversary = Adversary::instance();
  bool wake;
  {
    std::lock_guard guard(adversary.mutex);
    auto found = adversary.cqs.find({&memory, cq_index});
    // An HCA's event without a ready completion is the event of one the
    // program already reaped, so only a CQ that has delivered gets one.
    // (UCX's UD transport asserts on an event between opening and querying
    // its interface.)
    const bool staged = found != adversary.cqs.end() && !found->second.entries.empty();
    const bool delivered = found != adversary.cqs.end() && found->second.delivered;
    wake = staged || (delivered && adversary.one_in(8));
  }
  if (wake) wake_if_armed(memory, cq_index);
}

void forget_cq(DeviceMemory& memory, int cq_index) {
  Adversary& adversary = Adversary::instance();
  std::lock_guard guard(adversary.mutex);
  adversary.cqs.erase({&memory, cq_index});
}

void purge_qp(DeviceMemory& memory, int cq_index, uint32_t qpn) {
  Adversary& adversary = Adversary::instance();
  std::lock_guard guard(adversary.mutex);
  auto found = adversary.cqs.find({&memory, cq_index});
  if (found == adversary.cqs.end()) return;
  std::erase_if(found->second.entries, [qpn](const Staged& staged) { return staged.completion.qp_num == qpn; });
}

bool rnr_for_first_send(uint32_t target_qpn) {
  Adversary& adversary = Adversary::instance();
  std::lock_guard guard(adversary.mutex);
  return adversary.naked_targets.emplace(target_qpn, true).second;
}

std::vector<Piece> placement_pieces(uint64_t total) {
  if (total <= 8) return {{0, total}};
  Adversary& adversary = Adversary::instance();
  std::lock_guard guard(adversary.mutex);
  // 2 to 4 pieces, cut at 8-byte boundaries where the message allows.
  const uint32_t count = 2 + adversary.below(3);
  std::vector<uint64_t> cuts{0, total};
  for (uint32_t i = 1; i < count; ++i) {
    uint64_t cut = (1 + adversary.next() % (total - 1));
    if (total >= 16) cut = std::max<uint64_t>(8, cut & ~uint64_t{7});
    cuts.push_back(std::min(cut, total - 1));
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<Piece> pieces;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) pieces.push_back({cuts[i], cuts[i + 1] - cuts[i]});
  // The last piece first more often than not: what catches a program that
  // polls the last byte for the whole.
  std::reverse(pieces.begin(), pieces.end());
  for (size_t i = pieces.size() - 1; i > 0; --i)
    if (adversary.one_in(3)) std::swap(pieces[i], pieces[adversary.below(static_cast<uint32_t>(i + 1))]);
  return pieces;
}

void pause_between_pieces() {
  uint32_t micros;
  {
    Adversary& adversary = Adversary::instance();
    std::lock_guard guard(adversary.mutex);
    micros = 20 + adversary.below(200);
  }
  std::this_thread::sleep_for(std::chrono::microseconds(micros));
}

void maybe_stall() {
  Adversary& adversary = Adversary::instance();
  if (!adversary.slow) return;
  uint32_t micros;
  {
    std::lock_guard guard(adversary.mutex);
    if (!adversary.one_in(64)) return;
    micros = 50 + adversary.below(300);
  }
  std::this_thread::sleep_for(std::chrono::microseconds(micros));
}

}  // namespace softverbs::adversary
