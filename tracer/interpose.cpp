// libsoftverbs-trace.so: the exported libibverbs functions the program
// calls, each recorded with its result and passed on to the next definition
// (libibverbs, or softverbs' preload library before it). See
// docs/comparing.md for what a trace holds and leaves out.
#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <string>

#include "recorder.h"
#include "support/leaving.h"
#include "wrappers.h"

// verbs.h makes these macros that pick a variant; the library defines the
// exported functions themselves.
#undef ibv_reg_mr
#undef ibv_reg_mr_iova

#define SOFTVERBS_EXPORT extern "C" __attribute__((visibility("default")))

namespace softverbs::trace {
namespace {

// The next definition of `name` after this library's.
template <typename Function>
Function next(const char* name) {
  return reinterpret_cast<Function>(dlsym(RTLD_NEXT, name));
}
#define SOFTVERBS_NEXT(function) static const auto real = next<decltype(&function)>(#function)

// Records one call: "<section> <text> = <result>" when it is the program's
// own call (not one libibverbs or a provider made inside another).
void record(const CallScope& scope, const std::string& section, const std::string& text, const std::string& result) {
  if (!scope.outermost()) return;
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  recorder.emit(section + " " + text + " = " + result);
}

// A created object's line: under its new name, or its parent's on failure.
// `what` gets the recorder's lock held.
template <typename Text>
std::string record_creation(const CallScope& scope, const void* object, Kind kind, const void* parent, Text what,
                            int error) {
  if (!scope.outermost()) return {};
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  const std::string text = what();
  if (object == nullptr) {
    recorder.emit(recorder.name(parent) + " " + text + " = " + errno_name(error));
    return {};
  }
  const std::string name = recorder.add(object, kind);
  recorder.emit(name + " " + text + " = ok");
  return name;
}

// A destroyed object's line; its name is forgotten once it is gone.
template <typename Destroy>
int record_destruction(const void* object, const char* call, Destroy destroy, bool flush = false) {
  CallScope scope;
  Recorder& recorder = Recorder::instance();
  std::string name;
  {
    std::lock_guard guard(recorder.mutex);
    name = recorder.name(object);
  }
  const int rc = destroy();
  const int error = errno;
  if (scope.outermost()) {
    std::lock_guard guard(recorder.mutex);
    recorder.emit(name + " " + call + " = " + result_code(rc));
    if (rc == 0) {
      forget_extended(object);
      recorder.remove(object);
    }
    if (flush) recorder.flush();
  }
  errno = error;
  return rc;
}

std::string event_name(ibv_event_type type) {
  switch (type) {
    case IBV_EVENT_CQ_ERR:
      return "CQ_ERR";
    case IBV_EVENT_QP_FATAL:
      return "QP_FATAL";
    case IBV_EVENT_QP_REQ_ERR:
      return "QP_REQ_ERR";
    case IBV_EVENT_QP_ACCESS_ERR:
      return "QP_ACCESS_ERR";
    case IBV_EVENT_COMM_EST:
      return "COMM_EST";
    case IBV_EVENT_SQ_DRAINED:
      return "SQ_DRAINED";
    case IBV_EVENT_PATH_MIG:
      return "PATH_MIG";
    case IBV_EVENT_PATH_MIG_ERR:
      return "PATH_MIG_ERR";
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      return "QP_LAST_WQE_REACHED";
    case IBV_EVENT_SRQ_ERR:
      return "SRQ_ERR";
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      return "SRQ_LIMIT_REACHED";
    default:
      return "event" + std::to_string(static_cast<int>(type));
  }
}

std::string name_of(const void* object) {
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  return recorder.name(object);
}

}  // namespace
}  // namespace softverbs::trace

using namespace softverbs::trace;

// ---- devices ----

SOFTVERBS_EXPORT ibv_context* ibv_open_device(ibv_device* device) {
  SOFTVERBS_NEXT(ibv_open_device);
  CallScope scope;
  ibv_context* context = real(device);
  const int error = errno;
  if (context != nullptr) wrap_context(context);
  // Which device it was is left out: device names differ between hosts.
  record_creation(
      scope, context, Kind::Device, nullptr, [] { return std::string("open_device"); }, error);
  errno = error;
  return context;
}

SOFTVERBS_EXPORT int ibv_close_device(ibv_context* context) {
  SOFTVERBS_NEXT(ibv_close_device);
  unwrap_context(context);
  return record_destruction(
      context, "close_device", [&] { return real(context); }, true);
}

// ---- protection domains and memory ----

SOFTVERBS_EXPORT ibv_pd* ibv_alloc_pd(ibv_context* context) {
  SOFTVERBS_NEXT(ibv_alloc_pd);
  CallScope scope;
  ibv_pd* pd = real(context);
  const int error = errno;
  record_creation(
      scope, pd, Kind::ProtectionDomain, context, [&] { return "alloc_pd dev=" + Recorder::instance().name(context); },
      error);
  errno = error;
  return pd;
}

SOFTVERBS_EXPORT int ibv_dealloc_pd(ibv_pd* pd) {
  SOFTVERBS_NEXT(ibv_dealloc_pd);
  return record_destruction(pd, "dealloc_pd", [&] { return real(pd); });
}

namespace {

ibv_mr* record_registration(const CallScope& scope, ibv_mr* mr, ibv_pd* pd, const char* call, size_t length,
                            unsigned access, int error) {
  record_creation(
      scope, mr, Kind::MemoryRegion, pd,
      [&] {
        return std::string(call) + " pd=" + Recorder::instance().name(pd) + " len=" + std::to_string(length) +
               " access=" + access_text(access);
      },
      error);
  errno = error;
  return mr;
}

}  // namespace

SOFTVERBS_EXPORT ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  SOFTVERBS_NEXT(ibv_reg_mr);
  CallScope scope;
  ibv_mr* mr = real(pd, addr, length, access);
  return record_registration(scope, mr, pd, "reg_mr", length, static_cast<unsigned>(access), errno);
}

SOFTVERBS_EXPORT ibv_mr* ibv_reg_mr_iova(ibv_pd* pd, void* addr, size_t length, uint64_t iova, int access) {
  SOFTVERBS_NEXT(ibv_reg_mr_iova);
  CallScope scope;
  ibv_mr* mr = real(pd, addr, length, iova, access);
  return record_registration(scope, mr, pd, "reg_mr_iova", length, static_cast<unsigned>(access), errno);
}

SOFTVERBS_EXPORT ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned access) {
  SOFTVERBS_NEXT(ibv_reg_mr_iova2);
  CallScope scope;
  ibv_mr* mr = real(pd, addr, length, iova, access);
  return record_registration(scope, mr, pd, "reg_mr_iova2", length, access, errno);
}

SOFTVERBS_EXPORT ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                                           int access) {
  SOFTVERBS_NEXT(ibv_reg_dmabuf_mr);
  CallScope scope;
  ibv_mr* mr = real(pd, offset, length, iova, fd, access);
  return record_registration(scope, mr, pd, "reg_dmabuf_mr", length, static_cast<unsigned>(access), errno);
}

SOFTVERBS_EXPORT int ibv_dereg_mr(ibv_mr* mr) {
  SOFTVERBS_NEXT(ibv_dereg_mr);
  return record_destruction(mr, "dereg_mr", [&] { return real(mr); });
}

// ---- completion channels and CQs ----

SOFTVERBS_EXPORT ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  SOFTVERBS_NEXT(ibv_create_comp_channel);
  CallScope scope;
  ibv_comp_channel* channel = real(context);
  const int error = errno;
  record_creation(
      scope, channel, Kind::CompletionChannel, context,
      [&] { return "create_comp_channel dev=" + Recorder::instance().name(context); }, error);
  errno = error;
  return channel;
}

SOFTVERBS_EXPORT int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  SOFTVERBS_NEXT(ibv_destroy_comp_channel);
  return record_destruction(channel, "destroy_comp_channel", [&] { return real(channel); });
}

SOFTVERBS_EXPORT ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                                       int comp_vector) {
  SOFTVERBS_NEXT(ibv_create_cq);
  CallScope scope;
  ibv_cq* cq = real(context, cqe, cq_context, channel, comp_vector);
  const int error = errno;
  record_creation(
      scope, cq, Kind::CompletionQueue, context, [&] { return "create_cq " + cq_text(cqe, channel); }, error);
  errno = error;
  return cq;
}

SOFTVERBS_EXPORT int ibv_resize_cq(ibv_cq* cq, int cqe) {
  SOFTVERBS_NEXT(ibv_resize_cq);
  CallScope scope;
  const int rc = real(cq, cqe);
  const int error = errno;
  record(scope, name_of(cq), "resize_cq cqe=" + std::to_string(cqe), result_code(rc));
  errno = error;
  return rc;
}

SOFTVERBS_EXPORT int ibv_destroy_cq(ibv_cq* cq) {
  SOFTVERBS_NEXT(ibv_destroy_cq);
  return record_destruction(cq, "destroy_cq", [&] { return real(cq); });
}

SOFTVERBS_EXPORT int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  SOFTVERBS_NEXT(ibv_get_cq_event);
  CallScope scope;
  const int rc = real(channel, cq, cq_context);
  const int error = errno;
  if (rc == 0)
    record(scope, name_of(*cq), "get_cq_event channel=" + name_of(channel), "0");
  else
    record(scope, name_of(channel), "get_cq_event", result_code(rc));
  errno = error;
  return rc;
}

SOFTVERBS_EXPORT void ibv_ack_cq_events(ibv_cq* cq, unsigned int count) {
  SOFTVERBS_NEXT(ibv_ack_cq_events);
  CallScope scope;
  real(cq, count);
  record(scope, name_of(cq), "ack_cq_events n=" + std::to_string(count), "0");
}

// ---- QPs ----

SOFTVERBS_EXPORT ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  SOFTVERBS_NEXT(ibv_create_qp);
  CallScope scope;
  Recorder& recorder = Recorder::instance();
  std::string text;
  {
    std::lock_guard guard(recorder.mutex);
    text = "create_qp " + qp_text(*attr) + " pd=" + recorder.name(pd);  // before the call rewrites the caps
  }
  ibv_qp* qp = real(pd, attr);
  const int error = errno;
  if (scope.outermost()) {
    std::lock_guard guard(recorder.mutex);
    if (qp == nullptr)
      recorder.emit(recorder.name(pd != nullptr ? pd->context : nullptr) + " " + text + " = " + errno_name(error));
    else
      recorder.emit(recorder.add_queue_pair(qp, attr->srq)->name + " " + text + " = ok");
  }
  errno = error;
  return qp;
}

SOFTVERBS_EXPORT int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  SOFTVERBS_NEXT(ibv_modify_qp);
  CallScope scope;
  const int rc = real(qp, attr, mask);
  const int error = errno;
  if (scope.outermost()) {
    Recorder& recorder = Recorder::instance();
    std::lock_guard guard(recorder.mutex);
    // The path, timers and PSNs are left out: programs take them from the
    // device or the peer. What the program asked for stays.
    std::string text = "modify_qp mask=" + qp_attr_mask_text(mask);
    if ((mask & IBV_QP_STATE) != 0) text += " state=" + qp_state_name(attr->qp_state);
    if ((mask & IBV_QP_ACCESS_FLAGS) != 0) text += " access=" + access_text(attr->qp_access_flags);
    if ((mask & IBV_QP_DEST_QPN) != 0) text += " dest=" + recorder.queue_pair_by_number(attr->dest_qp_num);
    recorder.emit(recorder.name(qp) + " " + text + " = " + result_code(rc));
  }
  errno = error;
  return rc;
}

SOFTVERBS_EXPORT int ibv_query_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init_attr) {
  SOFTVERBS_NEXT(ibv_query_qp);
  CallScope scope;
  const int rc = real(qp, attr, mask, init_attr);
  const int error = errno;
  record(scope, name_of(qp), "query_qp mask=" + qp_attr_mask_text(mask), result_code(rc));
  errno = error;
  return rc;
}

SOFTVERBS_EXPORT int ibv_destroy_qp(ibv_qp* qp) {
  SOFTVERBS_NEXT(ibv_destroy_qp);
  return record_destruction(qp, "destroy_qp", [&] { return real(qp); });
}

// ---- SRQs ----

SOFTVERBS_EXPORT ibv_srq* ibv_create_srq(ibv_pd* pd, ibv_srq_init_attr* attr) {
  SOFTVERBS_NEXT(ibv_create_srq);
  CallScope scope;
  const std::string text = "create_srq max_wr=" + std::to_string(attr->attr.max_wr) +
                           " max_sge=" + std::to_string(attr->attr.max_sge) + " pd=" + name_of(pd);
  ibv_srq* srq = real(pd, attr);
  const int error = errno;
  record_creation(
      scope, srq, Kind::SharedReceiveQueue, pd != nullptr ? pd->context : nullptr, [&] { return text; }, error);
  errno = error;
  return srq;
}

SOFTVERBS_EXPORT int ibv_modify_srq(ibv_srq* srq, ibv_srq_attr* attr, int mask) {
  SOFTVERBS_NEXT(ibv_modify_srq);
  CallScope scope;
  std::string text = "modify_srq mask=" + std::to_string(mask);
  if ((mask & IBV_SRQ_MAX_WR) != 0) text += " max_wr=" + std::to_string(attr->max_wr);
  if ((mask & IBV_SRQ_LIMIT) != 0) text += " limit=" + std::to_string(attr->srq_limit);
  const int rc = real(srq, attr, mask);
  const int error = errno;
  record(scope, name_of(srq), text, result_code(rc));
  errno = error;
  return rc;
}

SOFTVERBS_EXPORT int ibv_destroy_srq(ibv_srq* srq) {
  SOFTVERBS_NEXT(ibv_destroy_srq);
  return record_destruction(srq, "destroy_srq", [&] { return real(srq); });
}

// ---- address handles ----

SOFTVERBS_EXPORT ibv_ah* ibv_create_ah(ibv_pd* pd, ibv_ah_attr* attr) {
  SOFTVERBS_NEXT(ibv_create_ah);
  CallScope scope;
  // Only whether it is global: LIDs, GIDs and indexes are the device's.
  const std::string text = "create_ah pd=" + name_of(pd) + " global=" + std::to_string(attr->is_global);
  ibv_ah* ah = real(pd, attr);
  const int error = errno;
  record_creation(
      scope, ah, Kind::AddressHandle, pd != nullptr ? pd->context : nullptr, [&] { return text; }, error);
  errno = error;
  return ah;
}

SOFTVERBS_EXPORT int ibv_destroy_ah(ibv_ah* ah) {
  SOFTVERBS_NEXT(ibv_destroy_ah);
  return record_destruction(ah, "destroy_ah", [&] { return real(ah); });
}

// ---- asynchronous events ----

SOFTVERBS_EXPORT int ibv_get_async_event(ibv_context* context, ibv_async_event* event) {
  SOFTVERBS_NEXT(ibv_get_async_event);
  CallScope scope;
  const int rc = real(context, event);
  const int error = errno;
  if (rc != 0) {
    record(scope, name_of(context), "get_async_event", result_code(rc));
  } else {
    // Port and device events are the device's; those of the program's
    // objects are recorded under the object.
    const void* object = nullptr;
    switch (event->event_type) {
      case IBV_EVENT_CQ_ERR:
        object = event->element.cq;
        break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_COMM_EST:
      case IBV_EVENT_SQ_DRAINED:
      case IBV_EVENT_PATH_MIG:
      case IBV_EVENT_PATH_MIG_ERR:
      case IBV_EVENT_QP_LAST_WQE_REACHED:
        object = event->element.qp;
        break;
      case IBV_EVENT_SRQ_ERR:
      case IBV_EVENT_SRQ_LIMIT_REACHED:
        object = event->element.srq;
        break;
      default:
        break;
    }
    if (object != nullptr) record(scope, name_of(object), "async_event " + event_name(event->event_type), "0");
  }
  errno = error;
  return rc;
}

// _exit() and _Exit() run no atexit handler: the lines the recorder holds are
// written first, or a program that leaves through them (fio's job processes
// do) leaves an empty trace.
namespace {

// The next _exit: another preload's or glibc's.
softverbs::leaving::ExitFunction next_exit = nullptr;
__attribute__((constructor)) void find_next_exit() { next_exit = softverbs::leaving::find_next_exit(); }

[[noreturn]] void leave(int status) {
  softverbs::trace::Recorder& recorder = softverbs::trace::Recorder::instance();
  if (auto guard = softverbs::leaving::lock_unless_stuck(recorder.mutex); guard.owns_lock()) recorder.flush();
  softverbs::leaving::pass_on(next_exit, status);
}

}  // namespace

SOFTVERBS_EXPORT void _exit(int status) { leave(status); }
SOFTVERBS_EXPORT void _Exit(int status) noexcept { leave(status); }
