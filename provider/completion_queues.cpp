// Completion queues: creation, polling (with the device's one progress
// call), notification and resizing.
#include <endian.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "checker/cq_overrun.h"
#include "checker/unacknowledged_events.h"
#include "checker/work_checks.h"
#include "device/device_clock.h"
#include "device/event_socket.h"
#include "device/receive_queue.h"
#include "handle_registry.h"
#include "provider_context.h"
#include "support/process_id.h"
#include "support/small_vector.h"
#include "verbs/adversary.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

// `parent_domain`: an extended CQ's, whose allocator gives its memory.
ProviderCq* create_cq_common(ibv_context* context, int cqe, ibv_comp_channel* channel, int comp_vector,
                             bool timestamps = false, ibv_pd* parent_domain = nullptr) {
  ContextState& state = state_of(context);
  if (cqe < 1 || cqe > state.device.max_cqe || comp_vector < 0 || comp_vector >= context->num_comp_vectors) {
    errno = EINVAL;
    return nullptr;
  }
  // A channel made by the preload is a datagram socket with an abstract
  // address that other processes can send events to.
  SocketAddress channel_address;
  if (channel != nullptr && !socket_address_of(channel->fd, &channel_address)) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(context)) return nullptr;
  DeviceMemory& memory = *state.memory;
  int index = memory.allocate_cq();
  if (index < 0) {
    errno = ENOMEM;
    return nullptr;
  }
  uint32_t capacity = std::bit_ceil(static_cast<uint32_t>(cqe));
  uint64_t ring = memory.allocate(DeviceMemory::completion_ring_bytes(capacity));
  if (ring == 0) {
    memory.shared().cqs[index].live = 0;
    errno = ENOMEM;
    return nullptr;
  }
  ProviderObject<ProviderCq> cq(new_provider_object<ProviderCq>(parent_domain, DomainResource::Cq));
  if (!cq) {
    memory.release(ring, DeviceMemory::completion_ring_bytes(capacity));
    memory.shared().cqs[index].live = 0;
    return nullptr;
  }
  cq->index = index;
  cq->verbs.cq.context = context;
  cq->verbs.cq.channel = channel;
  cq->verbs.cq.cqe = static_cast<int>(capacity);
  cq->verbs.cq.handle = static_cast<uint32_t>(index);
  cq->slots_offset = ring;
  CqRecord& record = memory.shared().cqs[index];
  {
    SharedLock poll_lock(record.ring.consumer.poll_lock);
    SharedLock lock(record.lock);
    memory.install_completion_ring(record, ring, capacity);
    record.owner_handle = reinterpret_cast<uint64_t>(&cq->verbs.cq);
    record.channel = channel_address;
    record.owner_async = state.async_address;
    record.stamps_completions = timestamps ? 1 : 0;
    record.lost_completions = 0;
  }
  if (parent_domain) {
    cq->parent_domain = parent_domain;
    use_pd(parent_domain);
  }
  register_handle(HandleKind::Cq, &cq->verbs.cq);
  return cq.release();
}

ibv_cq* create_cq(ibv_context* context, int cqe, ibv_comp_channel* channel, int comp_vector) {
  ProviderCq* cq = create_cq_common(context, cqe, channel, comp_vector);
  return cq ? &cq->verbs.cq : nullptr;
}

// Pops up to out.size() of the oldest completions of `cq`; returns how many.
// The poll lock and the consumer's half of the ring are this process's
// alone: a poll takes nothing that producers in other processes write but
// the slot it waits on.
size_t pop_completions(ProviderCq* cq, std::span<Completion> out) {
  DeviceMemory& memory = *state_of(cq->verbs.cq.context).memory;
  CompletionRingHeader& header = memory.shared().cqs[cq->index].ring;
  SharedLock poll_lock(header.consumer.poll_lock);
  CompletionRing ring(header, std::span(memory.at<CompletionSlot>(cq->slots_offset), header.consumer.capacity));
  return ring.pop(out);
}

// Pops the oldest completion of `cq` into `out`; false if there is none.
bool pop_completion(ProviderCq* cq, Completion& out) { return pop_completions(cq, std::span(&out, 1)) == 1; }

// The CQ's ring, as adversarial mode takes from it.
struct RingOf final : adversary::CqPoller {
  explicit RingOf(ProviderCq* cq) : cq(cq) {}
  size_t pop_ready(std::span<Completion> out) override { return pop_completions(cq, out); }
  ProviderCq* cq;
};

// ibv_cq_ex: start/next/end_poll walk the ring one entry at a time; the
// read_* getters read the current entry.
void to_ibv_wc(const Completion& c, ibv_wc& wc);

// The CQ's current entry, just taken, as the application sees it.
int show_current(ibv_cq_ex* ibv) {
  const Completion& current = to_cq(ibv)->current;
  ibv->wr_id = current.wr_id;
  ibv->status = static_cast<ibv_wc_status>(current.status);
  if (check::enabled()) [[unlikely]] {
    ibv_wc polled;
    to_ibv_wc(current, polled);
    check::completions_polled(ibv_cq_ex_to_cq(ibv), &polled, 1);
  }
  return 0;
}

int next_poll_ex(ibv_cq_ex* ibv) {
  ProviderCq* cq = to_cq(ibv);
  if (adversary::enabled()) [[unlikely]] {
    if (!adversary::next_poll(memory_of(ibv->context), cq->index, cq->current)) return ENOENT;
  } else if (!pop_completion(cq, cq->current)) {
    return ENOENT;
  }
  return show_current(ibv);
}

int start_poll_ex(ibv_cq_ex* ibv, ibv_poll_cq_attr* attr) {
  if (attr != nullptr && attr->comp_mask != 0) return EINVAL;
  if (check::enabled() && check::used_after_destroy(check::ObjectKind::Cq, ibv_cq_ex_to_cq(ibv), "ibv_start_poll",
                                                    __builtin_return_address(0)))
    return EINVAL;
  state_of(ibv->context).progress();
  if (check::enabled()) [[unlikely]]
    check::report_cq_overrun(*to_cq(ibv));
  if (adversary::enabled()) [[unlikely]] {
    ProviderCq* cq = to_cq(ibv);
    adversary::maybe_stall();
    RingOf ring(cq);
    if (!adversary::start_poll(memory_of(ibv->context), cq->index, ring, cq->current)) return ENOENT;
    return show_current(ibv);
  }
  return next_poll_ex(ibv);
}

void end_poll_ex(ibv_cq_ex*) {}

const Completion& current_of(ibv_cq_ex* ibv) { return to_cq(ibv)->current; }
ibv_wc_opcode read_opcode_ex(ibv_cq_ex* cq) { return static_cast<ibv_wc_opcode>(current_of(cq).opcode); }
uint32_t read_vendor_err_ex(ibv_cq_ex*) { return 0; }
uint32_t read_byte_len_ex(ibv_cq_ex* cq) { return current_of(cq).byte_len; }
__be32 read_imm_data_ex(ibv_cq_ex* cq) { return current_of(cq).imm_data; }
uint32_t read_qp_num_ex(ibv_cq_ex* cq) { return current_of(cq).qp_num; }
uint32_t read_src_qp_ex(ibv_cq_ex* cq) { return current_of(cq).src_qp; }
unsigned int read_wc_flags_ex(ibv_cq_ex* cq) { return current_of(cq).flags; }
uint32_t read_slid_ex(ibv_cq_ex*) { return 0; }
uint8_t read_sl_ex(ibv_cq_ex* cq) { return current_of(cq).sl; }
uint8_t read_dlid_path_bits_ex(ibv_cq_ex*) { return 0; }
// The device clock counts nanoseconds (device_clock.h): a raw timestamp is one.
uint64_t read_completion_ts_ex(ibv_cq_ex* cq) { return current_of(cq).timestamp_ns; }
uint64_t read_completion_wallclock_ns_ex(ibv_cq_ex* cq) {
  return device_clock_to_wallclock_ns(current_of(cq).timestamp_ns);
}

constexpr uint64_t kTimestampWcFlags =
    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
constexpr uint64_t kSupportedWcFlags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM |
                                       IBV_WC_EX_WITH_SRC_QP | IBV_WC_EX_WITH_SLID | IBV_WC_EX_WITH_SL |
                                       IBV_WC_EX_WITH_DLID_PATH_BITS | kTimestampWcFlags;

ibv_cq_ex* create_cq_ex(ibv_context* context, ibv_cq_init_attr_ex* attr) {
  if (attr->comp_mask & ~static_cast<uint32_t>(IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD)) {
    errno = EINVAL;
    return nullptr;
  }
  // CVLAN, flow tags and the rest are not emulated: say so rather than return zeros.
  if ((attr->wc_flags & ~kSupportedWcFlags) || ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) && attr->flags != 0)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  // A CQ may be made in a parent domain of this context (only in one).
  ibv_pd* parent_domain = (attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) ? attr->parent_domain : nullptr;
  if ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) &&
      (parent_domain == nullptr || parent_domain->context != context || !to_pd(parent_domain)->is_parent_domain())) {
    errno = EINVAL;
    return nullptr;
  }
  ProviderCq* cq =
      create_cq_common(context, static_cast<int>(attr->cqe), attr->channel, static_cast<int>(attr->comp_vector),
                       (attr->wc_flags & kTimestampWcFlags) != 0, parent_domain);
  if (cq == nullptr) return nullptr;
  ibv_cq_ex& ex = cq->verbs.cq_ex;
  ex.start_poll = start_poll_ex;
  ex.next_poll = next_poll_ex;
  ex.end_poll = end_poll_ex;
  ex.read_opcode = read_opcode_ex;
  ex.read_vendor_err = read_vendor_err_ex;
  ex.read_byte_len = read_byte_len_ex;
  ex.read_imm_data = read_imm_data_ex;
  ex.read_qp_num = read_qp_num_ex;
  ex.read_src_qp = read_src_qp_ex;
  ex.read_wc_flags = read_wc_flags_ex;
  ex.read_slid = read_slid_ex;
  ex.read_sl = read_sl_ex;
  ex.read_dlid_path_bits = read_dlid_path_bits_ex;
  ex.read_completion_ts = read_completion_ts_ex;
  ex.read_completion_wallclock_ns = read_completion_wallclock_ns_ex;
  return &ex;
}

int destroy_cq(ibv_cq* ibv) {
  ProviderCq* cq = to_cq(ibv);
  ContextState& state = state_of(ibv->context);
  const bool checking = check::enabled();
  if (checking && check::used_after_destroy(check::ObjectKind::Cq, ibv, "ibv_destroy_cq", __builtin_return_address(0)))
    return EINVAL;
  {
    std::lock_guard guard(state.qps_mutex);
    if (cq->qp_references > 0) {
      if (checking) check::cq_destroying(ibv, cq->qp_references, __builtin_return_address(0));
      return EBUSY;
    }
  }
  const DeliveredEvents handle_events = unregister_handle(HandleKind::Cq, ibv);
  if (checking) {
    check::report_cq_overrun(*cq);
    check::unacknowledged_at_destroy(ibv, handle_events);
  }
  if (adversary::enabled()) [[unlikely]]
    adversary::forget_cq(*state.memory, cq->index);
  CqRecord& record = state.memory->shared().cqs[cq->index];
  uint64_t ring = 0, bytes = 0;
  {
    SharedLock lock(record.lock);
    if (record.live && made_by_this_process(record.owner_pid)) {  // not one a forked child inherited
      record.live = 0;
      ring = record.ring_offset;
      bytes = record.ring_bytes;
    }
  }
  state.memory->release(ring, bytes);
  ibv_pd* parent_domain = cq->parent_domain;
  if (checking && cq->storage.domain == nullptr && parent_domain == nullptr)
    check::quarantine(ibv->context, check::ObjectKind::Cq, ibv, [cq] { delete_provider_object(cq); });
  else
    delete_provider_object(cq);
  if (parent_domain) unuse_pd(parent_domain);
  return 0;
}

int resize_cq(ibv_cq* ibv, int cqe) {
  ProviderCq* cq = to_cq(ibv);
  ContextState& state = state_of(ibv->context);
  if (cqe < 1 || cqe > state.device.max_cqe) return EINVAL;
  uint32_t capacity = std::bit_ceil(static_cast<uint32_t>(cqe));
  uint64_t bytes = DeviceMemory::completion_ring_bytes(capacity);
  uint64_t ring = state.memory->allocate(bytes);
  if (ring == 0) return ENOMEM;
  CqRecord& record = state.memory->shared().cqs[cq->index];
  uint64_t old_ring, old_bytes;
  {
    SharedLock poll_lock(record.ring.consumer.poll_lock);
    SharedLock lock(record.lock);
    CompletionRing old = state.memory->completion_ring(record);
    const size_t waiting = old.size();
    if (waiting > capacity) {
      state.memory->release(ring, bytes);
      return EINVAL;  // the completions waiting would not fit
    }
    std::vector<Completion> moving(waiting);
    old.pop(moving);
    old_ring = record.ring_offset;
    old_bytes = record.ring_bytes;
    state.memory->install_completion_ring(record, ring, capacity);
    CompletionRing grown = state.memory->completion_ring(record);
    for (const Completion& completion : moving) grown.push(completion);
    cq->slots_offset = ring;
  }
  state.memory->release(old_ring, old_bytes);
  ibv->cqe = static_cast<int>(capacity);
  return 0;
}

int req_notify_cq(ibv_cq* ibv, int solicited_only) {
  CqRecord& record = memory_of(ibv->context).shared().cqs[to_cq(ibv)->index];
  {
    SharedLock lock(record.lock);
    record.armed = solicited_only ? CqArm::SolicitedOnly : CqArm::NextCompletion;
  }
  if (adversary::enabled()) [[unlikely]]
    adversary::armed(memory_of(ibv->context), to_cq(ibv)->index);
  // An armed CQ means the application is about to wait for an event.
  state_of(ibv->context).application_waits();
  return 0;
}

void to_ibv_wc(const Completion& c, ibv_wc& wc) {
  wc = {};
  wc.wr_id = c.wr_id;
  wc.status = static_cast<ibv_wc_status>(c.status);
  wc.opcode = static_cast<ibv_wc_opcode>(c.opcode);
  wc.byte_len = c.byte_len;
  wc.imm_data = c.imm_data;
  wc.qp_num = c.qp_num;
  wc.src_qp = c.src_qp;
  wc.wc_flags = c.flags;
  wc.pkey_index = c.pkey_index;
  wc.sl = c.sl;
}

int poll_cq(ibv_cq* ibv, int num_entries, ibv_wc* wc) {
  if (num_entries < 0) return -EINVAL;
  const bool checking = check::enabled();
  // ibv_poll_cq is an inline of verbs.h: the return address is the application's.
  if (checking && check::used_after_destroy(check::ObjectKind::Cq, ibv, "ibv_poll_cq", __builtin_return_address(0)))
      [[unlikely]]
    return -EINVAL;
  state_of(ibv->context).progress();
  if (check::enabled()) [[unlikely]]
    check::report_cq_overrun(*to_cq(ibv));
  UninitializedArray<Completion, 16> batch;  // pop_completions writes what it returns
  int polled = 0;
  if (adversary::enabled()) [[unlikely]] {
    adversary::maybe_stall();
    RingOf ring(to_cq(ibv));
    size_t want = std::min<size_t>(batch.size(), static_cast<size_t>(num_entries));
    size_t got = adversary::poll(memory_of(ibv->context), to_cq(ibv)->index, ring, std::span(batch.data(), want));
    for (size_t i = 0; i < got; ++i) to_ibv_wc(batch.items[i], wc[i]);
    polled = static_cast<int>(got);
  } else {
    while (polled < num_entries) {
      size_t want = std::min<size_t>(batch.size(), static_cast<size_t>(num_entries - polled));
      size_t got = pop_completions(to_cq(ibv), std::span(batch.data(), want));
      for (size_t i = 0; i < got; ++i) to_ibv_wc(batch.items[i], wc[polled + static_cast<int>(i)]);
      polled += static_cast<int>(got);
      if (got < want) break;
    }
  }
  if (checking && polled > 0) [[unlikely]]
    check::completions_polled(ibv, wc, polled);
  return polled;
}

}  // namespace

void add_completion_queue_ops(abi::verbs_context_ops& ops) {
  ops.create_cq = create_cq;
  ops.create_cq_ex = create_cq_ex;
  ops.destroy_cq = destroy_cq;
  ops.poll_cq = poll_cq;
  ops.req_notify_cq = req_notify_cq;
  ops.resize_cq = resize_cq;
}

uint64_t wait_for_cq_event(ibv_comp_channel* channel) {
  UdpTransport* udp = state_of(channel->context).udp_if_running();
  if (udp == nullptr) return 0;
  // The channel's address, kept per thread: a channel fd's number may be
  // another channel's later, whose events then only miss the shortcut.
  thread_local int known_fd = -1;
  thread_local SocketAddress known_address;
  if (channel->fd != known_fd) {
    if (!socket_address_of(channel->fd, &known_address)) return 0;
    known_fd = channel->fd;
  }
  const uint64_t handle = udp->wait_for_channel(channel->fd, known_address);
  if (handle == UdpTransport::kChannelWaitInterrupted) {
    errno = EINTR;
    return kCqEventWaitInterrupted;
  }
  if (handle == 0 || is_channel_cq(channel, handle)) return handle;
  // The address was a former channel's of that fd number: to its owner.
  send_datagram(known_address, &handle, sizeof handle);
  return 0;
}

}  // namespace softverbs::provider
