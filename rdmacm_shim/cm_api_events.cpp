// Events: channels (a queue and a descriptor the application polls), how
// events are queued and taken, and the rdma_* calls on channels and events.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <iterator>

#include "cm_internal.h"
#include "support/signals.h"

namespace softverbs::cm {

// A socket pair: the application's end honours O_NONBLOCK and poll, and we
// can take a byte back without blocking (MSG_DONTWAIT).
bool open_channel(EventChannel& channel) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return false;
  channel.channel.fd = fds[0];
  channel.signal_write = fds[1];
  return true;
}

void take_signal_byte(EventChannel& channel) {
  char byte;
  [[maybe_unused]] ssize_t n = recv(channel.channel.fd, &byte, 1, MSG_DONTWAIT);
}

void give_signal_byte(EventChannel& channel) {
  char byte = 1;
  [[maybe_unused]] ssize_t n = send(channel.signal_write, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

void deliver(CmId* id, rdma_cm_event_type type, int status, std::unique_ptr<QueuedEvent> event, EventChannel* channel) {
  if (!event) event = std::make_unique<QueuedEvent>();
  event->event.id = &id->id;
  event->event.event = type;
  event->event.status = status;
  if (channel == nullptr) channel = id->channel;
  channel->queue.push_back(std::move(event));
  give_signal_byte(*channel);
  channel->ready.notify_all();
}

std::unique_ptr<QueuedEvent> event_with_private_data(const uint8_t* data, size_t area, bool ud) {
  auto event = std::make_unique<QueuedEvent>();
  event->private_data.assign(data, data + area);
  if (ud) {
    event->event.param.ud.private_data = event->private_data.data();
    event->event.param.ud.private_data_len = static_cast<uint8_t>(area);
  } else {
    event->event.param.conn.private_data = event->private_data.data();
    event->event.param.conn.private_data_len = static_cast<uint8_t>(area);
  }
  return event;
}

CmId* new_id(EventChannel* channel, void* context, rdma_port_space ps, ibv_qp_type qp_type) {
  auto id = std::make_unique<CmId>();
  if (channel == nullptr) {
    // A synchronous id: its events go to a private channel that the
    // blocking calls read.
    id->own_channel = std::make_unique<EventChannel>();
    if (!open_channel(*id->own_channel)) return nullptr;
    channel = id->own_channel.get();
  }
  id->channel = channel;
  // As librdmacm: a synchronous id's own channel is its id->channel too.
  id->id.channel = &channel->channel;
  id->id.context = context;
  id->id.ps = ps;
  id->id.qp_type = qp_type;
  id->responder_resources = id->initiator_depth = RDMA_MAX_RESP_RES;
  CmId* raw = id.release();
  Engine::instance().ids.insert(raw);
  return raw;
}

std::unique_ptr<QueuedEvent> wait_for(CmId* id, std::initializer_list<rdma_cm_event_type> wanted) {
  Engine& engine = Engine::instance();
  std::unique_lock guard(engine.mutex);
  EventChannel& channel = *id->own_channel;
  for (;;) {
    channel.ready.wait(guard, [&] { return !channel.queue.empty(); });
    std::unique_ptr<QueuedEvent> event = std::move(channel.queue.front());
    channel.queue.pop_front();
    take_signal_byte(channel);
    for (rdma_cm_event_type type : wanted)
      if (event->event.event == type) return event;
  }
}

int finish_sync(CmId* id, std::unique_ptr<QueuedEvent> event, rdma_cm_event_type success) {
  if (!event) return fail(EIO);
  rdma_cm_event_type type = event->event.event;
  int status = event->event.status;
  id->held_event = std::move(event);
  id->id.event = &id->held_event->event;
  if (type == success) return 0;
  if (type == RDMA_CM_EVENT_REJECTED) return fail(ECONNREFUSED);
  if (type == RDMA_CM_EVENT_UNREACHABLE) return fail(ETIMEDOUT);
  return fail(status < 0 ? -status : EIO);
}

namespace {

// The id an event counts for, as librdmacm counts it: a connection request
// for its listener (rdma_destroy_id of the new id does not wait for it; of
// the listener, it does), every other event for its own id. nullptr once
// that id is gone.
CmId* event_owner(Engine& engine, const rdma_cm_event& event) {
  rdma_cm_id* counted = event.event == RDMA_CM_EVENT_CONNECT_REQUEST && event.listen_id ? event.listen_id : event.id;
  CmId* id = priv(counted);
  return engine.ids.count(id) ? id : nullptr;
}

// Closes a channel the application is done with. Another thread in
// rdma_get_cm_event on it keeps blocking, as on the kernel's channel
// (rping's CM thread does until the process exits), and so does one that
// gets there a moment later (rping's, when its main thread tears down
// faster than the kernel's DREP would have come): so the channel's memory
// stays, with the engine, which lives as long.
void retire(Engine& engine, std::unique_ptr<EventChannel> channel) {
  close(channel->channel.fd);
  close(channel->signal_write);
  channel->queue.clear();
  channel->destroyed = true;
  channel->destroyed_by = std::this_thread::get_id();
  engine.retired_channels.push_back(std::move(channel));
}

// The events not yet read for `id` go from its channel to `to`.
void move_events(CmId* id, EventChannel* to) {
  auto& from = id->channel->queue;
  for (auto it = from.begin(); it != from.end();) {
    if ((*it)->event.id == &id->id) {
      to->queue.push_back(std::move(*it));
      take_signal_byte(*id->channel);
      give_signal_byte(*to);
      it = from.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace

rdma_event_channel* create_event_channel() {
  auto channel = std::make_unique<EventChannel>();
  if (!open_channel(*channel)) return nullptr;
  return &channel.release()->channel;
}

void destroy_event_channel(rdma_event_channel* public_channel) {
  if (public_channel == nullptr) return;
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  retire(engine, std::unique_ptr<EventChannel>(priv(public_channel)));
}

int get_cm_event(rdma_event_channel* public_channel, rdma_cm_event** out) {
  if (public_channel == nullptr || out == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::unique_lock guard(engine.mutex);
  EventChannel* channel = priv(public_channel);
  while (channel->queue.empty()) {
    if (channel->destroyed) {
      // The thread that destroyed it gets the kernel's answer for a closed
      // descriptor; any other blocks for good (see retire).
      if (channel->destroyed_by == std::this_thread::get_id()) return fail(EBADF);
      channel->ready.wait(guard, [] { return false; });
    }
    // The application's descriptor decides: O_NONBLOCK set, no waiting.
    const int fd = channel->channel.fd;
    if (fcntl(fd, F_GETFL) & O_NONBLOCK) return fail(EAGAIN);
    // On the descriptor, which has a byte per queued event, rather than the
    // condition variable: a signal's handler ends the wait with EINTR where
    // it would end the kernel's (no SA_RESTART). A retire wakes it too (it
    // closes the other end).
    guard.unlock();
    pollfd readable{fd, POLLIN, 0};
    const int ready = ::poll(&readable, 1, -1);
    const int error = errno;
    guard.lock();
    if (ready < 0 && error == EINTR && channel->queue.empty() && !interrupted_reads_restart()) return fail(EINTR);
  }
  std::unique_ptr<QueuedEvent> event = std::move(channel->queue.front());
  channel->queue.pop_front();
  take_signal_byte(*channel);
  CmId* owner = event_owner(engine, event->event);
  if (owner != nullptr) ++owner->events_taken;
  *out = &event.release()->event;
  return 0;
}

int ack_cm_event(rdma_cm_event* event) {
  if (event == nullptr) return fail(EINVAL);
  std::unique_ptr<QueuedEvent> held(priv(event));
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  if (CmId* owner = event_owner(engine, *event)) {
    ++owner->events_acked;
    engine.events_acked.notify_all();
  }
  return 0;
}

int migrate_id(rdma_cm_id* public_id, rdma_event_channel* channel) {
  if (public_id == nullptr) return fail(EINVAL);
  Engine& engine = Engine::instance();
  std::lock_guard guard(engine.mutex);
  CmId* id = priv(public_id);
  // As librdmacm: a NULL channel makes the id synchronous, with a channel
  // of its own; one that is synchronous already cannot be made so again.
  if (channel == nullptr && id->own_channel) return fail(EINVAL);
  std::unique_ptr<EventChannel> own;
  EventChannel* to;
  if (channel == nullptr) {
    own = std::make_unique<EventChannel>();
    if (!open_channel(*own)) return fail(ENOMEM);
    to = own.get();
  } else {
    to = priv(channel);
  }
  move_events(id, to);
  if (id->own_channel) {
    // A synchronous id leaves its channel, which goes (with the event it
    // held), as librdmacm destroys it: the id is asynchronous from now on.
    id->held_event.reset();
    id->id.event = nullptr;
    retire(engine, std::move(id->own_channel));
  }
  id->own_channel = std::move(own);
  id->channel = to;
  id->id.channel = &to->channel;
  to->ready.notify_all();
  // As librdmacm: the events already taken for the id on its old channel
  // are acked before the call returns, so that none is handled there after.
  std::unique_lock wait(engine.mutex, std::adopt_lock);
  engine.events_acked.wait(wait, [&] { return !engine.ids.count(id) || id->events_acked >= id->events_taken; });
  wait.release();
  return 0;
}

const char* event_str(rdma_cm_event_type event) {
  static const char* const kNames[] = {
      "RDMA_CM_EVENT_ADDR_RESOLVED",  "RDMA_CM_EVENT_ADDR_ERROR",      "RDMA_CM_EVENT_ROUTE_RESOLVED",
      "RDMA_CM_EVENT_ROUTE_ERROR",    "RDMA_CM_EVENT_CONNECT_REQUEST", "RDMA_CM_EVENT_CONNECT_RESPONSE",
      "RDMA_CM_EVENT_CONNECT_ERROR",  "RDMA_CM_EVENT_UNREACHABLE",     "RDMA_CM_EVENT_REJECTED",
      "RDMA_CM_EVENT_ESTABLISHED",    "RDMA_CM_EVENT_DISCONNECTED",    "RDMA_CM_EVENT_DEVICE_REMOVAL",
      "RDMA_CM_EVENT_MULTICAST_JOIN", "RDMA_CM_EVENT_MULTICAST_ERROR", "RDMA_CM_EVENT_ADDR_CHANGE",
      "RDMA_CM_EVENT_TIMEWAIT_EXIT"};
  auto index = static_cast<size_t>(event);
  return index < std::size(kNames) ? kNames[index] : "UNKNOWN EVENT";
}

}  // namespace softverbs::cm
