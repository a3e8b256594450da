// The engine: the process's ids and QP1 agents, served by the process's
// background runtime (support/background.h), which takes MADs off the
// agents and resends what the peer has not answered.
#include <pthread.h>

#include <algorithm>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>

#include "cm_internal.h"
#include "support/background.h"
#include "support/debug_log.h"
#include "support/random_bits.h"

namespace softverbs::cm {

using boost::asio::posix::stream_descriptor;

// How often connected ids look whether their peer process still lives, and
// the device's connections whether theirs does.
constexpr auto kPeerCheckEvery = std::chrono::milliseconds(250);
// How often a process with a QP1 agent looks for its device's connections
// while none is recorded: another process may make one and die.
constexpr auto kIdleSweepEvery = std::chrono::seconds(1);

// Made on the runtime's io_context of `generation`. A forked child's are
// its parent's: it abandons them (see waits()).
struct Engine::Waits {
  uint64_t generation = 0;
  boost::asio::io_context* io = nullptr;
  // Each agent's event descriptor, waited on for reading. It never closes
  // the fd, which is the agent's: the agents outlive it (a parent's are
  // never destroyed, a child abandons them).
  std::map<CmAgent*, std::unique_ptr<stream_descriptor>> descriptors;
  std::unique_ptr<boost::asio::steady_timer> timer;
  std::optional<Clock::time_point> armed_for;  // the timer's pending wait
};

Engine& Engine::instance() {
  static Engine* engine = new Engine;  // lives as long as the process: the runtime's handlers use it
  return *engine;
}

Engine::Engine() : waits_(std::make_unique<Waits>()) {
  // The runtime registers its fork handlers first, so that fork() takes
  // the engine's lock before the runtime's, the order in which the
  // engine's handlers (which hold the engine's lock) reach the runtime.
  (void)background::io_context();
  std::atexit(wait_for_lingering_at_exit);
  // The lock is held across fork() so that the child never inherits it
  // mid-update. The child's runtime is a fresh one: waits() abandons the
  // parent's descriptors and timer when the child next needs them.
  pthread_atfork([] { instance().mutex.lock(); }, [] { instance().mutex.unlock(); },
                 [] {
                   Engine& engine = instance();
                   // The parent's QP1 agents are the parent's: REQs for
                   // them go to it. The child makes its own (the verbs
                   // objects are left alone: they belong to the parent).
                   for (auto& [context, agent] : engine.agents) (void)agent.release();
                   engine.agents.clear();
                   for (CmId* id : engine.ids) {
                     id->agent = nullptr;
                     id->awaiting_answer.reset();
                     id->listening.clear();
                   }
                   // A recursive mutex knows its owner by thread id, which
                   // the child's only thread does not have: start afresh.
                   new (&engine.mutex) std::recursive_mutex;
                   new (&engine.events_acked) std::condition_variable_any;
                 });
}

Engine::~Engine() = default;

Engine::Waits& Engine::waits() {
  Waits& w = *waits_;
  const uint64_t generation = background::generation();
  if (w.io != nullptr && w.generation == generation) return w;
  // Destroying them would touch the parent's io_context: they are abandoned.
  for (auto& [agent, descriptor] : w.descriptors) background::abandon(std::move(descriptor));
  w.descriptors.clear();
  background::abandon(std::move(w.timer));
  w.io = &background::io_context();
  w.generation = generation;
  w.timer = std::make_unique<boost::asio::steady_timer>(*w.io);
  w.armed_for.reset();
  return w;
}

// Whether the runtime serves this process's engine (not, in a forked child,
// until it has made its own waits).
bool Engine::served() const { return waits_->io != nullptr && waits_->generation == background::generation(); }

CmAgent* Engine::agent_for(ibv_context* context) {
  if (context == nullptr) return nullptr;
  auto& agent = agents[context];
  if (!agent) {
    agent = CmAgent::create(context, devices.pd_for(context));
    if (!agent) {
      debug_log("rdma_cm: no QP1 agent on %s: %s", ibv_get_device_name(context->device), strerror(errno));
      agents.erase(context);
      return nullptr;
    }
    watch(agent.get());
    schedule_resends();  // its sweeps (sweep_orphans)
  }
  return agent.get();
}

uint32_t Engine::random_psn() { return static_cast<uint32_t>(random_u64()) & 0xffffff; }

// Waits for the agent's descriptor to be readable, and again after each
// time. asio's epoll is edge-triggered: each datagram on the descriptor
// (a completion socket) is an edge, and the wait is queued again before
// the runtime's thread polls again, so none goes unseen.
void Engine::watch(CmAgent* agent) {
  Waits& w = waits();
  auto& descriptor = w.descriptors[agent];
  if (!descriptor) descriptor = std::make_unique<stream_descriptor>(*w.io, agent->event_fd());
  descriptor->async_wait(stream_descriptor::wait_read, [this, agent](const boost::system::error_code& error) {
    if (error == boost::asio::error::operation_aborted) return;
    std::lock_guard guard(mutex);
    if (error) {
      debug_log("rdma_cm: waiting on a QP1 agent: %s", error.message().c_str());
      return;
    }
    on_readable(agent);
    watch(agent);
  });
}

void Engine::on_readable(CmAgent* agent) {
  for (const ReceivedMad& received : agent->take()) on_mad(*this, agent, received);
  // A MAD may have answered (or, an MRA or a REJ for want of a listener,
  // rescheduled) what was being resent.
  schedule_resends();
  if (lingering.empty()) lingering_drained.notify_all();
}

void Engine::schedule_resends() {
  std::optional<Clock::time_point> earliest;
  auto consider = [&earliest](Clock::time_point at) {
    if (!earliest || at < *earliest) earliest = at;
  };
  for (CmId* id : ids) {
    if (id->awaiting_answer) consider(id->awaiting_answer->at);
    if (id->timewait_ends) consider(*id->timewait_ends);
  }
  for (const Lingering& entry : lingering) consider(entry.dreq.at);
  if (watching_peers()) {
    if (next_peer_check <= Clock::now()) next_peer_check = Clock::now() + kPeerCheckEvery;
    consider(next_peer_check);
  }
  if (auto sweep = next_orphan_sweep()) consider(*sweep);
  Waits& w = waits();
  if (!earliest) {
    // Idle (no agent yet): no wake-ups.
    if (w.armed_for) w.timer->cancel();
    w.armed_for.reset();
    return;
  }
  // A wait that fires sooner finds nothing due and re-arms.
  if (w.armed_for && *w.armed_for <= *earliest) return;
  w.armed_for = earliest;
  w.timer->expires_at(*earliest);  // cancels the pending wait
  w.timer->async_wait([this](const boost::system::error_code& error) {
    if (error) return;  // cancelled: re-armed for another time
    std::lock_guard guard(mutex);
    waits_->armed_for.reset();
    resend_due();
    end_due_timewaits(Clock::now());
    check_peers(Clock::now());
    sweep_orphans(Clock::now());
    schedule_resends();
  });
}

namespace {
bool peer_on_our_device(CmId* id) {
  return id->state == IdState::Connected && id->id.qp_type != IBV_QPT_UD && id->agent != nullptr &&
         id->remote_comm_id != 0 && id->agent->has_gid(id->peer_gid);
}
}  // namespace

bool Engine::watching_peers() const { return std::any_of(ids.begin(), ids.end(), peer_on_our_device); }

void Engine::check_peers(Clock::time_point now) {
  if (now < next_peer_check) return;
  next_peer_check = now + kPeerCheckEvery;
  for (CmId* id : std::vector<CmId*>(ids.begin(), ids.end())) {
    if (!ids.count(id) || !peer_on_our_device(id) || id->agent->peer_alive(id->remote_comm_id)) continue;
    ended_by_peer(id);
  }
}

std::optional<Clock::time_point> Engine::next_orphan_sweep() const {
  if (agents.empty()) return std::nullopt;
  return next_sweep;
}

void Engine::sweep_orphans(Clock::time_point now) {
  if (agents.empty() || now < next_sweep) return;
  bool recorded = false;
  for (auto& [context, agent] : agents) {
    announce_orphaned_connections(agent.get());
    recorded = recorded || agent->connections_recorded();
  }
  next_sweep = now + (recorded ? kPeerCheckEvery : kIdleSweepEvery);
}

Due step(Resending& resending, Clock::time_point now) {
  if (resending.at > now) return Due::Not;
  if (resending.left-- <= 0) return Due::Exhausted;
  resending.at = now + kCmResendAfter;
  return Due::Resend;
}

// Resends what is due on ids and lingering DREQs; gives up on what ran out.
void Engine::resend_due() {
  const Clock::time_point now = Clock::now();
  for (CmId* id : std::vector<CmId*>(ids.begin(), ids.end())) {
    if (!ids.count(id) || !id->awaiting_answer) continue;
    const Due due = step(*id->awaiting_answer, now);
    if (due == Due::Resend && id->agent)
      id->agent->send(id->local_gid, id->peer_gid, id->tos, id->awaiting_answer->mad);
    if (due == Due::Exhausted) on_no_answer(id);
  }
  std::erase_if(lingering, [&](Lingering& entry) {
    const Due due = step(entry.dreq, now);
    if (due == Due::Resend) entry.agent->send(entry.local_gid, entry.peer_gid, entry.tos, entry.dreq.mad);
    return due == Due::Exhausted;
  });
  if (lingering.empty()) lingering_drained.notify_all();
}

void Engine::end_due_timewaits(Clock::time_point now) {
  for (CmId* id : ids) {
    if (!id->timewait_ends || *id->timewait_ends > now) continue;
    id->timewait_ends.reset();
    deliver(id, RDMA_CM_EVENT_TIMEWAIT_EXIT, 0);
  }
}

// A program that ends right after its disconnect (rping's client does)
// would take its DREQ's retries along; the kernel's CM keeps them. So exit
// waits, up to two retries (~2.2 s, and only while a DREQ is unanswered: a
// peer's device answers for a peer process that died). Every id the program
// left ends here as a destroyed one does, as the kernel's CM ends them when
// the process's rdma_cm file closes: a peer on another host has no other way
// to learn of the exit.
void Engine::wait_for_lingering_at_exit() {
  Engine& engine = instance();
  std::unique_lock guard(engine.mutex);
  if (engine.served())
    for (CmId* id : engine.ids) end_connection(engine, id);
  auto unanswered = [&engine] {
    if (!engine.lingering.empty()) return true;
    for (CmId* id : engine.ids)
      if (id->awaiting_answer && carries_dreq(id->awaiting_answer->mad)) return true;
    return false;
  };
  const auto deadline = Clock::now() + 2 * kCmResendAfter + std::chrono::milliseconds(100);
  while (unanswered() && engine.served() && Clock::now() < deadline)
    engine.lingering_drained.wait_for(guard, std::chrono::milliseconds(20));
}

}  // namespace softverbs::cm
