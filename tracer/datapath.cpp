// The wrappers of the context's ops (post, poll, notify), of the extended
// CQ's polling and of the extended QP's work-request builders. A wrapper
// that posts holds the recorder's mutex across the post, so that the post
// is recorded before any poller can record its completion.
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <string>
#include <unordered_map>
#include <vector>

#include "recorder.h"
#include "wrappers.h"

namespace softverbs::trace {

namespace {

// ---- contexts ----

struct WrappedContext {
  ibv_context* context = nullptr;
  ibv_context_ops original{};
  decltype(verbs_context::create_cq_ex) create_cq_ex = nullptr;
  decltype(verbs_context::create_qp_ex) create_qp_ex = nullptr;
  decltype(verbs_context::create_srq_ex) create_srq_ex = nullptr;
};

// Read without a lock on every post and poll; written under the recorder's
// mutex. Entries are never freed: a closed context's slot is just emptied.
constexpr size_t kMaxContexts = 256;
std::array<std::atomic<WrappedContext*>, kMaxContexts> contexts{};

const WrappedContext& wrapped(const ibv_context* context) {
  for (const auto& slot : contexts) {
    const WrappedContext* entry = slot.load(std::memory_order_acquire);
    if (entry != nullptr && entry->context == context) return *entry;
  }
  // Only contexts we wrapped ever call these wrappers.
  __builtin_trap();
}

// ---- completions ----

std::string hex32(uint32_t value) {
  char text[16];
  snprintf(text, sizeof text, "0x%08x", value);
  return text;
}

struct Completion {
  uint64_t wr_id;
  ibv_wc_status status;
  ibv_wc_opcode opcode;
  uint32_t qp_num;
  bool has_byte_len;
  uint32_t byte_len;
  unsigned wc_flags;
  bool has_imm;
  uint32_t imm_data;  // as the CQE holds it (network order)
  bool has_src_qp;
  uint32_t src_qp;
};

// Caller holds the mutex.
void record_completion(Recorder& recorder, const std::string& cq_name, const Completion& wc) {
  QueuePairState* qp = recorder.queue_pair_with_number(wc.qp_num);
  const bool success = wc.status == IBV_WC_SUCCESS;
  std::string work = "?";
  if (qp != nullptr) {
    WorkQueue* receive = qp->srq != nullptr ? recorder.shared_receive_queue(qp->srq) : &qp->receive;
    bool is_receive;
    if (success)
      is_receive = (wc.opcode & IBV_WC_RECV) != 0;
    else  // an error's opcode is undefined: the queue that holds the wr_id
      is_receive = !qp->send.front_is(wc.wr_id) && receive != nullptr && receive->holds(wc.wr_id);
    std::string name = is_receive ? (receive != nullptr ? receive->complete(wc.wr_id, false) : std::string())
                                  : qp->send.complete(wc.wr_id, true);
    // Which SRQ receive a QP consumes depends on the other QPs' timing: only the SRQ is named.
    if (!name.empty()) work = is_receive && qp->srq != nullptr ? recorder.name(qp->srq) : name;
  }
  std::string line = (qp != nullptr ? qp->name : "cq?") + " wc " + work + " " + wc_status_name(wc.status);
  if (success) {
    line += " " + wc_opcode_name(wc.opcode);
    // byte_len is defined for what was received; devices differ on the rest.
    if (wc.has_byte_len && (wc.opcode & IBV_WC_RECV) != 0) line += " len=" + std::to_string(wc.byte_len);
    const std::string flags = wc_flags_text(wc.wc_flags);
    if (flags != "-") line += " flags=" + flags;
    if (wc.has_imm && (wc.wc_flags & IBV_WC_WITH_IMM) != 0) line += " imm=" + hex32(wc.imm_data);
    if (wc.has_src_qp && (wc.opcode & IBV_WC_RECV) != 0 && qp != nullptr && qp->type == IBV_QPT_UD)
      line += " src=" + recorder.queue_pair_by_number(wc.src_qp);
  }
  line += " cq=" + cq_name;
  recorder.emit(line);
}

int traced_poll_cq(ibv_cq* cq, int entries, ibv_wc* wc) {
  const int polled = wrapped(cq->context).original.poll_cq(cq, entries, wc);
  if (polled == 0) return 0;  // an empty poll's count is timing: not recorded
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  const std::string cq_name = recorder.name(cq);
  if (polled < 0) {
    recorder.emit(cq_name + " poll_cq = " + result_code(polled));
    return polled;
  }
  for (int i = 0; i < polled; ++i) {
    const ibv_wc& c = wc[i];
    record_completion(recorder, cq_name,
                      {c.wr_id, c.status, c.opcode, c.qp_num, true, c.byte_len, c.wc_flags, true,
                       static_cast<uint32_t>(c.imm_data), true, c.src_qp});
  }
  return polled;
}

int traced_req_notify_cq(ibv_cq* cq, int solicited_only) {
  const int rc = wrapped(cq->context).original.req_notify_cq(cq, solicited_only);
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  recorder.emit(recorder.name(cq) + " req_notify_cq solicited=" + std::to_string(solicited_only != 0) + " = " +
                result_code(rc));
  return rc;
}

// ---- posts ----

uint64_t total_length(const ibv_sge* sges, int count) {
  uint64_t length = 0;
  for (int i = 0; i < count; ++i) length += sges[i].length;
  return length;
}

std::string send_text(Recorder& recorder, const ibv_qp* qp, const ibv_send_wr& wr) {
  std::string text = wr_opcode_name(wr.opcode) + " len=" + std::to_string(total_length(wr.sg_list, wr.num_sge)) +
                     " sge=" + std::to_string(wr.num_sge) + " flags=" + send_flags_text(wr.send_flags);
  if (wr.opcode == IBV_WR_SEND_WITH_IMM || wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM)
    text += " imm=" + hex32(static_cast<uint32_t>(wr.imm_data));
  if (qp->qp_type == IBV_QPT_UD)
    text += " ah=" + recorder.name(wr.wr.ud.ah) + " dest=" + recorder.queue_pair_by_number(wr.wr.ud.remote_qpn);
  if (wr.opcode == IBV_WR_BIND_MW) text += " mw=" + recorder.name(wr.bind_mw.mw);
  return text;
}

int traced_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  ibv_send_wr* bad = nullptr;
  const int rc = wrapped(qp->context).original.post_send(qp, wr, &bad);
  if (bad_wr != nullptr) *bad_wr = bad;
  if (rc != 0 && bad == nullptr) bad = wr;  // a provider that names none posted none
  QueuePairState* state = recorder.queue_pair(qp);
  const std::string qp_name = state != nullptr ? state->name : recorder.name(qp);
  for (const ibv_send_wr* w = wr; w != nullptr; w = w->next) {
    if (rc != 0 && w == bad) {
      recorder.emit(qp_name + " post_send " + send_text(recorder, qp, *w) + " = " + result_code(rc));
      break;
    }
    const std::string name = state != nullptr ? state->send.post(w->wr_id) : "s?";
    recorder.emit(qp_name + " post_send " + name + " " + send_text(recorder, qp, *w));
  }
  return rc;
}

// Posting to a receive queue or an SRQ.
template <typename Post, typename Object>
int traced_receive(Post post, Object* object, WorkQueue* queue, const std::string& name, ibv_recv_wr* wr,
                   ibv_recv_wr** bad_wr, const char* call) {
  Recorder& recorder = Recorder::instance();
  ibv_recv_wr* bad = nullptr;
  const int rc = post(object, wr, &bad);
  if (bad_wr != nullptr) *bad_wr = bad;
  if (rc != 0 && bad == nullptr) bad = wr;
  for (const ibv_recv_wr* w = wr; w != nullptr; w = w->next) {
    const std::string text =
        "len=" + std::to_string(total_length(w->sg_list, w->num_sge)) + " sge=" + std::to_string(w->num_sge);
    if (rc != 0 && w == bad) {
      recorder.emit(name + " " + call + " " + text + " = " + result_code(rc));
      break;
    }
    recorder.emit(name + " " + call + " " + (queue != nullptr ? queue->post(w->wr_id) : "r?") + " " + text);
  }
  return rc;
}

int traced_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  QueuePairState* state = recorder.queue_pair(qp);
  return traced_receive(wrapped(qp->context).original.post_recv, qp, state != nullptr ? &state->receive : nullptr,
                        state != nullptr ? state->name : recorder.name(qp), wr, bad_wr, "post_recv");
}

int traced_post_srq_recv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  return traced_receive(wrapped(srq->context).original.post_srq_recv, srq, recorder.shared_receive_queue(srq),
                        recorder.name(srq), wr, bad_wr, "post_srq_recv");
}

// ---- extended CQs ----

struct WrappedCq {
  decltype(ibv_cq_ex::start_poll) start_poll;
  decltype(ibv_cq_ex::next_poll) next_poll;
  decltype(ibv_cq_ex::read_opcode) read_opcode;
  decltype(ibv_cq_ex::read_byte_len) read_byte_len;
  decltype(ibv_cq_ex::read_imm_data) read_imm_data;
  decltype(ibv_cq_ex::read_qp_num) read_qp_num;
  decltype(ibv_cq_ex::read_src_qp) read_src_qp;
  decltype(ibv_cq_ex::read_wc_flags) read_wc_flags;
  uint64_t wc_flags;
};

std::unordered_map<const void*, WrappedCq> extended_cqs;  // guarded by the recorder's mutex

struct WrappedQp {
  ibv_qp_ex original;  // the provider's builders
  struct Pending {
    std::string text;
    uint64_t wr_id;
  };
  std::vector<Pending> pending;  // built since wr_start
};

std::unordered_map<const void*, WrappedQp> extended_qps;  // guarded by the recorder's mutex

// Records the completion start_poll or next_poll has just made current.
void record_current(Recorder& recorder, ibv_cq_ex* cq, const WrappedCq& w) {
  Completion wc{};
  wc.wr_id = cq->wr_id;
  wc.status = cq->status;
  wc.qp_num = w.read_qp_num(cq);
  if (wc.status == IBV_WC_SUCCESS) {
    wc.opcode = w.read_opcode(cq);
    wc.wc_flags = w.read_wc_flags(cq);
    wc.has_byte_len = (w.wc_flags & IBV_WC_EX_WITH_BYTE_LEN) != 0;
    if (wc.has_byte_len) wc.byte_len = w.read_byte_len(cq);
    wc.has_imm = (w.wc_flags & IBV_WC_EX_WITH_IMM) != 0 && (wc.wc_flags & IBV_WC_WITH_IMM) != 0;
    if (wc.has_imm) wc.imm_data = static_cast<uint32_t>(w.read_imm_data(cq));
    wc.has_src_qp = (w.wc_flags & IBV_WC_EX_WITH_SRC_QP) != 0;
    if (wc.has_src_qp) wc.src_qp = w.read_src_qp(cq);
  }
  record_completion(recorder, recorder.name(cq), wc);
}

int traced_start_poll(ibv_cq_ex* cq, ibv_poll_cq_attr* attr) {
  Recorder& recorder = Recorder::instance();
  std::unique_lock guard(recorder.mutex);
  const WrappedCq w = extended_cqs.at(cq);
  guard.unlock();
  const int rc = w.start_poll(cq, attr);
  if (rc == ENOENT) return rc;
  guard.lock();
  if (rc == 0)
    record_current(recorder, cq, w);
  else
    recorder.emit(recorder.name(cq) + " start_poll = " + result_code(rc));
  return rc;
}

int traced_next_poll(ibv_cq_ex* cq) {
  Recorder& recorder = Recorder::instance();
  std::unique_lock guard(recorder.mutex);
  const WrappedCq w = extended_cqs.at(cq);
  guard.unlock();
  const int rc = w.next_poll(cq);
  if (rc == ENOENT) return rc;
  guard.lock();
  if (rc == 0)
    record_current(recorder, cq, w);
  else
    recorder.emit(recorder.name(cq) + " next_poll = " + result_code(rc));
  return rc;
}

// ---- extended QPs: the builders ----

// The builder's record of `qpx`, found under the held mutex.
WrappedQp& builder(ibv_qp_ex* qpx) { return extended_qps.at(qpx); }

template <auto Member>
std::string opcode_name();

#define SOFTVERBS_TRACE_OPCODE(member, name)      \
  template <>                                     \
  std::string opcode_name<&ibv_qp_ex::member>() { \
    return name;                                  \
  }
SOFTVERBS_TRACE_OPCODE(wr_atomic_cmp_swp, "ATOMIC_CMP_AND_SWP")
SOFTVERBS_TRACE_OPCODE(wr_atomic_fetch_add, "ATOMIC_FETCH_AND_ADD")
SOFTVERBS_TRACE_OPCODE(wr_bind_mw, "BIND_MW")
SOFTVERBS_TRACE_OPCODE(wr_local_inv, "LOCAL_INV")
SOFTVERBS_TRACE_OPCODE(wr_rdma_read, "RDMA_READ")
SOFTVERBS_TRACE_OPCODE(wr_rdma_write, "RDMA_WRITE")
SOFTVERBS_TRACE_OPCODE(wr_rdma_write_imm, "RDMA_WRITE_WITH_IMM")
SOFTVERBS_TRACE_OPCODE(wr_send, "SEND")
SOFTVERBS_TRACE_OPCODE(wr_send_imm, "SEND_WITH_IMM")
SOFTVERBS_TRACE_OPCODE(wr_send_inv, "SEND_WITH_INV")
SOFTVERBS_TRACE_OPCODE(wr_send_tso, "TSO")
SOFTVERBS_TRACE_OPCODE(wr_atomic_write, "ATOMIC_WRITE")
#undef SOFTVERBS_TRACE_OPCODE

template <auto Member, typename... Args>
void traced_named_opcode(ibv_qp_ex* qpx, Args... args) {
  std::lock_guard guard(Recorder::instance().mutex);
  WrappedQp& w = builder(qpx);
  (w.original.*Member)(qpx, args...);
  w.pending.push_back({opcode_name<Member>() + " flags=" + send_flags_text(qpx->wr_flags), qpx->wr_id});
}

// A setter: calls the provider's and adds `text` to the pending request.
template <auto Member, typename... Args>
void traced_setter(ibv_qp_ex* qpx, std::string text, Args... args) {
  std::lock_guard guard(Recorder::instance().mutex);
  WrappedQp& w = builder(qpx);
  (w.original.*Member)(qpx, args...);
  if (!w.pending.empty()) w.pending.back().text += text;
}

void traced_set_sge(ibv_qp_ex* qpx, uint32_t lkey, uint64_t addr, uint32_t length) {
  traced_setter<&ibv_qp_ex::wr_set_sge>(qpx, " len=" + std::to_string(length) + " sge=1", lkey, addr, length);
}

void traced_set_sge_list(ibv_qp_ex* qpx, size_t count, const ibv_sge* sges) {
  traced_setter<&ibv_qp_ex::wr_set_sge_list>(
      qpx, " len=" + std::to_string(total_length(sges, static_cast<int>(count))) + " sge=" + std::to_string(count),
      count, sges);
}

void traced_set_inline_data(ibv_qp_ex* qpx, void* addr, size_t length) {
  traced_setter<&ibv_qp_ex::wr_set_inline_data>(qpx, " inline=" + std::to_string(length), addr, length);
}

void traced_set_inline_data_list(ibv_qp_ex* qpx, size_t count, const ibv_data_buf* buffers) {
  uint64_t length = 0;
  for (size_t i = 0; i < count; ++i) length += buffers[i].length;
  traced_setter<&ibv_qp_ex::wr_set_inline_data_list>(qpx, " inline=" + std::to_string(length), count, buffers);
}

void traced_set_ud_addr(ibv_qp_ex* qpx, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  Recorder& recorder = Recorder::instance();
  std::string text;
  {
    std::lock_guard guard(recorder.mutex);
    text = " ah=" + recorder.name(ah) + " dest=" + recorder.queue_pair_by_number(remote_qpn);
  }
  traced_setter<&ibv_qp_ex::wr_set_ud_addr>(qpx, text, ah, remote_qpn, remote_qkey);
}

void traced_set_xrc_srqn(ibv_qp_ex* qpx, uint32_t remote_srqn) {
  traced_setter<&ibv_qp_ex::wr_set_xrc_srqn>(qpx, "", remote_srqn);
}

void traced_wr_start(ibv_qp_ex* qpx) {
  std::lock_guard guard(Recorder::instance().mutex);
  WrappedQp& w = builder(qpx);
  w.pending.clear();
  w.original.wr_start(qpx);
}

int traced_wr_complete(ibv_qp_ex* qpx) {
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  WrappedQp& w = builder(qpx);
  const int rc = w.original.wr_complete(qpx);
  QueuePairState* state = recorder.queue_pair(&qpx->qp_base);
  const std::string qp_name = state != nullptr ? state->name : "?";
  if (rc == 0) {
    for (const auto& pending : w.pending)
      recorder.emit(qp_name + " wr_complete " + (state != nullptr ? state->send.post(pending.wr_id) : "s?") + " " +
                    pending.text);
  } else {  // nothing of the batch was posted
    recorder.emit(qp_name + " wr_complete = " + result_code(rc) + " wrs=" + std::to_string(w.pending.size()));
  }
  w.pending.clear();
  return rc;
}

void traced_wr_abort(ibv_qp_ex* qpx) {
  std::lock_guard guard(Recorder::instance().mutex);
  WrappedQp& w = builder(qpx);
  w.original.wr_abort(qpx);
  w.pending.clear();
}

// ---- extended creations ----

std::string hex64(uint64_t value) {
  char text[24];
  snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

ibv_cq_ex* traced_create_cq_ex(ibv_context* context, ibv_cq_init_attr_ex* attr) {
  CallScope scope;
  const WrappedContext& w = wrapped(context);
  const uint64_t asked = attr->wc_flags;
  // Each completion is recorded under its QP: the tracer reads every QP number.
  attr->wc_flags |= IBV_WC_EX_WITH_QP_NUM;
  ibv_cq_ex* cq = w.create_cq_ex(context, attr);
  const int error = errno;
  attr->wc_flags = asked;
  if (!scope.outermost()) return cq;
  Recorder& recorder = Recorder::instance();
  std::lock_guard guard(recorder.mutex);
  const std::string text =
      "create_cq_ex " + cq_text(static_cast<int>(attr->cqe), attr->channel) + " wc_flags=" + hex64(asked);
  if (cq == nullptr) {
    recorder.emit(recorder.name(context) + " " + text + " = " + errno_name(error));
  } else {
    recorder.emit(recorder.add(cq, Kind::CompletionQueue) + " " + text + " = ok");
    wrap_extended_cq(cq, asked);
  }
  errno = error;
  return cq;
}

ibv_qp* traced_create_qp_ex(ibv_context* context, ibv_qp_init_attr_ex* attr) {
  CallScope scope;
  const WrappedContext& w = wrapped(context);
  ibv_qp_init_attr basic{};
  basic.send_cq = attr->send_cq;
  basic.recv_cq = attr->recv_cq;
  basic.srq = attr->srq;
  basic.cap = attr->cap;
  basic.qp_type = attr->qp_type;
  basic.sq_sig_all = attr->sq_sig_all;
  Recorder& recorder = Recorder::instance();
  std::string text;
  {
    std::lock_guard guard(recorder.mutex);
    text = "create_qp_ex " + qp_text(basic) +
           " pd=" + recorder.name((attr->comp_mask & IBV_QP_INIT_ATTR_PD) != 0 ? attr->pd : nullptr) +
           " xrcd=" + recorder.name((attr->comp_mask & IBV_QP_INIT_ATTR_XRCD) != 0 ? attr->xrcd : nullptr) +
           " send_ops=" + hex64((attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) != 0 ? attr->send_ops_flags : 0);
  }
  ibv_qp* qp = w.create_qp_ex(context, attr);
  const int error = errno;
  if (!scope.outermost()) return qp;
  std::lock_guard guard(recorder.mutex);
  if (qp == nullptr) {
    recorder.emit(recorder.name(context) + " " + text + " = " + errno_name(error));
  } else {
    recorder.emit(recorder.add_queue_pair(qp, attr->srq)->name + " " + text + " = ok");
    if ((attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) != 0) wrap_extended_qp(qp);
  }
  errno = error;
  return qp;
}

ibv_srq* traced_create_srq_ex(ibv_context* context, ibv_srq_init_attr_ex* attr) {
  CallScope scope;
  const WrappedContext& w = wrapped(context);
  Recorder& recorder = Recorder::instance();
  std::string text;
  {
    std::lock_guard guard(recorder.mutex);
    const bool typed = (attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) != 0;
    text = "create_srq_ex type=" +
           std::string(!typed || attr->srq_type == IBV_SRQT_BASIC ? "BASIC"
                       : attr->srq_type == IBV_SRQT_XRC           ? "XRC"
                                                                  : "TM") +
           " max_wr=" + std::to_string(attr->attr.max_wr) + " max_sge=" + std::to_string(attr->attr.max_sge) +
           " pd=" + recorder.name((attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) != 0 ? attr->pd : nullptr) +
           " cq=" + recorder.name((attr->comp_mask & IBV_SRQ_INIT_ATTR_CQ) != 0 ? attr->cq : nullptr);
  }
  ibv_srq* srq = w.create_srq_ex(context, attr);
  const int error = errno;
  if (!scope.outermost()) return srq;
  std::lock_guard guard(recorder.mutex);
  if (srq == nullptr)
    recorder.emit(recorder.name(context) + " " + text + " = " + errno_name(error));
  else
    recorder.emit(recorder.add(srq, Kind::SharedReceiveQueue) + " " + text + " = ok");
  errno = error;
  return srq;
}

}  // namespace

// ---- wrapping ----

void wrap_context(ibv_context* context) {
  auto* entry = new WrappedContext{context, context->ops, nullptr, nullptr, nullptr};  // never freed (see above)
  for (auto& slot : contexts) {
    WrappedContext* expected = nullptr;
    if (!slot.compare_exchange_strong(expected, entry, std::memory_order_acq_rel)) continue;
    if (context->ops.poll_cq != nullptr) context->ops.poll_cq = traced_poll_cq;
    if (context->ops.req_notify_cq != nullptr) context->ops.req_notify_cq = traced_req_notify_cq;
    if (context->ops.post_send != nullptr) context->ops.post_send = traced_post_send;
    if (context->ops.post_recv != nullptr) context->ops.post_recv = traced_post_recv;
    if (context->ops.post_srq_recv != nullptr) context->ops.post_srq_recv = traced_post_srq_recv;
    if (verbs_context* extended = verbs_get_ctx(context)) {
      // Only the ops that fit the provider's verbs_context (its size says which).
      if (verbs_get_ctx_op(context, create_cq_ex) != nullptr) {
        entry->create_cq_ex = extended->create_cq_ex;
        extended->create_cq_ex = traced_create_cq_ex;
      }
      if (verbs_get_ctx_op(context, create_qp_ex) != nullptr) {
        entry->create_qp_ex = extended->create_qp_ex;
        extended->create_qp_ex = traced_create_qp_ex;
      }
      if (verbs_get_ctx_op(context, create_srq_ex) != nullptr) {
        entry->create_srq_ex = extended->create_srq_ex;
        extended->create_srq_ex = traced_create_srq_ex;
      }
    }
    return;
  }
  // More contexts open than slots: this one is not traced inline.
  delete entry;
}

void unwrap_context(ibv_context* context) {
  for (auto& slot : contexts) {
    WrappedContext* entry = slot.load(std::memory_order_acquire);
    if (entry == nullptr || entry->context != context) continue;
    context->ops = entry->original;
    if (verbs_context* extended = verbs_get_ctx(context)) {
      if (entry->create_cq_ex != nullptr) extended->create_cq_ex = entry->create_cq_ex;
      if (entry->create_qp_ex != nullptr) extended->create_qp_ex = entry->create_qp_ex;
      if (entry->create_srq_ex != nullptr) extended->create_srq_ex = entry->create_srq_ex;
    }
    slot.store(nullptr, std::memory_order_release);
    return;
  }
}

void wrap_extended_cq(ibv_cq_ex* cq, uint64_t wc_flags) {
  extended_cqs[cq] =
      WrappedCq{cq->start_poll,  cq->next_poll,   cq->read_opcode,   cq->read_byte_len, cq->read_imm_data,
                cq->read_qp_num, cq->read_src_qp, cq->read_wc_flags, wc_flags};
  cq->start_poll = traced_start_poll;
  cq->next_poll = traced_next_poll;
}

void wrap_extended_qp(ibv_qp* qp) {
  // Looked up, not linked: the library must load into programs without libibverbs.
  static const auto to_qp_ex = reinterpret_cast<decltype(&ibv_qp_to_qp_ex)>(dlsym(RTLD_DEFAULT, "ibv_qp_to_qp_ex"));
  ibv_qp_ex* qpx = to_qp_ex != nullptr ? to_qp_ex(qp) : nullptr;
  if (qpx == nullptr) return;
  extended_qps[qpx] = WrappedQp{*qpx, {}};
  auto wrap = [](auto& pointer, auto replacement) {
    if (pointer != nullptr) pointer = replacement;
  };
  wrap(qpx->wr_atomic_cmp_swp,
       traced_named_opcode<&ibv_qp_ex::wr_atomic_cmp_swp, uint32_t, uint64_t, uint64_t, uint64_t>);
  wrap(qpx->wr_atomic_fetch_add, traced_named_opcode<&ibv_qp_ex::wr_atomic_fetch_add, uint32_t, uint64_t, uint64_t>);
  wrap(qpx->wr_bind_mw, traced_named_opcode<&ibv_qp_ex::wr_bind_mw, ibv_mw*, uint32_t, const ibv_mw_bind_info*>);
  wrap(qpx->wr_local_inv, traced_named_opcode<&ibv_qp_ex::wr_local_inv, uint32_t>);
  wrap(qpx->wr_rdma_read, traced_named_opcode<&ibv_qp_ex::wr_rdma_read, uint32_t, uint64_t>);
  wrap(qpx->wr_rdma_write, traced_named_opcode<&ibv_qp_ex::wr_rdma_write, uint32_t, uint64_t>);
  wrap(qpx->wr_rdma_write_imm, traced_named_opcode<&ibv_qp_ex::wr_rdma_write_imm, uint32_t, uint64_t, __be32>);
  wrap(qpx->wr_send, traced_named_opcode<&ibv_qp_ex::wr_send>);
  wrap(qpx->wr_send_imm, traced_named_opcode<&ibv_qp_ex::wr_send_imm, __be32>);
  wrap(qpx->wr_send_inv, traced_named_opcode<&ibv_qp_ex::wr_send_inv, uint32_t>);
  wrap(qpx->wr_send_tso, traced_named_opcode<&ibv_qp_ex::wr_send_tso, void*, uint16_t, uint16_t>);
  wrap(qpx->wr_atomic_write, traced_named_opcode<&ibv_qp_ex::wr_atomic_write, uint32_t, uint64_t, const void*>);
  wrap(qpx->wr_set_sge, traced_set_sge);
  wrap(qpx->wr_set_sge_list, traced_set_sge_list);
  wrap(qpx->wr_set_inline_data, traced_set_inline_data);
  wrap(qpx->wr_set_inline_data_list, traced_set_inline_data_list);
  wrap(qpx->wr_set_ud_addr, traced_set_ud_addr);
  wrap(qpx->wr_set_xrc_srqn, traced_set_xrc_srqn);
  wrap(qpx->wr_start, traced_wr_start);
  wrap(qpx->wr_complete, traced_wr_complete);
  wrap(qpx->wr_abort, traced_wr_abort);
}

void forget_extended(const void* object) {
  extended_cqs.erase(object);
  // A QP's ibv_qp_ex starts with its ibv_qp, at the same address.
  extended_qps.erase(object);
}

// ---- creation texts ----

std::string cq_text(int cqe, const ibv_comp_channel* channel) {
  return "cqe=" + std::to_string(cqe) + " channel=" + Recorder::instance().name(channel);
}

std::string qp_text(const ibv_qp_init_attr& attr) {
  Recorder& recorder = Recorder::instance();
  return "type=" + qp_type_name(attr.qp_type) + " send_cq=" + recorder.name(attr.send_cq) +
         " recv_cq=" + recorder.name(attr.recv_cq) + " srq=" + recorder.name(attr.srq) +
         " max_send_wr=" + std::to_string(attr.cap.max_send_wr) +
         " max_recv_wr=" + std::to_string(attr.cap.max_recv_wr) +
         " max_send_sge=" + std::to_string(attr.cap.max_send_sge) +
         " max_recv_sge=" + std::to_string(attr.cap.max_recv_sge) +
         " max_inline=" + std::to_string(attr.cap.max_inline_data) + " sq_sig_all=" + std::to_string(attr.sq_sig_all);
}

}  // namespace softverbs::trace
