// PD, MR, CQ, QP and AH: each op translates libibverbs' structures into the
// emulator's and back. Semantics live in emulator/ (state machine, MR table,
// requester/responder); what stays here is bookkeeping of the ibv_* objects
// and the deferred sends of this process.
#include <endian.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "device/device_attributes.h"
#include "device/device_limits.h"
#include "device/event_socket.h"
#include "device/qp_state_machine.h"
#include "device/queues.h"
#include "device/receive_queue.h"
#include "handle_registry.h"
#include "progress_thread.h"
#include "provider_context.h"
#include "shm/requester.h"
#include "shm/shared_regions.h"
#include "support/debug_log.h"
#include "support/small_vector.h"
#include "udp/transport.h"

namespace softverbs::provider {

// The verbs ABI's values and the emulator's are the same numbers; say so.
static_assert(IBV_QP_STATE == qp_attr::kState && IBV_QP_DEST_QPN == qp_attr::kDestQpn &&
              IBV_QP_MAX_DEST_RD_ATOMIC == qp_attr::kMaxDestRdAtomic && IBV_QP_CAP == qp_attr::kCapabilities);
static_assert(IBV_ACCESS_LOCAL_WRITE == access::kLocalWrite && IBV_ACCESS_REMOTE_ATOMIC == access::kRemoteAtomic &&
              IBV_ACCESS_ZERO_BASED == access::kZeroBased && IBV_ACCESS_RELAXED_ORDERING == access::kRelaxedOrdering);
static_assert(IBV_WC_RNR_RETRY_EXC_ERR == static_cast<int>(WcStatus::RnrRetryExceededError) &&
              IBV_WC_GENERAL_ERR == static_cast<int>(WcStatus::GeneralError));
static_assert(IBV_WC_RECV_RDMA_WITH_IMM == static_cast<int>(WcOpcode::ReceiveRdmaWithImm));
static_assert(IBV_WR_ATOMIC_FETCH_AND_ADD == static_cast<int>(SendOpcode::AtomicFetchAdd));
static_assert(IBV_SEND_INLINE == send_flag::kInline && IBV_WC_WITH_IMM == wc_flag::kWithImm);
static_assert(IBV_QPS_ERR == static_cast<int>(QpState::Error) && IBV_QPT_RC == 2 && IBV_QPT_UD == 4);

namespace {

using Clock = std::chrono::steady_clock;

ContextState& state_of(ibv_context* context) { return *to_provider(context)->state; }
DeviceMemory& memory_of(ibv_context* context) { return *state_of(context).memory; }

template <typename T, typename Member>
T* container_of(Member* member, Member T::*field) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(member) -
                              reinterpret_cast<std::ptrdiff_t>(&(static_cast<T*>(nullptr)->*field)));
}

// ---- protection domains ---------------------------------------------------

struct ProviderPd {
  ibv_pd ibv{};
  // MRs, QPs, SRQs and AHs made in it: an HCA refuses to free a PD that
  // still has any (EBUSY), and the PD stays usable.
  std::atomic<int> users{0};
};

ProviderPd* to_pd(ibv_pd* pd) { return reinterpret_cast<ProviderPd*>(pd); }
void use_pd(ibv_pd* pd) { to_pd(pd)->users.fetch_add(1, std::memory_order_relaxed); }
void unuse_pd(ibv_pd* pd) { to_pd(pd)->users.fetch_sub(1, std::memory_order_relaxed); }

// Verbs that create objects fail with EIO once the device is gone, as
// those of a removed HCA do.
bool device_removed(ibv_context* context) {
  if (!memory_of(context).removed()) return false;
  errno = EIO;
  return true;
}

ibv_pd* alloc_pd(ibv_context* context) {
  if (device_removed(context)) return nullptr;
  auto pd = std::make_unique<ProviderPd>();
  pd->ibv.context = context;
  pd->ibv.handle = memory_of(context).allocate_pd_handle();
  return &pd.release()->ibv;
}

int dealloc_pd(ibv_pd* pd) {
  if (to_pd(pd)->users.load(std::memory_order_relaxed) > 0) return EBUSY;
  std::unique_ptr<ProviderPd> owner(to_pd(pd));
  return 0;
}

// The IB access rights that make an HCA pin pages for writing.
constexpr int kWritableAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND;

// ---- memory regions -------------------------------------------------------

ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, uint64_t hca_va, int access_flags) {
  if (int error = validate_registration_access(static_cast<uint32_t>(access_flags))) {
    errno = error;
    return nullptr;
  }
  if (length > limits::kMaxMrSize || (addr == nullptr && length != 0)) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  // Pages an HCA could not pin with the access asked for are refused now,
  // not found out when a peer's WRITE lands on them.
  if (int error = check_registrable(reinterpret_cast<uint64_t>(addr), length, access_flags & kWritableAccess)) {
    errno = error;
    return nullptr;
  }
  DeviceMemory& memory = memory_of(pd->context);
  const int process = memory.process_slot();
  if (process < 0) {
    errno = ENOMEM;
    return nullptr;
  }
  uint64_t iova = (access_flags & IBV_ACCESS_ZERO_BASED) ? 0 : hca_va;
  // Memory that other processes write or read (receive buffers, remote
  // access) becomes mappable by them, where it qualifies.
  SharedBacking backing;
  if (access_flags &
      (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) {
    const char* why = "";
    if (auto shared = share_pages(reinterpret_cast<uint64_t>(addr), length, &why))
      backing = *shared;
    else
      debug_log("MR at %p, %zu bytes: peers copy with system calls (%s)", addr, length, why);
  }
  std::optional<uint32_t> key;
  {
    ExclusiveLock lock(memory.shared().memory_lock);
    key = memory.shared().mrs.register_region(pd->handle, getpid(), reinterpret_cast<uint64_t>(addr), iova, length,
                                              static_cast<uint32_t>(access_flags), backing, process);
  }
  if (!key) {
    release_pages(backing);
    errno = ENOMEM;
    return nullptr;
  }
  auto mr = std::make_unique<abi::verbs_mr>();
  mr->ibv_mr.context = pd->context;
  mr->ibv_mr.pd = pd;
  mr->ibv_mr.addr = addr;
  mr->ibv_mr.length = length;
  mr->ibv_mr.handle = *key;
  mr->ibv_mr.lkey = *key;
  mr->ibv_mr.rkey = *key;
  mr->mr_type = abi::kMrTypeMr;
  mr->access = access_flags;
  use_pd(pd);
  return &mr.release()->ibv_mr;
}

int rereg_mr(abi::verbs_mr* vmr, int flags, ibv_pd* pd, void* addr, size_t length, int access_flags) {
  ibv_mr& mr = vmr->ibv_mr;
  DeviceMemory& memory = memory_of(mr.context);
  int error = 0;
  if ((flags & IBV_REREG_MR_CHANGE_ACCESS) &&
      (error = validate_registration_access(static_cast<uint32_t>(access_flags))) != 0) {
    errno = error;
    return error;
  }
  if ((flags & IBV_REREG_MR_CHANGE_PD) && (pd == nullptr || pd->context != mr.context)) {
    errno = EINVAL;
    return EINVAL;
  }
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    const int access = (flags & IBV_REREG_MR_CHANGE_ACCESS) ? access_flags : vmr->access;
    if (length > limits::kMaxMrSize || (addr == nullptr && length != 0)) error = EINVAL;
    if (error == 0) error = check_registrable(reinterpret_cast<uint64_t>(addr), length, access & kWritableAccess);
    if (error != 0) {
      errno = error;
      return error;
    }
  }
  SharedBacking dropped;
  bool found = false;
  // The UDP engines of this process use the old range without the table's
  // lock: they are held off while it changes.
  UdpTransport::hold_data_paths(memory, [&] {
    ExclusiveLock lock(memory.shared().memory_lock);
    std::optional<MemoryRegion> region = memory.shared().mrs.find(mr.lkey);
    if (!region) return;
    found = true;
    if (flags & IBV_REREG_MR_CHANGE_PD) region->pd_handle = pd->handle;
    if (flags & IBV_REREG_MR_CHANGE_ACCESS) region->access = static_cast<uint32_t>(access_flags);
    if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
      region->address = reinterpret_cast<uint64_t>(addr);
      region->length = length;
      // The new range is reached with system calls (not worth moving pages
      // under the table's lock).
      dropped = region->backing;
      region->backing = SharedBacking{};
    }
    if (flags & (IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_ACCESS))
      region->iova = (region->access & IBV_ACCESS_ZERO_BASED) ? 0 : region->address;
    memory.shared().mrs.reregister(mr.lkey, *region);
  });
  if (!found) {
    errno = EINVAL;
    return EINVAL;
  }
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) vmr->access = access_flags;
  if (flags & IBV_REREG_MR_CHANGE_PD) {
    unuse_pd(mr.pd);
    use_pd(pd);
  }
  release_pages(dropped);
  return 0;
}

int dereg_mr(abi::verbs_mr* vmr) {
  DeviceMemory& memory = memory_of(vmr->ibv_mr.context);
  SharedBacking backing;
  bool removed = false;
  // The UDP engines of this process use registered ranges without the
  // table's lock: they are held off while one goes.
  UdpTransport::hold_data_paths(memory, [&] {
    ExclusiveLock lock(memory.shared().memory_lock);
    auto region = memory.shared().mrs.find(vmr->ibv_mr.lkey);
    if (!region || !memory.shared().mrs.deregister(vmr->ibv_mr.lkey)) return;
    backing = region->backing;
    removed = true;
  });
  if (!removed) return EINVAL;
  release_pages(backing);
  unuse_pd(vmr->ibv_mr.pd);
  std::unique_ptr<abi::verbs_mr> owner(vmr);
  return 0;
}

// ---- completion queues ----------------------------------------------------

struct ProviderCq {
  abi::verbs_cq verbs{};
  int index = -1;
  int qp_references = 0;  // under the context's qps_mutex
  Completion current;     // the entry an extended poll is positioned on
  // Where the ring's slots are, for polls: the record's copy is on the
  // producers' cache line. Under the ring's poll lock.
  uint64_t slots_offset = 0;
};

ProviderCq* to_cq(ibv_cq* cq) { return reinterpret_cast<ProviderCq*>(cq); }
ProviderCq* to_cq(ibv_cq_ex* cq) { return reinterpret_cast<ProviderCq*>(cq); }

ProviderCq* create_cq_common(ibv_context* context, int cqe, ibv_comp_channel* channel, int comp_vector) {
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
  auto cq = std::make_unique<ProviderCq>();
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

// ibv_cq_ex: start/next/end_poll walk the ring one entry at a time; the
// read_* getters read the current entry.
int next_poll_ex(ibv_cq_ex* ibv) {
  ProviderCq* cq = to_cq(ibv);
  if (!pop_completion(cq, cq->current)) return ENOENT;
  ibv->wr_id = cq->current.wr_id;
  ibv->status = static_cast<ibv_wc_status>(cq->current.status);
  return 0;
}

int start_poll_ex(ibv_cq_ex* ibv, ibv_poll_cq_attr* attr) {
  if (attr != nullptr && attr->comp_mask != 0) return EINVAL;
  progress_deferred_sends(state_of(ibv->context));
  if (UdpTransport* udp = state_of(ibv->context).udp_running.load(std::memory_order_acquire)) udp->drive();
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

constexpr uint64_t kSupportedWcFlags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM |
                                       IBV_WC_EX_WITH_SRC_QP | IBV_WC_EX_WITH_SLID | IBV_WC_EX_WITH_SL |
                                       IBV_WC_EX_WITH_DLID_PATH_BITS;

ibv_cq_ex* create_cq_ex(ibv_context* context, ibv_cq_init_attr_ex* attr) {
  if (attr->comp_mask & ~static_cast<uint32_t>(IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD)) {
    errno = EINVAL;
    return nullptr;
  }
  // Timestamps and the rest are not emulated: say so rather than return zeros.
  if ((attr->wc_flags & ~kSupportedWcFlags) || ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) && attr->flags != 0)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ProviderCq* cq =
      create_cq_common(context, static_cast<int>(attr->cqe), attr->channel, static_cast<int>(attr->comp_vector));
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
  return &ex;
}

int destroy_cq(ibv_cq* ibv) {
  ProviderCq* cq = to_cq(ibv);
  ContextState& state = state_of(ibv->context);
  {
    std::lock_guard guard(state.qps_mutex);
    if (cq->qp_references > 0) return EBUSY;
  }
  unregister_handle(HandleKind::Cq, ibv);
  CqRecord& record = state.memory->shared().cqs[cq->index];
  uint64_t ring, bytes;
  {
    SharedLock lock(record.lock);
    record.live = 0;
    ring = record.ring_offset;
    bytes = record.ring_bytes;
  }
  state.memory->release(ring, bytes);
  std::unique_ptr<ProviderCq> owner(cq);
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
  // An armed CQ means the application is about to wait for an event.
  if (UdpTransport* udp = state_of(ibv->context).udp_running.load(std::memory_order_acquire)) udp->application_waits();
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
  ContextState& state = state_of(ibv->context);
  progress_deferred_sends(state);
  if (UdpTransport* udp = state.udp_running.load(std::memory_order_acquire)) udp->drive();
  UninitializedArray<Completion, 16> batch;  // pop_completions writes what it returns
  int polled = 0;
  while (polled < num_entries) {
    size_t want = std::min<size_t>(batch.size(), static_cast<size_t>(num_entries - polled));
    size_t got = pop_completions(to_cq(ibv), std::span(batch.data(), want));
    for (size_t i = 0; i < got; ++i) to_ibv_wc(batch.items[i], wc[polled + static_cast<int>(i)]);
    polled += static_cast<int>(got);
    if (got < want) break;
  }
  return polled;
}

// ---- address handles ------------------------------------------------------

struct ProviderAh {
  ibv_ah ibv{};
  ibv_ah_attr attr{};
  ibv_gid source_gid{};
};

// Whether UD datagrams go over UDP: on a udp device, and on an auto one
// whose netdev is not a loopback (a UD QP listens on UDP wherever a peer
// may be elsewhere).
bool ud_over_udp(const ContextState& state) {
  const TransportChoice choice = state.config.transport;
  return choice == TransportChoice::Udp || (choice == TransportChoice::Auto && !state.netdev_is_loopback);
}

ibv_ah* create_ah(ibv_pd* pd, ibv_ah_attr* attr) {
  if (attr == nullptr || attr->port_num != 1 || (attr->is_global && attr->grh.sgid_index >= limits::kGidTableLength)) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  auto ah = std::make_unique<ProviderAh>();
  ah->ibv.context = pd->context;
  ah->ibv.pd = pd;
  ah->attr = *attr;
  if (attr->is_global && ibv_query_gid(pd->context, 1, attr->grh.sgid_index, &ah->source_gid) != 0) {
    errno = EINVAL;
    return nullptr;
  }
  // Where UD datagrams go over UDP, an address handle that they could not
  // leave by (a source GID that is not an address of the netdev) fails
  // here, as a QP's move to RTR does, rather than every send with it.
  ContextState& state = state_of(pd->context);
  if (attr->is_global && ud_over_udp(state)) {
    std::string error;
    if (UdpTransport* udp = udp_transport(state);
        udp != nullptr && !udp->usable_source_gid(attr->grh.sgid_index, &error)) {
      std::fprintf(stderr, "softverbs: address handle: %s\n", error.c_str());
      errno = EINVAL;
      return nullptr;
    }
  }
  use_pd(pd);
  return &ah.release()->ibv;
}

int destroy_ah(ibv_ah* ah) {
  unuse_pd(ah->pd);
  std::unique_ptr<ProviderAh> owner(reinterpret_cast<ProviderAh*>(ah));
  return 0;
}

// ---- shared receive queues ------------------------------------------------

struct ProviderSrq {
  abi::verbs_srq verbs{};
  int index = -1;
  int qp_references = 0;  // under the context's qps_mutex
};

ProviderSrq* to_srq(ibv_srq* srq) { return reinterpret_cast<ProviderSrq*>(srq); }
SrqRecord& record_of(ProviderSrq* srq) { return memory_of(srq->verbs.srq.context).shared().srqs[srq->index]; }

ibv_srq* create_srq(ibv_pd* pd, ibv_srq_init_attr* init) {
  ContextState& state = state_of(pd->context);
  ibv_srq_attr& attr = init->attr;
  if (attr.max_wr == 0 || attr.max_wr > static_cast<uint32_t>(state.device.max_srq_wr) ||
      attr.max_sge > static_cast<uint32_t>(state.device.max_srq_sge) || attr.srq_limit > attr.max_wr) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  DeviceMemory& memory = *state.memory;
  int index = memory.allocate_srq();
  if (index < 0) {
    errno = ENOMEM;
    return nullptr;
  }
  SrqRecord& record = memory.shared().srqs[index];
  RecvQueue rq = allocate_receive_queue(memory, attr.max_wr, attr.max_sge);
  if (rq.ring_offset == 0) {
    SharedLock lock(record.lock);
    record.live = 0;
    errno = ENOMEM;
    return nullptr;
  }
  auto srq = std::make_unique<ProviderSrq>();
  srq->index = index;
  ibv_srq& ibv = srq->verbs.srq;
  ibv.context = pd->context;
  ibv.srq_context = init->srq_context;
  ibv.pd = pd;
  ibv.handle = static_cast<uint32_t>(index);
  pthread_mutex_init(&ibv.mutex, nullptr);
  pthread_cond_init(&ibv.cond, nullptr);
  srq->verbs.srq_type = IBV_SRQT_BASIC;
  attr.max_wr = rq.capacity;
  attr.max_sge = rq.max_sge;
  {
    SharedLock lock(record.lock);
    record.pd_handle = pd->handle;
    record.rq = rq;
    record.limit = attr.srq_limit;
    record.owner_handle = reinterpret_cast<uint64_t>(&ibv);
    record.owner_async = state.async_address;
  }
  use_pd(pd);
  register_handle(HandleKind::Srq, &ibv);
  return &srq.release()->verbs.srq;
}

int modify_srq(ibv_srq* ibv, ibv_srq_attr* attr, int mask) {
  ProviderSrq* srq = to_srq(ibv);
  ContextState& state = state_of(ibv->context);
  SrqRecord& record = record_of(srq);
  if (mask & ~(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT)) return EINVAL;
  uint64_t old_ring = 0, old_bytes = 0;
  {
    SharedLock lock(record.lock);
    uint32_t capacity = record.rq.capacity;
    if (mask & IBV_SRQ_MAX_WR) {
      uint64_t queued = record.rq.posted - record.rq.consumed;
      if (attr->max_wr == 0 || attr->max_wr > static_cast<uint32_t>(state.device.max_srq_wr) || attr->max_wr < queued)
        return EINVAL;
      capacity = attr->max_wr;
    }
    if ((mask & IBV_SRQ_LIMIT) && attr->srq_limit > capacity) return EINVAL;
    if ((mask & IBV_SRQ_MAX_WR) && capacity != record.rq.capacity) {
      // Resize: a new ring holding the queued WQEs in order.
      RecvQueue grown = allocate_receive_queue(*state.memory, capacity, record.rq.max_sge);
      if (grown.ring_offset == 0) return ENOMEM;
      for (uint64_t position = record.rq.consumed; position != record.rq.posted; ++position) {
        RecvWqe* moved = state.memory->recv_slot(grown, grown.posted);
        std::memcpy(moved, state.memory->recv_slot(record.rq, position), record.rq.slot_size);
        moved->sequence = wqe_sequence(grown.posted++);  // its place in the new ring
      }
      old_ring = record.rq.ring_offset;
      old_bytes = ring_bytes(record.rq);
      record.rq = grown;
    }
    if (mask & IBV_SRQ_LIMIT) record.limit = attr->srq_limit;
  }
  state.memory->release(old_ring, old_bytes);
  return 0;
}

int query_srq(ibv_srq* ibv, ibv_srq_attr* attr) {
  SrqRecord& record = record_of(to_srq(ibv));
  SharedLock lock(record.lock);
  attr->max_wr = record.rq.capacity;
  attr->max_sge = record.rq.max_sge;
  attr->srq_limit = record.limit;
  return 0;
}

int destroy_srq(ibv_srq* ibv) {
  ProviderSrq* srq = to_srq(ibv);
  ContextState& state = state_of(ibv->context);
  {
    std::lock_guard guard(state.qps_mutex);
    if (srq->qp_references > 0) return EBUSY;
  }
  unregister_handle(HandleKind::Srq, ibv);
  SrqRecord& record = record_of(srq);
  uint64_t ring, bytes;
  {
    SharedLock lock(record.lock);
    record.live = 0;
    ring = record.rq.ring_offset;
    bytes = ring_bytes(record.rq);
  }
  state.memory->release(ring, bytes);
  unuse_pd(ibv->pd);
  std::unique_ptr<ProviderSrq> owner(srq);
  return 0;
}

// Posts each receive of the chain with `post_one` (a QP's or an SRQ's), up
// to the first it refuses (*bad_wr); then, over UDP, a SEND may be waiting
// for one of them.
template <typename PostOne>
int post_receive_chain(ibv_context* context, ibv_recv_wr* wr, ibv_recv_wr** bad_wr, PostOne post_one) {
  int error = 0;
  for (; wr != nullptr && error == 0; wr = wr->next) {
    error = wr->num_sge < 0 ? EINVAL
                            : post_one(wr->wr_id, std::span(reinterpret_cast<const Sge*>(wr->sg_list),
                                                            static_cast<size_t>(wr->num_sge)));
    if (error) *bad_wr = wr;
  }
  if (UdpTransport* udp = state_of(context).udp_running.load(std::memory_order_acquire)) udp->receive_posted();
  return error;
}

int post_srq_recv(ibv_srq* ibv, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  SrqRecord& record = record_of(to_srq(ibv));
  DeviceMemory& memory = memory_of(ibv->context);
  return post_receive_chain(ibv->context, wr, bad_wr, [&](uint64_t wr_id, std::span<const Sge> sges) {
    return post_srq_receive(memory, record, wr_id, sges);
  });
}

}  // namespace

// ---- queue pairs ----------------------------------------------------------

// A send that could not run yet: the receiver had no WQE posted (RNR), or the
// peer QP was not ready (RC retries until timeout x retry_cnt runs out).
struct DeferredSend {
  SendRequest request;
  std::vector<Sge> sges;
  std::vector<uint8_t> inline_bytes;
  bool signaled = false;
  // The RNR budget starts at the first RNR, as the timeout's (give_up) at
  // the first attempt that finds no responder: nullopt before; -1: infinite.
  std::optional<int> rnr_retries_left;
  Clock::time_point next_attempt{};
  Clock::time_point give_up{Clock::time_point::max()};
};

// A work request built with the ibv_wr_* calls, posted at ibv_wr_complete.
struct BuiltRequest {
  ibv_send_wr wr{};
  std::vector<ibv_sge> sges;
  std::vector<uint8_t> inline_bytes;
};

struct ProviderQp {
  abi::verbs_qp verbs{};
  int index = -1;
  ProviderCq* send_cq = nullptr;
  ProviderCq* recv_cq = nullptr;
  ProviderSrq* srq = nullptr;
  std::vector<BuiltRequest> batch;  // between ibv_wr_start and ibv_wr_complete
  udp::SendWqe udp_wqe;             // scratch for posts over UDP (under the QP's post lock)
  int batch_error = 0;
  std::mutex mutex;  // serializes this QP's send queue
  std::deque<DeferredSend> deferred;
  // RC/UC: connected over UDP (chosen at RTR). UD: also receives over UDP,
  // and sends there to GIDs that are not this device's.
  bool over_udp = false;
  bool removal_handled = false;  // see fail_after_removal
};

namespace {

ProviderQp* to_qp(ibv_qp* qp) { return reinterpret_cast<ProviderQp*>(qp); }

// The context counts deferred sends so that polling skips the sweep when
// there are none. Callers hold qp->mutex.
void count_deferred(ProviderQp* qp, int change) {
  state_of(qp->verbs.qp.context).deferred_sends.fetch_add(change, std::memory_order_release);
}

void drop_deferred(ProviderQp* qp) {
  count_deferred(qp, -static_cast<int>(qp->deferred.size()));
  qp->deferred.clear();
}

QpRecord& record_of(ProviderQp* qp) { return memory_of(qp->verbs.qp.context).shared().qps[qp->index]; }

std::optional<QpType> emulator_qp_type(ibv_qp_type type) {
  switch (type) {
    case IBV_QPT_RC:
      return QpType::Rc;
    case IBV_QPT_UC:
      return QpType::Uc;
    case IBV_QPT_UD:
      return QpType::Ud;
    default:
      return std::nullopt;
  }
}

ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  ContextState& state = state_of(pd->context);
  auto type = emulator_qp_type(attr->qp_type);
  if (!type) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_qp_cap& cap = attr->cap;
  if (attr->send_cq == nullptr || attr->recv_cq == nullptr || attr->send_cq->context != pd->context ||
      attr->recv_cq->context != pd->context || cap.max_send_wr > static_cast<uint32_t>(state.device.max_qp_wr) ||
      cap.max_recv_wr > static_cast<uint32_t>(state.device.max_qp_wr) ||
      cap.max_send_sge > static_cast<uint32_t>(state.device.max_sge) ||
      cap.max_recv_sge > static_cast<uint32_t>(state.device.max_sge) ||
      cap.max_inline_data > static_cast<uint32_t>(state.device.max_inline_data)) {
    errno = EINVAL;
    return nullptr;
  }
  if (attr->srq != nullptr && (attr->srq->context != pd->context || *type == QpType::Ud)) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  DeviceMemory& memory = *state.memory;
  int index = memory.allocate_qp();
  if (index < 0) {
    errno = ENOMEM;
    return nullptr;
  }
  QpRecord& record = memory.shared().qps[index];
  // With an SRQ the QP has no receive queue of its own.
  RecvQueue rq;
  if (attr->srq == nullptr) {
    rq = allocate_receive_queue(memory, cap.max_recv_wr, cap.max_recv_sge);
    if (rq.ring_offset == 0) {
      SharedLock lock(record.lock);
      record.live = 0;
      errno = ENOMEM;
      return nullptr;
    }
  }
  cap.max_send_wr = std::max<uint32_t>(cap.max_send_wr, 1);
  cap.max_recv_wr = attr->srq ? 0 : rq.capacity;
  cap.max_send_sge = std::max<uint32_t>(cap.max_send_sge, 1);
  cap.max_recv_sge = attr->srq ? 0 : rq.max_sge;
  {
    SharedLock lock(record.lock);
    record.type = *type;
    record.pd_handle = pd->handle;
    record.signal_all = attr->sq_sig_all ? 1 : 0;
    record.send_cq = to_cq(attr->send_cq)->index;
    record.recv_cq = to_cq(attr->recv_cq)->index;
    record.srq = attr->srq ? to_srq(attr->srq)->index : -1;
    record.caps = {cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge, cap.max_inline_data};
    record.rq = rq;
    record.owner_async = state.async_address;
    record.attributes.path_mtu = static_cast<uint8_t>(state.port.active_mtu);
  }
  auto qp = std::make_unique<ProviderQp>();
  qp->index = index;
  qp->send_cq = to_cq(attr->send_cq);
  qp->recv_cq = to_cq(attr->recv_cq);
  qp->srq = attr->srq ? to_srq(attr->srq) : nullptr;
  ibv_qp& ibv = qp->verbs.qp;
  ibv.context = pd->context;
  ibv.qp_context = attr->qp_context;
  ibv.pd = pd;
  ibv.send_cq = attr->send_cq;
  ibv.recv_cq = attr->recv_cq;
  ibv.srq = attr->srq;
  ibv.handle = static_cast<uint32_t>(index);
  ibv.qp_num = record.qpn;
  ibv.state = IBV_QPS_RESET;
  ibv.qp_type = attr->qp_type;
  pthread_mutex_init(&ibv.mutex, nullptr);
  pthread_cond_init(&ibv.cond, nullptr);
  ibv.events_completed = 0;
  {
    std::lock_guard guard(state.qps_mutex);
    ++qp->send_cq->qp_references;
    ++qp->recv_cq->qp_references;
    if (qp->srq) ++qp->srq->qp_references;
    state.qps.push_back(qp.get());
  }
  use_pd(pd);
  {
    SharedLock lock(record.lock);
    record.owner_handle = reinterpret_cast<uint64_t>(&qp->verbs.qp);
  }
  register_handle(HandleKind::Qp, &qp->verbs.qp);
  return &qp.release()->verbs.qp;
}

void complete_send(DeviceMemory& memory, ProviderQp* qp, const Completion& completion) {
  deliver_completion(memory, qp->send_cq->index, completion, false);
}

// Completes this QP's deferred sends flushed (the QP is in ERR).
void flush_deferred_sends(DeviceMemory& memory, ProviderQp* qp) {
  QpRecord& record = record_of(qp);
  while (!qp->deferred.empty()) {
    Completion flushed;
    flushed.wr_id = qp->deferred.front().request.wr_id;
    flushed.status = WcStatus::WrFlushError;
    flushed.opcode = WcOpcode::Send;
    flushed.qp_num = record.qpn;
    complete_send(memory, qp, flushed);
    qp->deferred.pop_front();
    count_deferred(qp, -1);
  }
}

// Takes the QP to ERR: deferred sends and queued receives complete flushed.
void enter_error_state(DeviceMemory& memory, ProviderQp* qp) {
  QpRecord& record = record_of(qp);
  // A QP on an SRQ reports, once, that no more receives will complete on it.
  if (move_to_error(record, qp->verbs.qp.qp_num) && qp->srq != nullptr)
    send_async_event(record.owner_async, reinterpret_cast<uint64_t>(&qp->verbs.qp), AsyncEventType::QpLastWqeReached);
  qp->verbs.qp.state = IBV_QPS_ERR;
  flush_deferred_sends(memory, qp);
  flush_receive_queue(memory, record);
}

int destroy_qp(ibv_qp* ibv) {
  ProviderQp* qp = to_qp(ibv);
  ContextState& state = state_of(ibv->context);
  unregister_handle(HandleKind::Qp, ibv);
  if (qp->over_udp) udp_transport(state)->forget_qp(ibv->qp_num);
  QpRecord& record = record_of(qp);
  uint64_t ring, bytes;
  {
    SharedLock lock(record.lock);
    record.live = 0;
    ring = record.rq.ring_offset;
    bytes = ring_bytes(record.rq);
  }
  state.memory->release(ring, bytes);
  {
    ExclusiveLock lock(state.memory->shared().memory_lock);
    state.memory->shared().multicast.detach_everywhere(ibv->qp_num);
  }
  if (UdpTransport* udp = state.udp_running.load(std::memory_order_acquire); udp && ibv->qp_type == IBV_QPT_UD)
    udp->leave_groups(ibv->qp_num);
  purge_completions(*state.memory, qp->send_cq->index, ibv->qp_num);
  purge_completions(*state.memory, qp->recv_cq->index, ibv->qp_num);
  {
    std::lock_guard guard(state.qps_mutex);
    --qp->send_cq->qp_references;
    --qp->recv_cq->qp_references;
    if (qp->srq) --qp->srq->qp_references;
    std::erase(state.qps, qp);
  }
  {
    std::lock_guard guard(qp->mutex);
    drop_deferred(qp);
  }
  unuse_pd(ibv->pd);
  std::unique_ptr<ProviderQp> owner(qp);
  return 0;
}

bool valid_attribute_values(const ContextState& state, const ibv_qp_attr& attr, int mask) {
  if ((mask & IBV_QP_PORT) && attr.port_num != 1) return false;
  if ((mask & IBV_QP_PKEY_INDEX) && attr.pkey_index >= limits::kPkeyTableLength) return false;
  if ((mask & IBV_QP_ACCESS_FLAGS) &&
      (attr.qp_access_flags & ~(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                                IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND)))
    return false;
  if ((mask & IBV_QP_PATH_MTU) && (attr.path_mtu < IBV_MTU_256 || attr.path_mtu > IBV_MTU_4096)) return false;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && attr.max_rd_atomic > state.device.max_qp_init_rd_atomic) return false;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && attr.max_dest_rd_atomic > state.device.max_qp_rd_atomic) return false;
  if ((mask & IBV_QP_TIMEOUT) && attr.timeout > 31) return false;
  if ((mask & IBV_QP_RETRY_CNT) && attr.retry_cnt > 7) return false;
  if ((mask & IBV_QP_RNR_RETRY) && attr.rnr_retry > 7) return false;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && attr.min_rnr_timer > 31) return false;
  if ((mask & IBV_QP_DEST_QPN) && attr.dest_qp_num > 0xffffff) return false;
  if ((mask & (IBV_QP_RQ_PSN | IBV_QP_SQ_PSN)) &&
      (((mask & IBV_QP_RQ_PSN) && attr.rq_psn > 0xffffff) || ((mask & IBV_QP_SQ_PSN) && attr.sq_psn > 0xffffff)))
    return false;
  if ((mask & IBV_QP_AV) &&
      (attr.ah_attr.port_num > 1 || (attr.ah_attr.is_global && attr.ah_attr.grh.sgid_index >= limits::kGidTableLength)))
    return false;
  return true;
}

void apply_attributes(QpAttributes& a, const ibv_qp_attr& attr, int mask) {
  if (mask & IBV_QP_QKEY) a.qkey = attr.qkey;
  if (mask & IBV_QP_RQ_PSN) a.rq_psn = attr.rq_psn;
  if (mask & IBV_QP_SQ_PSN) a.sq_psn = attr.sq_psn;
  if (mask & IBV_QP_DEST_QPN) a.dest_qpn = attr.dest_qp_num;
  if (mask & IBV_QP_ACCESS_FLAGS) a.access_flags = static_cast<uint32_t>(attr.qp_access_flags);
  if (mask & IBV_QP_PKEY_INDEX) a.pkey_index = attr.pkey_index;
  if (mask & IBV_QP_PORT) a.port = attr.port_num;
  if (mask & IBV_QP_PATH_MTU) a.path_mtu = static_cast<uint8_t>(attr.path_mtu);
  if (mask & IBV_QP_TIMEOUT) a.timeout = attr.timeout;
  if (mask & IBV_QP_RETRY_CNT) a.retry_count = attr.retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) a.rnr_retry = attr.rnr_retry;
  if (mask & IBV_QP_MIN_RNR_TIMER) a.min_rnr_timer = attr.min_rnr_timer;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) a.max_rd_atomic = attr.max_rd_atomic;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) a.max_dest_rd_atomic = attr.max_dest_rd_atomic;
  if (mask & IBV_QP_AV) {
    const ibv_ah_attr& ah = attr.ah_attr;
    a.dlid = ah.dlid;
    a.service_level = ah.sl;
    a.is_global = ah.is_global;
    a.sgid_index = ah.grh.sgid_index;
    a.hop_limit = ah.grh.hop_limit;
    a.traffic_class = ah.grh.traffic_class;
    a.flow_label = ah.grh.flow_label;
    std::memcpy(a.dgid, ah.grh.dgid.raw, 16);
  }
}

// Whether a QP takes the UDP transport, decided when it moves to RTR:
// `udp` means yes, 0 no, an errno that the Modify QP fails.
struct TransportDecision {
  bool udp = false;
  int error = 0;
};

TransportDecision choose_transport(ContextState& state, uint32_t qpn, QpType type, const QpAttributes& next) {
  const TransportChoice choice = state.config.transport;
  if (choice == TransportChoice::SharedMemory) return {};
  if (type == QpType::Ud) {
    if (!ud_over_udp(state)) return {};
    UdpTransport* udp = udp_transport(state);
    if (udp == nullptr) return {false, choice == TransportChoice::Udp ? EADDRNOTAVAIL : 0};
    return {true, 0};
  }
  Gid dgid;
  std::memcpy(dgid.raw.data(), next.dgid, 16);
  if (choice == TransportChoice::Auto) {
    // Same host (a GID of this very device, or a loopback netdev) means
    // shared memory; anything else is another host, reached over UDP.
    if (state.netdev_is_loopback || !next.is_global) return {};
    for (const GidEntry& entry : state.gids)
      if (entry.gid == dgid) return {};
  }
  if (!next.is_global) {
    std::fprintf(stderr,
                 "softverbs: QP %#x: the UDP transport needs a GRH (ah_attr.is_global = 1 and the peer's GID, "
                 "e.g. ibv_rc_pingpong -g <gid index>)\n",
                 qpn);
    return {false, EINVAL};
  }
  UdpTransport* udp = udp_transport(state);
  if (udp == nullptr) return {false, EADDRNOTAVAIL};
  std::string error;
  if (!udp->usable_source_gid(next.sgid_index, &error) ||
      !udp->resolve_path(next.sgid_index, dgid, next.traffic_class, next.hop_limit, next.flow_label, &error)) {
    std::fprintf(stderr, "softverbs: QP %#x: %s\n", qpn, error.c_str());
    return {false, EINVAL};
  }
  return {true, 0};
}

int modify_qp(ibv_qp* ibv, ibv_qp_attr* attr, int mask) {
  ProviderQp* qp = to_qp(ibv);
  ContextState& state = state_of(ibv->context);
  QpRecord& record = record_of(qp);
  std::lock_guard guard(qp->mutex);
  QpState current, target;
  QpType type;
  QpAttributes next;
  {
    SharedLock lock(record.lock);
    current = record.state;
    if ((mask & IBV_QP_CUR_STATE) && static_cast<int>(attr->cur_qp_state) != static_cast<int>(current)) return EINVAL;
    target = (mask & IBV_QP_STATE) ? static_cast<QpState>(attr->qp_state) : current;
    if ((mask & IBV_QP_STATE) && attr->qp_state > IBV_QPS_ERR) return EINVAL;
    if (check_transition(current, target, record.type, static_cast<uint32_t>(mask)) != TransitionVerdict::Allowed)
      return EINVAL;
    if (!valid_attribute_values(state, *attr, mask)) return EINVAL;
    type = record.type;
    next = record.attributes;
    apply_attributes(next, *attr, mask);
  }
  if (current == QpState::Init && target == QpState::Rtr) {
    TransportDecision decision = choose_transport(state, ibv->qp_num, type, next);
    if (decision.error != 0) return decision.error;
    qp->over_udp = decision.udp;
  }
  {
    SharedLock lock(record.lock);
    record.attributes = next;
    if (target != QpState::Error) set_state(record, target);
    if (target == QpState::Reset) {
      discard_receive_queue(*state.memory, record);  // after the state: see post_receive
      record.attributes = QpAttributes{};
      record.attributes.path_mtu = static_cast<uint8_t>(state.port.active_mtu);
    }
  }
  if (target == QpState::Error) {
    enter_error_state(*state.memory, qp);
  } else {
    ibv->state = static_cast<ibv_qp_state>(target);
  }
  int error = 0;
  if (qp->over_udp) {
    error = udp_transport(state)->sync_qp(qp->index);
    if (target == QpState::Reset) qp->over_udp = false;
  }
  if (target == QpState::Reset) {
    // After the UDP engine has forgotten the QP: until then its background
    // thread may still complete a request whose ACK just arrived, and a
    // completion purged before that would have come back.
    drop_deferred(qp);
    purge_completions(*state.memory, qp->send_cq->index, ibv->qp_num);
    purge_completions(*state.memory, qp->recv_cq->index, ibv->qp_num);
  }
  return error;
}

int query_qp(ibv_qp* ibv, ibv_qp_attr* attr, int, ibv_qp_init_attr* init_attr) {
  ProviderQp* qp = to_qp(ibv);
  QpRecord& record = record_of(qp);
  SharedLock lock(record.lock);
  const QpAttributes& a = record.attributes;
  *attr = {};
  attr->qp_state = static_cast<ibv_qp_state>(record.state);
  attr->cur_qp_state = attr->qp_state;
  attr->path_mtu = static_cast<ibv_mtu>(a.path_mtu);
  attr->qkey = a.qkey;
  attr->rq_psn = a.rq_psn;
  attr->sq_psn = a.sq_psn;
  attr->dest_qp_num = a.dest_qpn;
  attr->qp_access_flags = static_cast<int>(a.access_flags);
  attr->cap = {record.caps.max_send_wr, record.caps.max_recv_wr, record.caps.max_send_sge, record.caps.max_recv_sge,
               record.caps.max_inline_data};
  attr->ah_attr.dlid = a.dlid;
  attr->ah_attr.sl = a.service_level;
  attr->ah_attr.is_global = a.is_global;
  attr->ah_attr.port_num = a.port;
  attr->ah_attr.grh.sgid_index = a.sgid_index;
  attr->ah_attr.grh.hop_limit = a.hop_limit;
  attr->ah_attr.grh.traffic_class = a.traffic_class;
  attr->ah_attr.grh.flow_label = a.flow_label;
  std::memcpy(attr->ah_attr.grh.dgid.raw, a.dgid, 16);
  attr->pkey_index = a.pkey_index;
  attr->sq_draining = 0;
  attr->max_rd_atomic = a.max_rd_atomic;
  attr->max_dest_rd_atomic = a.max_dest_rd_atomic;
  attr->min_rnr_timer = a.min_rnr_timer;
  attr->port_num = a.port;
  attr->timeout = a.timeout;
  attr->retry_cnt = a.retry_count;
  attr->rnr_retry = a.rnr_retry;
  *init_attr = {};
  init_attr->qp_context = ibv->qp_context;
  init_attr->send_cq = ibv->send_cq;
  init_attr->recv_cq = ibv->recv_cq;
  init_attr->srq = ibv->srq;
  init_attr->cap = attr->cap;
  init_attr->qp_type = ibv->qp_type;
  init_attr->sq_sig_all = record.signal_all;
  return 0;
}

int post_recv(ibv_qp* ibv, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  QpRecord& record = record_of(to_qp(ibv));
  DeviceMemory& memory = memory_of(ibv->context);
  return post_receive_chain(ibv->context, wr, bad_wr, [&](uint64_t wr_id, std::span<const Sge> sges) {
    return post_receive(memory, record, wr_id, sges);
  });
}
static_assert(sizeof(Sge) == sizeof(ibv_sge) && offsetof(Sge, lkey) == offsetof(ibv_sge, lkey));

// Builds the emulator's request over the caller's work request (no copy: the
// immediate path allocates nothing); take_ownership() copies what a deferred
// send must keep.
int translate_send(const QpRecord& record, const ibv_send_wr* wr, DeferredSend& send) {
  const SendOpcodeInfo& info = send_opcode_info(wr->opcode);
  if (!info.valid_for(record.type) || wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > record.caps.max_send_sge)
    return EINVAL;
  SendRequest& r = send.request;
  r.wr_id = wr->wr_id;
  r.opcode = static_cast<SendOpcode>(wr->opcode);
  r.flags = wr->send_flags;
  r.imm_data = wr->imm_data;
  r.sges = std::span(reinterpret_cast<const Sge*>(wr->sg_list), static_cast<size_t>(wr->num_sge));
  if (wr->send_flags & IBV_SEND_INLINE) {
    if (info.is(wr_mask::kIntoLocal)) return EINVAL;
    size_t total = 0;
    for (const Sge& sge : r.sges) total += sge.length;
    if (total > record.caps.max_inline_data) return EINVAL;
  }
  if (info.is(wr_mask::kAtomic)) {
    r.remote_address = wr->wr.atomic.remote_addr;
    r.rkey = wr->wr.atomic.rkey;
    r.compare_add = wr->wr.atomic.compare_add;
    r.swap = wr->wr.atomic.swap;
  } else if (info.is(wr_mask::kRemoteRange)) {
    r.remote_address = wr->wr.rdma.remote_addr;
    r.rkey = wr->wr.rdma.rkey;
  }
  if (record.type == QpType::Ud) {
    if (wr->wr.ud.ah == nullptr) return EINVAL;
    auto* ah = reinterpret_cast<ProviderAh*>(wr->wr.ud.ah);
    r.remote_qpn = wr->wr.ud.remote_qpn;
    r.remote_qkey = wr->wr.ud.remote_qkey;
    r.has_grh = ah->attr.is_global;
    const ContextState& state = state_of(ah->ibv.context);
    r.roce_v2 = !ah->attr.is_global || ah->attr.grh.sgid_index >= state.gids.size() ||
                state.gids[ah->attr.grh.sgid_index].type == GidType::RoceV2;
    std::memcpy(r.source_gid.data(), ah->source_gid.raw, 16);
    std::memcpy(r.destination_gid.data(), ah->attr.grh.dgid.raw, 16);
    r.hop_limit = ah->attr.grh.hop_limit;
    r.traffic_class = ah->attr.grh.traffic_class;
    r.flow_label = ah->attr.grh.flow_label;
  }
  send.signaled = (wr->send_flags & IBV_SEND_SIGNALED) || record.signal_all;
  return 0;
}

// A send that waits keeps its own copy of the SGE list, and of the bytes of
// an inline send (the caller may reuse its buffer once ibv_post_send returns).
void take_ownership(DeferredSend& send) {
  if (send.request.flags & IBV_SEND_INLINE) {
    for (const Sge& sge : send.request.sges) {
      const auto* bytes = reinterpret_cast<const uint8_t*>(sge.address);
      send.inline_bytes.insert(send.inline_bytes.end(), bytes, bytes + sge.length);
    }
    send.sges.assign(1, Sge{reinterpret_cast<uint64_t>(send.inline_bytes.data()),
                            static_cast<uint32_t>(send.inline_bytes.size()), 0});
  } else {
    send.sges.assign(send.request.sges.begin(), send.request.sges.end());
  }
  send.request.sges = send.sges;
}

// After a move, point the request at the storage it now owns (a moved
// vector keeps its buffer, so the inline SGE's address stays right).
void bind_spans(DeferredSend& send) { send.request.sges = send.sges; }

// Runs one send; false if it must wait (and `send` is updated for later).
bool attempt_send(DeviceMemory& memory, ProviderQp* qp, DeferredSend& send) {
  QpRecord& record = record_of(qp);
  Completion completion;
  SendOutcome outcome = execute_send(memory, record, send.request, completion);
  // Only a send that must wait reads the clock: a read on every post was
  // 12% of a shared-memory ib_send_bw sender's time on the 2-core VM.
  if (outcome == SendOutcome::ReceiverNotReady) {
    if (!send.rnr_retries_left)
      send.rnr_retries_left = record.attributes.rnr_retry == 7 ? -1 : record.attributes.rnr_retry;
    int& left = *send.rnr_retries_left;
    if (left == 0) {
      completion.status = WcStatus::RnrRetryExceededError;
    } else {
      if (left > 0) --left;
      uint8_t timer = 1;
      if (QpRecord* target = memory.qp_by_number(record.attributes.dest_qpn)) timer = target->attributes.min_rnr_timer;
      send.next_attempt = Clock::now() + std::chrono::microseconds(rnr_timer_microseconds(timer));
      return false;
    }
  } else if (completion.status == WcStatus::RetryExceededError && record.attributes.timeout != 0) {
    // No responder yet: a real RC requester retransmits for
    // 4.096 us * 2^timeout per try, retry_cnt + 1 tries, before giving up.
    const Clock::time_point attempted_at = Clock::now();
    // The budget starts at the first attempt that found no responder (a
    // send that met RNR first, from a peer that then died, starts it then).
    if (send.give_up == Clock::time_point::max()) {
      double per_try = 4.096e-6 * static_cast<double>(uint64_t{1} << record.attributes.timeout);
      send.give_up = attempted_at + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(per_try * (record.attributes.retry_count + 1)));
    }
    if (attempted_at < send.give_up) {
      send.next_attempt = attempted_at + std::chrono::microseconds(50);
      return false;
    }
  } else if (completion.status == WcStatus::RetryExceededError && record.attributes.timeout == 0) {
    send.next_attempt = Clock::now() + std::chrono::microseconds(50);  // timeout 0: retry forever
    return false;
  }
  if (completion.status != WcStatus::Success) {
    complete_send(memory, qp, completion);
    enter_error_state(memory, qp);
    return true;
  }
  if (send.signaled) complete_send(memory, qp, completion);
  return true;
}

// The device was removed (`softverbs down`): the QP goes to ERR, as on an
// HCA that is gone, and what it had outstanding completes flushed, once.
// Callers hold qp->mutex.
void fail_after_removal(ContextState& state, ProviderQp* qp) {
  if (qp->removal_handled) return;
  qp->removal_handled = true;
  enter_error_state(*state.memory, qp);
  if (qp->over_udp) udp_transport(state)->sync_qp(qp->index);
}

// Retries this QP's deferred sends whose time has come, in order; returns
// when the next one is due.
Clock::time_point progress_qp(DeviceMemory& memory, ProviderQp* qp) {
  std::lock_guard guard(qp->mutex);
  {
    QpRecord& record = record_of(qp);
    SharedLock lock(record.lock);
    if (record.state == QpState::Sqd) return Clock::time_point::max();  // drained: waits for RTS
  }
  if (load_state(record_of(qp)) == QpState::Error) {
    // Moved to ERR by someone else (a peer's failed delivery, the device's
    // removal): what waits completes flushed.
    qp->verbs.qp.state = IBV_QPS_ERR;
    flush_deferred_sends(memory, qp);
    return Clock::time_point::max();
  }
  while (!qp->deferred.empty()) {
    if (Clock::now() < qp->deferred.front().next_attempt) return qp->deferred.front().next_attempt;
    // Out of the queue while it runs: an error flushes what stays queued.
    DeferredSend head = std::move(qp->deferred.front());
    qp->deferred.pop_front();
    count_deferred(qp, -1);
    bind_spans(head);
    if (!attempt_send(memory, qp, head)) {
      qp->deferred.push_front(std::move(head));
      count_deferred(qp, 1);
      bind_spans(qp->deferred.front());
      return qp->deferred.front().next_attempt;
    }
  }
  return Clock::time_point::max();
}

}  // namespace

Clock::time_point progress_deferred_sends(ContextState& state) {
  if (state.memory->removed() && !state.removal_handled.exchange(true)) {
    std::lock_guard guard(state.qps_mutex);
    for (ProviderQp* qp : state.qps) {
      std::lock_guard qp_guard(qp->mutex);
      fail_after_removal(state, qp);
    }
  }
  if (state.deferred_sends.load(std::memory_order_acquire) == 0) return Clock::time_point::max();
  // Holding qps_mutex keeps every QP alive (destroy_qp takes it too).
  std::lock_guard guard(state.qps_mutex);
  if (state.deferred_sends.load(std::memory_order_acquire) == 0) return Clock::time_point::max();
  Clock::time_point earliest = Clock::time_point::max();
  for (ProviderQp* qp : state.qps) earliest = std::min(earliest, progress_qp(*state.memory, qp));
  return earliest;
}

namespace {

// RC and UC QPs on UDP send everything there; a UD QP sends to GIDs that
// are not this device's (or to all, with --transport udp).
bool goes_over_udp(ContextState& state, const QpRecord& record, const ibv_send_wr* wr) {
  if (record.type != QpType::Ud) return true;
  const auto* ah = reinterpret_cast<const ProviderAh*>(wr->wr.ud.ah);
  if (!ah->attr.is_global) return false;
  Gid dgid;
  std::memcpy(dgid.raw.data(), ah->attr.grh.dgid.raw, 16);
  // A group address goes out as IP multicast, and every member on this host
  // as elsewhere gets its copy from the kernel; a group GID of another
  // family than the source (ff0e::ffff:a.b.c.d, RoCE v1's form of an IPv4
  // group, from an IPv4 GID) has no IP form here and reaches local members.
  if (dgid.is_multicast()) {
    Gid source;
    std::memcpy(source.raw.data(), ah->source_gid.raw, 16);
    return wire::is_ipv4_mapped(dgid.raw) == wire::is_ipv4_mapped(source.raw);
  }
  if (state.config.transport == TransportChoice::Udp) return true;
  for (const GidEntry& entry : state.gids)
    if (entry.gid == dgid) return false;
  return true;
}

// The UDP requester's copy of a work request, built in `wqe` (the QP's
// scratch, whose vectors keep their buffers from post to post). Errors an
// HCA finds while executing (lengths, an unroutable address) ride along and
// complete in order.
void to_udp_wqe(ContextState& state, const QpRecord& record, const ibv_send_wr* wr, const DeferredSend& send,
                udp::SendWqe& wqe) {
  const SendRequest& r = send.request;
  std::vector<Sge> sges = std::move(wqe.sges);
  std::vector<uint8_t> inline_bytes = std::move(wqe.inline_bytes);
  sges.clear();
  inline_bytes.clear();
  wqe = udp::SendWqe{};
  wqe.sges = std::move(sges);
  wqe.inline_bytes = std::move(inline_bytes);
  wqe.wr_id = r.wr_id;
  wqe.opcode = r.opcode;
  wqe.flags = r.flags;
  wqe.signaled = send.signaled;
  wqe.imm_data = r.imm_data;
  if (r.flags & IBV_SEND_INLINE) {
    for (const Sge& sge : r.sges) {
      const auto* bytes = reinterpret_cast<const uint8_t*>(sge.address);
      wqe.inline_bytes.insert(wqe.inline_bytes.end(), bytes, bytes + sge.length);
    }
    wqe.length = wqe.inline_bytes.size();
  } else {
    wqe.sges.assign(r.sges.begin(), r.sges.end());
    for (const Sge& sge : r.sges) wqe.length += sge.length;
  }
  wqe.remote_address = r.remote_address;
  wqe.rkey = r.rkey;
  wqe.compare_add = r.compare_add;
  wqe.swap = r.swap;
  if (wqe.length > limits::kMaxMessageSize) wqe.error = WcStatus::LocalLengthError;
  if (send_opcode_info(r.opcode).is(wr_mask::kAtomic) && wqe.length != 8) wqe.error = WcStatus::LocalLengthError;
  if (record.type == QpType::Ud) {
    const auto* ah = reinterpret_cast<const ProviderAh*>(wr->wr.ud.ah);
    wqe.remote_qpn = r.remote_qpn;
    wqe.remote_qkey = r.remote_qkey;
    Gid dgid;
    std::memcpy(dgid.raw.data(), ah->attr.grh.dgid.raw, 16);
    std::string error;
    auto path = udp_transport(state)->resolve_path(ah->attr.grh.sgid_index, dgid, ah->attr.grh.traffic_class,
                                                   ah->attr.grh.hop_limit, ah->attr.grh.flow_label, &error);
    if (path) {
      wqe.ud_path = *path;
    } else {
      debug_log("UD QP %#x wr_id %#llx: %s", record.qpn, static_cast<unsigned long long>(r.wr_id), error.c_str());
      wqe.error = WcStatus::LocalQpOperationError;
    }
    uint32_t mtu = record.attributes.path_mtu != 0 ? mtu_bytes(static_cast<Mtu>(record.attributes.path_mtu)) : 4096;
    if (wqe.length > mtu) wqe.error = WcStatus::LocalLengthError;
  }
}

// Posts under the QP's lock; a deferral is reported in `due` so that the
// progress thread is asked after the lock is released (it takes QP locks).
int post_send_locked(ProviderQp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, Clock::time_point& due) {
  DeviceMemory& memory = memory_of(qp->verbs.qp.context);
  QpRecord& record = record_of(qp);
  for (; wr != nullptr; wr = wr->next) {
    const QpState qp_state = load_state(record);
    if (!can_post_send(qp_state)) {
      *bad_wr = wr;
      return EINVAL;
    }
    DeferredSend send;
    if (int error = translate_send(record, wr, send)) {
      *bad_wr = wr;
      return error;
    }
    if (qp_state == QpState::Error) {
      Completion flushed;
      flushed.wr_id = wr->wr_id;
      flushed.status = WcStatus::WrFlushError;
      flushed.qp_num = record.qpn;
      complete_send(memory, qp, flushed);
      continue;
    }
    if (qp->over_udp && goes_over_udp(state_of(qp->verbs.qp.context), record, wr)) {
      to_udp_wqe(state_of(qp->verbs.qp.context), record, wr, send, qp->udp_wqe);
      if (int error = udp_transport(state_of(qp->verbs.qp.context))->post_send(record.qpn, qp->udp_wqe)) {
        *bad_wr = wr;
        return error;
      }
      continue;
    }
    if (qp_state == QpState::Sqd || !qp->deferred.empty() || !attempt_send(memory, qp, send)) {
      take_ownership(send);
      qp->deferred.push_back(std::move(send));
      count_deferred(qp, 1);
      bind_spans(qp->deferred.back());
      due = std::min(due, qp->deferred.front().next_attempt);
    }
  }
  return 0;
}

int post_send(ibv_qp* ibv, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  ProviderQp* qp = to_qp(ibv);
  Clock::time_point due = Clock::time_point::max();
  int error;
  {
    std::lock_guard guard(qp->mutex);
    if (memory_of(ibv->context).removed()) fail_after_removal(state_of(ibv->context), qp);
    error = post_send_locked(qp, wr, bad_wr, due);
  }
  if (due != Clock::time_point::max()) schedule_progress(due);
  return error;
}

// ---- the extended send API (ibv_wr_*) --------------------------------------
//
// Each ibv_wr_<opcode> call starts a work request from qp_ex->wr_id and
// wr_flags; the ibv_wr_set_* calls complete the last one; ibv_wr_complete
// posts the batch through post_send, so both APIs share every check.

ProviderQp* to_qp(ibv_qp_ex* qp) { return reinterpret_cast<ProviderQp*>(qp); }

ibv_send_wr& begin_request(ibv_qp_ex* ex, ibv_wr_opcode opcode) {
  ProviderQp* qp = to_qp(ex);
  BuiltRequest& built = qp->batch.emplace_back();
  built.wr.wr_id = ex->wr_id;
  built.wr.send_flags = ex->wr_flags;
  built.wr.opcode = opcode;
  return built.wr;
}

BuiltRequest* last_request(ibv_qp_ex* ex) {
  ProviderQp* qp = to_qp(ex);
  if (qp->batch.empty()) {
    qp->batch_error = EINVAL;  // a setter before any ibv_wr_<opcode>
    return nullptr;
  }
  return &qp->batch.back();
}

void wr_send(ibv_qp_ex* ex) { begin_request(ex, IBV_WR_SEND); }
void wr_send_imm(ibv_qp_ex* ex, __be32 imm) { begin_request(ex, IBV_WR_SEND_WITH_IMM).imm_data = imm; }
void wr_rdma_write(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote) {
  begin_request(ex, IBV_WR_RDMA_WRITE).wr.rdma = {remote, rkey};
}
void wr_rdma_write_imm(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote, __be32 imm) {
  ibv_send_wr& wr = begin_request(ex, IBV_WR_RDMA_WRITE_WITH_IMM);
  wr.wr.rdma = {remote, rkey};
  wr.imm_data = imm;
}
void wr_rdma_read(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote) {
  begin_request(ex, IBV_WR_RDMA_READ).wr.rdma = {remote, rkey};
}
void wr_atomic_cmp_swp(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote, uint64_t compare, uint64_t swap) {
  begin_request(ex, IBV_WR_ATOMIC_CMP_AND_SWP).wr.atomic = {remote, compare, swap, rkey};
}
void wr_atomic_fetch_add(ibv_qp_ex* ex, uint32_t rkey, uint64_t remote, uint64_t add) {
  begin_request(ex, IBV_WR_ATOMIC_FETCH_AND_ADD).wr.atomic = {remote, add, 0, rkey};
}
void wr_set_ud_addr(ibv_qp_ex* ex, ibv_ah* ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  if (BuiltRequest* built = last_request(ex)) built->wr.wr.ud = {ah, remote_qpn, remote_qkey};
}
void wr_set_sge(ibv_qp_ex* ex, uint32_t lkey, uint64_t addr, uint32_t length) {
  if (BuiltRequest* built = last_request(ex)) built->sges.assign(1, ibv_sge{addr, length, lkey});
}
void wr_set_sge_list(ibv_qp_ex* ex, size_t count, const ibv_sge* list) {
  if (BuiltRequest* built = last_request(ex)) built->sges.assign(list, list + count);
}
void wr_set_inline_data_list(ibv_qp_ex* ex, size_t count, const ibv_data_buf* buffers) {
  BuiltRequest* built = last_request(ex);
  if (built == nullptr) return;
  built->inline_bytes.clear();
  for (size_t i = 0; i < count; ++i) {
    const auto* bytes = static_cast<const uint8_t*>(buffers[i].addr);
    built->inline_bytes.insert(built->inline_bytes.end(), bytes, bytes + buffers[i].length);
  }
  built->wr.send_flags |= IBV_SEND_INLINE;
}
void wr_set_inline_data(ibv_qp_ex* ex, void* addr, size_t length) {
  ibv_data_buf buffer{addr, length};
  wr_set_inline_data_list(ex, 1, &buffer);
}

void wr_start(ibv_qp_ex* ex) {
  to_qp(ex)->batch.clear();
  to_qp(ex)->batch_error = 0;
}

void wr_abort(ibv_qp_ex* ex) { wr_start(ex); }

int wr_complete(ibv_qp_ex* ex) {
  ProviderQp* qp = to_qp(ex);
  int error = qp->batch_error;
  if (error == 0 && !qp->batch.empty()) {
    for (size_t i = 0; i < qp->batch.size(); ++i) {
      BuiltRequest& built = qp->batch[i];
      if (built.wr.send_flags & IBV_SEND_INLINE)
        built.sges.assign(1, ibv_sge{reinterpret_cast<uint64_t>(built.inline_bytes.data()),
                                     static_cast<uint32_t>(built.inline_bytes.size()), 0});
      built.wr.sg_list = built.sges.data();
      built.wr.num_sge = static_cast<int>(built.sges.size());
      built.wr.next = i + 1 < qp->batch.size() ? &qp->batch[i + 1].wr : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    error = post_send(&qp->verbs.qp, &qp->batch.front().wr, &bad);
  }
  wr_start(ex);
  return error;
}

constexpr uint64_t kSupportedSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE |
                                       IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
                                       IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;

ibv_qp* create_qp_ex(ibv_context* context, ibv_qp_init_attr_ex* attr) {
  constexpr uint32_t kKnownMask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS |
                                  IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_MAX_TSO_HEADER;
  if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || attr->pd == nullptr || attr->pd->context != context) {
    errno = EINVAL;
    return nullptr;
  }
  const uint32_t create_flags = (attr->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) ? attr->create_flags : 0;
  // A UD QP with source QPN 1 is a CM agent: it sends and receives as QP1
  // (cm_routing.h), which is what the rdma_cm shim makes.
  const bool cm_agent = (create_flags & IBV_QP_CREATE_SOURCE_QPN) != 0;
  if (cm_agent && attr->qp_type != IBV_QPT_UD) {
    errno = EINVAL;
    return nullptr;
  }
  // Other creation flags, other source QPNs and TSO are not emulated;
  // asking for none of them is fine.
  if ((attr->comp_mask & ~kKnownMask) || (create_flags & ~uint32_t{IBV_QP_CREATE_SOURCE_QPN}) ||
      (cm_agent && attr->source_qpn != kGsiQpn) ||
      ((attr->comp_mask & IBV_QP_INIT_ATTR_MAX_TSO_HEADER) && attr->max_tso_header != 0) ||
      ((attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) && (attr->send_ops_flags & ~kSupportedSendOps))) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_qp_init_attr basic{};
  basic.qp_context = attr->qp_context;
  basic.send_cq = attr->send_cq;
  basic.recv_cq = attr->recv_cq;
  basic.srq = attr->srq;
  basic.cap = attr->cap;
  basic.qp_type = attr->qp_type;
  basic.sq_sig_all = attr->sq_sig_all;
  ibv_qp* ibv = create_qp(attr->pd, &basic);
  if (ibv == nullptr) return nullptr;
  attr->cap = basic.cap;
  if (cm_agent) {
    QpRecord& record = record_of(to_qp(ibv));
    SharedLock lock(record.lock);
    record.gsi_agent = 1;
  }
  if (attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) {
    ProviderQp* qp = to_qp(ibv);
    constexpr uint32_t kVerbsQpEx = 1u << 1;  // verbs_qp.comp_mask: ibv_qp_to_qp_ex() may hand out qp_ex
    qp->verbs.comp_mask |= kVerbsQpEx;
    ibv_qp_ex& ex = qp->verbs.qp_ex;
    ex.wr_send = wr_send;
    ex.wr_send_imm = wr_send_imm;
    ex.wr_rdma_write = wr_rdma_write;
    ex.wr_rdma_write_imm = wr_rdma_write_imm;
    ex.wr_rdma_read = wr_rdma_read;
    ex.wr_atomic_cmp_swp = wr_atomic_cmp_swp;
    ex.wr_atomic_fetch_add = wr_atomic_fetch_add;
    ex.wr_set_ud_addr = wr_set_ud_addr;
    ex.wr_set_sge = wr_set_sge;
    ex.wr_set_sge_list = wr_set_sge_list;
    ex.wr_set_inline_data = wr_set_inline_data;
    ex.wr_set_inline_data_list = wr_set_inline_data_list;
    ex.wr_start = wr_start;
    ex.wr_complete = wr_complete;
    ex.wr_abort = wr_abort;
  }
  return ibv;
}

// ---- multicast ----------------------------------------------------------------

MulticastTable::Gid to_gid(const ibv_gid* gid) {
  MulticastTable::Gid out;
  std::memcpy(out.data(), gid->raw, 16);
  return out;
}

// The UDP transport that carries a UD QP's multicast to other hosts, or
// nullptr where UD stays in shared memory.
UdpTransport* multicast_transport(ContextState& state) { return ud_over_udp(state) ? udp_transport(state) : nullptr; }

int attach_mcast(ibv_qp* ibv, const ibv_gid* gid, uint16_t) {
  if (gid == nullptr || ibv->qp_type != IBV_QPT_UD) return EINVAL;
  DeviceMemory& memory = memory_of(ibv->context);
  {
    ExclusiveLock lock(memory.shared().memory_lock);
    if (int error = memory.shared().multicast.attach(to_gid(gid), ibv->qp_num)) return error;
  }
  if (UdpTransport* udp = multicast_transport(state_of(ibv->context))) {
    if (int error = udp->join_group(Gid{to_gid(gid)}, ibv->qp_num)) {
      ExclusiveLock lock(memory.shared().memory_lock);
      memory.shared().multicast.detach(to_gid(gid), ibv->qp_num);
      return error;
    }
  }
  return 0;
}

int detach_mcast(ibv_qp* ibv, const ibv_gid* gid, uint16_t) {
  if (gid == nullptr) return EINVAL;
  DeviceMemory& memory = memory_of(ibv->context);
  {
    ExclusiveLock lock(memory.shared().memory_lock);
    if (int error = memory.shared().multicast.detach(to_gid(gid), ibv->qp_num)) return error;
  }
  if (UdpTransport* udp = multicast_transport(state_of(ibv->context))) udp->leave_group(Gid{to_gid(gid)}, ibv->qp_num);
  return 0;
}

}  // namespace

void add_verbs_object_ops(abi::verbs_context_ops& ops) {
  ops.alloc_pd = alloc_pd;
  ops.dealloc_pd = dealloc_pd;
  ops.reg_mr = reg_mr;
  ops.dereg_mr = dereg_mr;
  ops.rereg_mr = rereg_mr;
  ops.create_cq = create_cq;
  ops.create_cq_ex = create_cq_ex;
  ops.destroy_cq = destroy_cq;
  ops.poll_cq = poll_cq;
  ops.req_notify_cq = req_notify_cq;
  ops.resize_cq = resize_cq;
  ops.create_ah = create_ah;
  ops.destroy_ah = destroy_ah;
  ops.create_qp = create_qp;
  ops.create_qp_ex = create_qp_ex;
  ops.modify_qp = modify_qp;
  ops.query_qp = query_qp;
  ops.destroy_qp = destroy_qp;
  ops.post_send = post_send;
  ops.post_recv = post_recv;
  ops.attach_mcast = attach_mcast;
  ops.detach_mcast = detach_mcast;
  ops.create_srq = create_srq;
  ops.modify_srq = modify_srq;
  ops.query_srq = query_srq;
  ops.destroy_srq = destroy_srq;
  ops.post_srq_recv = post_srq_recv;
}

}  // namespace softverbs::provider
