#include "checker/unacknowledged_events.h"

#include <pthread.h>
#include <time.h>

#include <cerrno>
#include <string>

#include "checker/report.h"

namespace softverbs::provider::check {

namespace {

constexpr std::string_view kCheck = "unacknowledged-events";

// How long a destroy waits for another thread to acknowledge (libibverbs
// waits for ever; a program whose event thread acknowledges is correct,
// one that never does hangs on an HCA and is slowed here).
constexpr long kAcknowledgeWaitMs = 1000;

// When a destroy that starts now stops waiting: one deadline for all the
// kinds of event an object has (a CQ's two wait together).
timespec acknowledge_deadline() {
  timespec deadline{};
  clock_gettime(CLOCK_REALTIME, &deadline);  // the clock of the condition libibverbs makes
  deadline.tv_sec += kAcknowledgeWaitMs / 1000;
  return deadline;
}

// The acknowledgement counter libibverbs keeps under the object's mutex,
// once it reaches `delivered` or `deadline` passes: as ibv_destroy_* on an
// HCA, which waits on the object's condition, signalled by each
// acknowledgement.
template <typename Object, typename Read>
uint32_t acknowledged(const Object* object, Read read, uint32_t delivered,
                      const timespec& deadline = acknowledge_deadline()) {
  auto* mutable_object = const_cast<Object*>(object);
  pthread_mutex_lock(&mutable_object->mutex);
  uint32_t value = read(*object);
  while (value < delivered &&
         pthread_cond_timedwait(&mutable_object->cond, &mutable_object->mutex, &deadline) != ETIMEDOUT)
    value = read(*object);
  pthread_mutex_unlock(&mutable_object->mutex);
  return value;
}

void report_unacknowledged(std::string_view verb, std::string_view object, std::string_view kind, uint32_t missing,
                           std::string_view acknowledge, uint32_t qp_num) {
  if (!enabled()) return;
  Finding finding;
  finding.check = kCheck;
  const std::string events = std::to_string(missing) + " " + std::string(kind) + (missing == 1 ? " event" : " events") +
                             " not acknowledged with " + std::string(acknowledge);
  if (verb == "ibv_close_device")
    finding.what = "ibv_close_device with a " + std::string(object) + " still alive that has " + events +
                   ": destroying it first would hang, as libibverbs on an HCA waits in ibv_destroy_" +
                   (object == "CQ"   ? "cq"
                    : object == "QP" ? "qp"
                                     : "srq") +
                   " until they are";
  else
    finding.what = std::string(verb) + " of a " + std::string(object) + " with " + events +
                   ": on an HCA, libibverbs waits in " + std::string(verb) + " until they are, and the program hangs";
  finding.qp_num = qp_num;
  finding.backtrace_of_caller = true;
  report(finding);
}

void check_cq(std::string_view verb, const ibv_cq* cq, DeliveredEvents delivered) {
  const timespec deadline = acknowledge_deadline();
  const uint32_t completion_acked = acknowledged(
      cq, [](const ibv_cq& c) { return c.comp_events_completed; }, delivered.completion, deadline);
  const uint32_t async_acked = acknowledged(
      cq, [](const ibv_cq& c) { return c.async_events_completed; }, delivered.async, deadline);
  if (delivered.completion > completion_acked)
    report_unacknowledged(verb, "CQ", "completion", delivered.completion - completion_acked, "ibv_ack_cq_events", 0);
  if (delivered.async > async_acked)
    report_unacknowledged(verb, "CQ", "asynchronous", delivered.async - async_acked, "ibv_ack_async_event", 0);
}

void check_qp(std::string_view verb, const ibv_qp* qp, DeliveredEvents delivered) {
  const uint32_t acked = acknowledged(
      qp, [](const ibv_qp& q) { return q.events_completed; }, delivered.async);
  if (delivered.async > acked)
    report_unacknowledged(verb, "QP", "asynchronous", delivered.async - acked, "ibv_ack_async_event", qp->qp_num);
}

void check_srq(std::string_view verb, const ibv_srq* srq, DeliveredEvents delivered) {
  const uint32_t acked = acknowledged(
      srq, [](const ibv_srq& s) { return s.events_completed; }, delivered.async);
  if (delivered.async > acked)
    report_unacknowledged(verb, "SRQ", "asynchronous", delivered.async - acked, "ibv_ack_async_event", 0);
}

}  // namespace

// Every destroy waits (another thread may be about to acknowledge, and
// must find the object alive); only the checker reports what stays missing.
void unacknowledged_at_destroy(const ibv_cq* cq, DeliveredEvents delivered) {
  check_cq("ibv_destroy_cq", cq, delivered);
}

void unacknowledged_at_destroy(const ibv_qp* qp, DeliveredEvents delivered) {
  check_qp("ibv_destroy_qp", qp, delivered);
}

void unacknowledged_at_destroy(const ibv_srq* srq, DeliveredEvents delivered) {
  check_srq("ibv_destroy_srq", srq, delivered);
}

void unacknowledged_at_close(const ibv_context* context) {
  if (!enabled()) return;
  // The kernel destroys what a closed context still has, with the same wait.
  for_each_live_handle(HandleKind::Qp, context, [](uint64_t handle, DeliveredEvents delivered) {
    check_qp("ibv_close_device", reinterpret_cast<const ibv_qp*>(handle), delivered);
  });
  for_each_live_handle(HandleKind::Srq, context, [](uint64_t handle, DeliveredEvents delivered) {
    check_srq("ibv_close_device", reinterpret_cast<const ibv_srq*>(handle), delivered);
  });
  for_each_live_handle(HandleKind::Cq, context, [](uint64_t handle, DeliveredEvents delivered) {
    check_cq("ibv_close_device", reinterpret_cast<const ibv_cq*>(handle), delivered);
  });
}

}  // namespace softverbs::provider::check
