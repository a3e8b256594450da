// The engine: the process's ids and QP1 agents, and the thread that takes
// MADs off the agents and resends what the peer has not answered.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "cm_internal.h"
#include "support/debug_log.h"
#include "support/random_bits.h"

namespace softverbs::cm {

Engine& Engine::instance() {
  static Engine* engine = new Engine;  // lives as long as the process: the CM thread uses it
  return *engine;
}

Engine::Engine() {
  open_wake_pipe();
  std::atexit(wait_for_lingering_at_exit);
  // A forked child has no CM thread and shares the wake pipe: it starts
  // its own of each when it needs them. The lock is held across fork()
  // so that the child never inherits it mid-update.
  pthread_atfork([] { instance().mutex.lock(); }, [] { instance().mutex.unlock(); },
                 [] {
                   Engine& engine = instance();
                   close(engine.wake_read_);
                   close(engine.wake_write_);
                   engine.open_wake_pipe();
                   engine.thread_started_ = false;
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
    start_thread();
    wake();  // the CM thread polls the new agent's descriptor
  }
  return agent.get();
}

void Engine::wake() {
  char byte = 1;
  [[maybe_unused]] ssize_t n = write(wake_write_, &byte, 1);
}

void Engine::start_thread() {
  if (thread_started_) return;
  thread_started_ = true;
  std::thread([this] { run(); }).detach();
}

uint32_t Engine::random_psn() { return static_cast<uint32_t>(random_u64()) & 0xffffff; }

void Engine::open_wake_pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0) {
    wake_read_ = fds[0];
    wake_write_ = fds[1];
  }
}

Due step(Resending& resending, Clock::time_point now) {
  if (resending.at > now) return Due::Not;
  if (resending.left-- <= 0) return Due::Exhausted;
  resending.at = now + kResendAfter;
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

void Engine::run() {
  // Allocated and freed only under the engine's lock, which fork() holds
  // (see the constructor): a child forked while this thread sat in the
  // allocator could find the allocator's lock taken for ever (a suspect
  // for one hang of a forked rdmacm_api_test child in the sanitizer build).
  std::vector<pollfd> fds;
  std::vector<CmAgent*> polled;
  for (;;) {
    int timeout_ms = -1;
    {
      std::lock_guard guard(mutex);
      fds.clear();
      polled.clear();
      fds.push_back({wake_read_, POLLIN, 0});
      for (auto& [context, agent] : agents) {
        fds.push_back({agent->event_fd(), POLLIN, 0});
        polled.push_back(agent.get());
      }
      const Clock::time_point now = Clock::now();
      auto until = [&](Clock::time_point when) {
        const auto wait = std::chrono::ceil<std::chrono::milliseconds>(when - now).count();
        const int ms = static_cast<int>(std::clamp<int64_t>(wait, 0, 60000));
        timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
      };
      for (CmId* id : ids)
        if (id->awaiting_answer) until(id->awaiting_answer->at);
      for (const Lingering& entry : lingering) until(entry.dreq.at);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) continue;
    if (fds[0].revents) {
      char drain[64];
      while (read(wake_read_, drain, sizeof drain) > 0) {
      }
    }
    std::lock_guard guard(mutex);
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      CmAgent* agent = polled[i - 1];
      const bool still_there =
          std::any_of(agents.begin(), agents.end(), [agent](const auto& entry) { return entry.second.get() == agent; });
      if (!still_there) continue;
      for (const ReceivedMad& received : agent->take()) on_mad(*this, agent, received);
    }
    resend_due();
  }
}

// A program that ends right after its disconnect (rping's client does)
// would take its DREQ's retries along; the kernel's CM keeps them. So exit
// waits, up to two retries (~2.2 s, and only while a DREQ is unanswered: a
// peer's device answers for a peer process that died).
void Engine::wait_for_lingering_at_exit() {
  Engine& engine = instance();
  std::unique_lock guard(engine.mutex);
  auto unanswered = [&engine] {
    if (!engine.lingering.empty()) return true;
    for (CmId* id : engine.ids)
      if (id->awaiting_answer && carries_dreq(id->awaiting_answer->mad)) return true;
    return false;
  };
  const auto deadline = Clock::now() + 2 * kResendAfter + std::chrono::milliseconds(100);
  while (unanswered() && engine.thread_started_ && Clock::now() < deadline)
    engine.lingering_drained.wait_for(guard, std::chrono::milliseconds(20));
}

}  // namespace softverbs::cm
