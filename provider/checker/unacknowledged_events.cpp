#include "checker/unacknowledged_events.h"

#include <pthread.h>

#include <string>

#include "checker/report.h"

namespace softverbs::provider::check {

namespace {

constexpr std::string_view kCheck = "unacknowledged-events";

// The acknowledgement counters libibverbs keeps under the object's mutex.
template <typename Object, typename Read>
uint32_t read_locked(const Object* object, Read read) {
  auto* mutable_object = const_cast<Object*>(object);
  pthread_mutex_lock(&mutable_object->mutex);
  const uint32_t value = read(*object);
  pthread_mutex_unlock(&mutable_object->mutex);
  return value;
}

void report_unacknowledged(std::string_view verb, std::string_view object, std::string_view kind, uint32_t missing,
                           std::string_view acknowledge, uint32_t qp_num) {
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
  const uint32_t completion_acked = read_locked(cq, [](const ibv_cq& c) { return c.comp_events_completed; });
  const uint32_t async_acked = read_locked(cq, [](const ibv_cq& c) { return c.async_events_completed; });
  if (delivered.completion > completion_acked)
    report_unacknowledged(verb, "CQ", "completion", delivered.completion - completion_acked, "ibv_ack_cq_events", 0);
  if (delivered.async > async_acked)
    report_unacknowledged(verb, "CQ", "asynchronous", delivered.async - async_acked, "ibv_ack_async_event", 0);
}

void check_qp(std::string_view verb, const ibv_qp* qp, DeliveredEvents delivered) {
  const uint32_t acked = read_locked(qp, [](const ibv_qp& q) { return q.events_completed; });
  if (delivered.async > acked)
    report_unacknowledged(verb, "QP", "asynchronous", delivered.async - acked, "ibv_ack_async_event", qp->qp_num);
}

void check_srq(std::string_view verb, const ibv_srq* srq, DeliveredEvents delivered) {
  const uint32_t acked = read_locked(srq, [](const ibv_srq& s) { return s.events_completed; });
  if (delivered.async > acked)
    report_unacknowledged(verb, "SRQ", "asynchronous", delivered.async - acked, "ibv_ack_async_event", 0);
}

}  // namespace

void unacknowledged_at_destroy(const ibv_cq* cq, DeliveredEvents delivered) {
  if (enabled()) check_cq("ibv_destroy_cq", cq, delivered);
}

void unacknowledged_at_destroy(const ibv_qp* qp, DeliveredEvents delivered) {
  if (enabled()) check_qp("ibv_destroy_qp", qp, delivered);
}

void unacknowledged_at_destroy(const ibv_srq* srq, DeliveredEvents delivered) {
  if (enabled()) check_srq("ibv_destroy_srq", srq, delivered);
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
