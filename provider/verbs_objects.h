// The provider's verbs objects: libibverbs' structures with what the
// provider keeps beside them. Each op translates them into the emulator's
// and back; the device's semantics live in emulator/.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "device/work_request.h"
#include "provider_context.h"
#include "support/process_id.h"
#include "verbs/device_qp.h"

namespace softverbs::provider {

namespace check {
struct QpTracker;
}

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

inline ContextState& state_of(ibv_context* context) { return *to_provider(context)->state; }
inline DeviceMemory& memory_of(ibv_context* context) { return *state_of(context).memory; }

template <typename T, typename Member>
inline T* container_of(Member* member, Member T::*field) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(member) -
                              reinterpret_cast<std::ptrdiff_t>(&(static_cast<T*>(nullptr)->*field)));
}

// ---- protection domains

struct ProviderTd {
  ibv_td ibv{};
  std::atomic<int> users{0};  // parent domains made with it: EBUSY to ibv_dealloc_td
};

inline ProviderTd* to_td(ibv_td* td) { return reinterpret_cast<ProviderTd*>(td); }

struct ProviderPd {
  ibv_pd ibv{};
  // MRs, QPs, SRQs and AHs made in it: an HCA refuses to free a PD that
  // still has any (EBUSY), and the PD stays usable.
  std::atomic<int> users{0};
  // A parent domain (ibv_alloc_parent_domain) stands for `protection_domain`,
  // whose handle it carries, so that what is made in either meets the same
  // key checks; it may name a thread domain and the application's
  // allocator for the QPs, CQs and SRQs made in it.
  ibv_pd* protection_domain = nullptr;
  ProviderTd* td = nullptr;
  void* (*alloc)(ibv_pd*, void*, size_t, size_t, uint64_t) = nullptr;
  void (*free)(ibv_pd*, void*, void*, uint64_t) = nullptr;
  void* pd_context = nullptr;

  bool is_parent_domain() const { return protection_domain != nullptr; }
};

inline ProviderPd* to_pd(ibv_pd* pd) { return reinterpret_cast<ProviderPd*>(pd); }
inline void use_pd(ibv_pd* pd) { to_pd(pd)->users.fetch_add(1, std::memory_order_relaxed); }
inline void unuse_pd(ibv_pd* pd) { to_pd(pd)->users.fetch_sub(1, std::memory_order_relaxed); }

// ---- where a QP's, CQ's or SRQ's provider object lives
//
// In the memory of the allocator of the parent domain it was made in, when
// that domain has one and the allocator does not answer
// IBV_ALLOCATOR_USE_DEFAULT; else in the provider's own. (Its queues are
// rings in device memory that peers reach: those stay there.) The resource
// types the allocator is told are mlx5dv's numbers.
enum class DomainResource : uint64_t { Qp = 1, Srq = 4, Cq = 5 };

struct ObjectStorage {
  ibv_pd* domain = nullptr;  // the parent domain whose allocator gave the memory; nullptr: ours
  DomainResource resource = DomainResource::Qp;
};

// Memory for a T (value-initialized) from `domain`'s allocator if it has
// one, else from ours; nullptr (errno ENOMEM) if the allocator has none.
// The object records where it lives in its `storage` member.
template <typename T>
T* new_provider_object(ibv_pd* domain, DomainResource resource) {
  ProviderPd* parent = domain ? to_pd(domain) : nullptr;
  if (parent && parent->alloc) {
    constexpr size_t kAlignment = alignof(T) > 64 ? alignof(T) : 64;
    void* memory = parent->alloc(domain, parent->pd_context, sizeof(T), kAlignment, static_cast<uint64_t>(resource));
    if (memory == nullptr) {
      errno = ENOMEM;
      return nullptr;
    }
    if (memory != IBV_ALLOCATOR_USE_DEFAULT) {
      T* object = std::construct_at(static_cast<T*>(memory));
      object->storage = {domain, resource};
      use_pd(domain);  // the domain holds the allocator that frees it
      return object;
    }
  }
  T* object = new T();
  object->storage = {nullptr, resource};
  return object;
}

// Destroys an object made by new_provider_object and gives its memory back
// to where it came from.
template <typename T>
void delete_provider_object(T* object) {
  const ObjectStorage storage = object->storage;
  if (storage.domain == nullptr) {
    delete object;
    return;
  }
  std::destroy_at(object);
  ProviderPd* parent = to_pd(storage.domain);
  parent->free(storage.domain, parent->pd_context, object, static_cast<uint64_t>(storage.resource));
  unuse_pd(storage.domain);
}

// unique_ptr's deleter for them, while one is being made.
struct ProviderObjectDelete {
  template <typename T>
  void operator()(T* object) const {
    delete_provider_object(object);
  }
};
template <typename T>
using ProviderObject = std::unique_ptr<T, ProviderObjectDelete>;

// Verbs that create objects fail with EIO once the device is gone, as
// those of a removed HCA do.
inline bool device_removed(ibv_context* context) {
  if (!memory_of(context).removed()) return false;
  errno = EIO;
  return true;
}

// This process's record in the device's process table, which the device
// objects a verb makes name as their owner: -1 with errno ENOMEM when the
// table is full.
inline int owner_process_slot(DeviceMemory& memory) {
  const int process = memory.process_slot();
  if (process < 0) errno = ENOMEM;
  return process;
}

// Whether the region or window `key` names was made by another process: in
// a forked child, its parent's, which the child's deregistration leaves be.
inline bool made_elsewhere(DeviceMemory& memory, uint32_t key) {
  MemoryReadLock lock(memory);
  const std::optional<MemoryRegion> found = memory.shared().mrs.find(key);
  return found && !made_by_this_process(found->owner_pid);
}

// ---- completion queues

struct ProviderCq {
  abi::verbs_cq verbs{};
  ObjectStorage storage;
  ibv_pd* parent_domain = nullptr;  // ibv_cq_init_attr_ex.parent_domain, held while the CQ lives
  int index = -1;
  int qp_references = 0;  // under the context's qps_mutex
  Completion current;     // the entry an extended poll is positioned on
  // Where the ring's slots are, for polls: the record's copy is on the
  // producers' cache line. Under the ring's poll lock.
  uint64_t slots_offset = 0;
  std::atomic<bool> overrun_reported{false};  // check mode: its overrun was reported (checker/cq_overrun.h)
};

inline ProviderCq* to_cq(ibv_cq* cq) { return reinterpret_cast<ProviderCq*>(cq); }
inline ProviderCq* to_cq(ibv_cq_ex* cq) { return reinterpret_cast<ProviderCq*>(cq); }

// ---- address handles

struct ProviderAh {
  ibv_ah ibv{};
  ibv_ah_attr attr{};
  ibv_gid source_gid{};
};

// ---- XRC domains

struct ProviderXrcd {
  ibv_xrcd ibv{};
  int index = -1;   // in the device's XrcDomainTable
  uint32_t id = 0;  // the domain's id, which its SRQs and QPs carry
  // XRC SRQs and XRC_RECV QPs made or opened through this handle: closing
  // it is EBUSY while it has any, as the kernel's uverbs says.
  std::atomic<int> users{0};
};

inline ProviderXrcd* to_xrcd(ibv_xrcd* xrcd) { return reinterpret_cast<ProviderXrcd*>(xrcd); }

// ---- shared receive queues

struct ProviderSrq {
  abi::verbs_srq verbs{};
  ObjectStorage storage;
  int index = -1;
  int qp_references = 0;  // under the context's qps_mutex
  // An XRC SRQ: its domain handle and the CQ its receives complete on.
  ProviderXrcd* xrcd = nullptr;
  ProviderCq* cq = nullptr;
};

inline ProviderSrq* to_srq(ibv_srq* srq) { return reinterpret_cast<ProviderSrq*>(srq); }
// A basic SRQ, or with `xrcd` and `cq` an XRC one (shared_receive_queues.cpp).
ibv_srq* create_srq_in(ibv_pd* pd, ibv_srq_init_attr* init, ProviderXrcd* xrcd, ProviderCq* cq);
inline SrqRecord& record_of(ProviderSrq* srq) { return memory_of(srq->verbs.srq.context).shared().srqs[srq->index]; }

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
  if (UdpTransport* udp = state_of(context).udp_if_running()) udp->receive_posted();
  return error;
}

// ---- queue pairs

// A work request built with the ibv_wr_* calls, posted at ibv_wr_complete.
struct BuiltRequest {
  ibv_send_wr wr{};
  const void* call_site = nullptr;  // the ibv_wr_<opcode> call's, for the verbs checker
  std::vector<ibv_sge> sges;
  std::vector<uint8_t> inline_bytes;
};

struct ProviderQp {
  abi::verbs_qp verbs{};
  ObjectStorage storage;
  int index = -1;
  ProviderCq* send_cq = nullptr;
  ProviderCq* recv_cq = nullptr;
  ProviderSrq* srq = nullptr;
  std::vector<BuiltRequest> batch;  // between ibv_wr_start and ibv_wr_complete
  int batch_error = 0;
  // Made once the QP's record is set up. Shared by the handles of one
  // XRC_RECV QP in its creator's context (ibv_open_qp's); null in a handle
  // opened in another process, which can query the QP but not modify it.
  std::shared_ptr<DeviceQp> device;
  ProviderXrcd* xrcd = nullptr;  // XRC_RECV: the domain handle it was made or opened through
  uint32_t qpn = 0;
  uint8_t reported_access_rules = 0;                // check mode: the rules reported (checker/access_rules.cpp)
  std::atomic<check::QpTracker*> checker{nullptr};  // check mode: its work requests (checker/work_checks.cpp)
};

inline ProviderQp* to_qp(ibv_qp* qp) { return reinterpret_cast<ProviderQp*>(qp); }

inline QpRecord& record_of(ProviderQp* qp) { return memory_of(qp->verbs.qp.context).shared().qps[qp->index]; }

ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr);
// XRC: ibv_create_qp_ex's XRC_RECV QPs (xrc.cpp); the ibv_qp of a new
// provider QP whose device part is made (queue_pairs.cpp).
ibv_qp* create_xrc_recv_qp(ibv_context* context, ibv_qp_init_attr_ex* attr);
void init_ibv_qp(ibv_qp& ibv, ibv_context* context, ibv_pd* pd, const ibv_qp_init_attr& attr, const DeviceQp& device);
// Forgets an XRC_RECV handle (xrc.cpp), at its destroy.
void release_xrc_recv_handle(ProviderQp* qp);
int post_send(ibv_qp* ibv, ibv_send_wr* wr, ibv_send_wr** bad_wr);
// Which verb posts: ibv_post_send, or ibv_bind_mw (the one way to bind a
// type 1 window; a BIND_MW work request binds type 2 windows only).
enum class SendVerb : uint8_t { PostSend, BindMw };
// `call_site`: the application's call of the verb, or per request those of
// `built` (ibv_wr_complete's batch), for the verbs checker's reports.
int post_send_requests(ibv_qp* ibv, ibv_send_wr* wr, ibv_send_wr** bad_wr, SendVerb verb,
                       const void* call_site = nullptr, const BuiltRequest* built = nullptr);
// The ibv_wr_* entries of a QP made with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.
ibv_qp* create_qp_ex(ibv_context* context, ibv_qp_init_attr_ex* attr);

// Each unit fills its entries of the ops table.
void add_memory_ops(abi::verbs_context_ops& ops);
void add_memory_window_ops(abi::verbs_context_ops& ops);
void add_completion_queue_ops(abi::verbs_context_ops& ops);
void add_address_handle_ops(abi::verbs_context_ops& ops);
void add_shared_receive_queue_ops(abi::verbs_context_ops& ops);
void add_queue_pair_ops(abi::verbs_context_ops& ops);
void add_xrc_ops(abi::verbs_context_ops& ops);
void add_on_demand_paging_ops(abi::verbs_context_ops& ops);
void add_device_memory_ops(abi::verbs_context_ops& ops);
void add_domain_ops(abi::verbs_context_ops& ops);
// ibv_dealloc_pd of a parent domain: lets go of its PD and thread domain.
void release_parent_domain(ProviderPd& domain);

}  // namespace softverbs::provider
