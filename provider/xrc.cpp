// XRC: domains (ibv_open_xrcd, ibv_close_xrcd), XRC SRQs
// (ibv_create_srq_ex, ibv_get_srq_num) and XRC_RECV QPs (ibv_create_qp_ex,
// ibv_open_qp). XRC_SEND QPs are made as other QPs (queue_pairs.cpp).
#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "handle_registry.h"
#include "provider_context.h"
#include "support/process_id.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

// ---- domains -------------------------------------------------------------------

ibv_xrcd* open_xrcd(ibv_context* context, ibv_xrcd_init_attr* init) {
  if (init->comp_mask & ~uint32_t{IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS}) {
    errno = EINVAL;
    return nullptr;
  }
  const int fd = (init->comp_mask & IBV_XRCD_INIT_ATTR_FD) ? init->fd : -1;
  // Only O_CREAT and O_EXCL mean anything; the kernel ignores other bits
  // (O_RDWR, say), and so do we.
  const int oflags = (init->comp_mask & IBV_XRCD_INIT_ATTR_OFLAGS) ? init->oflags : 0;
  std::optional<InodeKey> inode;
  if (fd != -1) {
    struct stat info {};
    if (fstat(fd, &info) != 0) {
      errno = EBADF;
      return nullptr;
    }
    inode = InodeKey{info.st_dev, info.st_ino};
  }
  if (device_removed(context)) return nullptr;
  DeviceMemory& memory = memory_of(context);
  const int process = owner_process_slot(memory);
  if (process < 0) return nullptr;
  XrcDomainOpen opened;
  {
    SharedLock lock(memory.shared().objects_lock);
    opened = memory.shared().xrc_domains.open(inode, oflags, process);
  }
  if (opened.error != 0) {
    errno = opened.error;
    return nullptr;
  }
  auto xrcd = std::make_unique<ProviderXrcd>();
  xrcd->ibv.context = context;
  xrcd->index = opened.index;
  xrcd->id = opened.id;
  return &xrcd.release()->ibv;
}

int close_xrcd(ibv_xrcd* ibv) {
  ProviderXrcd* xrcd = to_xrcd(ibv);
  if (xrcd->users.load(std::memory_order_relaxed) > 0) return EBUSY;
  DeviceMemory& memory = memory_of(ibv->context);
  {
    SharedLock lock(memory.shared().objects_lock);
    memory.shared().xrc_domains.close(xrcd->index, xrcd->id, memory.process_slot());
  }
  std::unique_ptr<ProviderXrcd> owner(xrcd);
  return 0;
}

// ---- SRQs ----------------------------------------------------------------------

ibv_srq* create_srq_ex(ibv_context* context, ibv_srq_init_attr_ex* init) {
  constexpr uint32_t kKnown =
      IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
  const uint32_t mask = init->comp_mask;
  const ibv_srq_type type = (mask & IBV_SRQ_INIT_ATTR_TYPE) ? init->srq_type : IBV_SRQT_BASIC;
  if ((mask & ~kKnown) || (mask & IBV_SRQ_INIT_ATTR_TM) || type == IBV_SRQT_TM) {
    errno = (mask & IBV_SRQ_INIT_ATTR_RESERVED) ? EINVAL : EOPNOTSUPP;  // tag matching is not emulated
    return nullptr;
  }
  ibv_pd* pd = (mask & IBV_SRQ_INIT_ATTR_PD) ? init->pd : nullptr;
  if (pd == nullptr || pd->context != context || (type != IBV_SRQT_BASIC && type != IBV_SRQT_XRC)) {
    errno = EINVAL;
    return nullptr;
  }
  ProviderXrcd* xrcd = nullptr;
  ProviderCq* cq = nullptr;
  if (type == IBV_SRQT_XRC) {
    // An XRC SRQ needs its domain and the CQ its receives complete on.
    if (!(mask & IBV_SRQ_INIT_ATTR_XRCD) || !(mask & IBV_SRQ_INIT_ATTR_CQ) || init->xrcd == nullptr ||
        init->cq == nullptr || init->xrcd->context != context || init->cq->context != context) {
      errno = EINVAL;
      return nullptr;
    }
    xrcd = to_xrcd(init->xrcd);
    cq = to_cq(init->cq);
  }
  ibv_srq_init_attr basic{init->srq_context, init->attr};
  ibv_srq* srq = create_srq_in(pd, &basic, xrcd, cq);
  if (srq != nullptr) init->attr = basic.attr;
  return srq;
}

int get_srq_num(ibv_srq* ibv, uint32_t* srq_num) {
  *srq_num = to_srq(ibv)->verbs.srq_num;
  return 0;
}

// ---- XRC_RECV QPs ------------------------------------------------------------------
//
// The handles of one XRC_RECV QP in the context that made it share its
// DeviceQp, which goes with the last of them; the record's owner handle
// (which its async events name) is one that still lives.

struct SharedRecvQp {
  std::weak_ptr<DeviceQp> device;
  std::vector<ibv_qp*> handles;
};
std::mutex shares_mutex;
std::map<std::pair<const ContextState*, int>, SharedRecvQp> shares;

ProviderQp* new_recv_handle(ibv_context* context, ProviderXrcd* xrcd, void* qp_context, uint32_t qpn) {
  auto qp = std::make_unique<ProviderQp>();
  ibv_qp& ibv = qp->verbs.qp;
  ibv.context = context;
  ibv.qp_context = qp_context;
  ibv.qp_num = qpn;
  ibv.qp_type = IBV_QPT_XRC_RECV;
  ibv.state = IBV_QPS_RESET;
  pthread_mutex_init(&ibv.mutex, nullptr);
  pthread_cond_init(&ibv.cond, nullptr);
  constexpr uint32_t kVerbsQpXrcd = 1u << 0;  // verbs_qp.comp_mask: xrcd is valid
  qp->verbs.comp_mask |= kVerbsQpXrcd;
  qp->verbs.xrcd = &xrcd->ibv;
  qp->xrcd = xrcd;
  qp->qpn = qpn;
  xrcd->users.fetch_add(1, std::memory_order_relaxed);
  return qp.release();
}

void share(ProviderQp* qp) {
  const ContextState* state = &state_of(qp->verbs.qp.context);
  std::lock_guard guard(shares_mutex);
  SharedRecvQp& entry = shares[{state, qp->index}];
  entry.device = qp->device;
  entry.handles.push_back(&qp->verbs.qp);
}

}  // namespace

ibv_qp* create_xrc_recv_qp(ibv_context* context, ibv_qp_init_attr_ex* attr) {
  if (!(attr->comp_mask & IBV_QP_INIT_ATTR_XRCD) || attr->xrcd == nullptr || attr->xrcd->context != context) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(context)) return nullptr;
  ContextState& state = state_of(context);
  ProviderXrcd* xrcd = to_xrcd(attr->xrcd);
  QpSetup setup;
  setup.type = QpType::Rc;
  setup.xrc = XrcRole::Recv;
  setup.xrcd_id = xrcd->id;
  setup.owner_async = state.async_address;
  std::shared_ptr<DeviceQp> device = DeviceQp::create(state, setup);
  if (!device) return nullptr;
  ProviderQp* qp = new_recv_handle(context, xrcd, attr->qp_context, device->qpn());
  qp->device = std::move(device);
  qp->index = qp->device->index();
  qp->verbs.qp.handle = static_cast<uint32_t>(qp->index);
  attr->cap = {};
  qp->device->set_owner_handle(reinterpret_cast<uint64_t>(&qp->verbs.qp));
  share(qp);
  register_handle(HandleKind::Qp, &qp->verbs.qp);
  return &qp->verbs.qp;
}

void release_xrc_recv_handle(ProviderQp* qp) {
  if (qp->xrcd) qp->xrcd->users.fetch_sub(1, std::memory_order_relaxed);
  if (!qp->device) return;
  std::lock_guard guard(shares_mutex);
  auto entry = shares.find({&state_of(qp->verbs.qp.context), qp->index});
  if (entry == shares.end()) return;
  std::erase(entry->second.handles, &qp->verbs.qp);
  if (entry->second.handles.empty())
    shares.erase(entry);
  else
    qp->device->set_owner_handle(reinterpret_cast<uint64_t>(entry->second.handles.front()));
}

namespace {

ibv_qp* open_qp(ibv_context* context, ibv_qp_open_attr* attr) {
  constexpr uint32_t kRequired = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  if ((attr->comp_mask & kRequired) != kRequired || (attr->comp_mask & ~(kRequired | IBV_QP_OPEN_ATTR_CONTEXT)) ||
      attr->qp_type != IBV_QPT_XRC_RECV || attr->xrcd == nullptr || attr->xrcd->context != context) {
    errno = EINVAL;
    return nullptr;
  }
  ProviderXrcd* xrcd = to_xrcd(attr->xrcd);
  DeviceMemory& memory = memory_of(context);
  int index;
  {
    // Only an XRC_RECV QP of the same domain, as the kernel finds it in
    // the domain's list.
    QpRecord* record = memory.qp_by_number(attr->qp_num);
    if (record == nullptr) {
      errno = EINVAL;
      return nullptr;
    }
    SharedLock lock(record->lock);
    if (!record->live || record->qpn != attr->qp_num || record->xrc != XrcRole::Recv || record->xrcd_id != xrcd->id) {
      errno = EINVAL;
      return nullptr;
    }
    index = static_cast<int>(record - memory.shared().qps);
  }
  void* qp_context = (attr->comp_mask & IBV_QP_OPEN_ATTR_CONTEXT) ? attr->qp_context : nullptr;
  ProviderQp* qp = new_recv_handle(context, xrcd, qp_context, attr->qp_num);
  qp->index = index;
  qp->verbs.qp.handle = static_cast<uint32_t>(index);
  {
    std::lock_guard guard(shares_mutex);
    if (auto entry = shares.find({&state_of(context), index}); entry != shares.end()) {
      qp->device = entry->second.device.lock();
      if (qp->device && qp->device->qpn() != attr->qp_num) qp->device.reset();
      if (qp->device) entry->second.handles.push_back(&qp->verbs.qp);
    }
  }
  register_handle(HandleKind::Qp, &qp->verbs.qp);
  return &qp->verbs.qp;
}

}  // namespace

void add_xrc_ops(abi::verbs_context_ops& ops) {
  ops.open_xrcd = open_xrcd;
  ops.close_xrcd = close_xrcd;
  ops.create_srq_ex = create_srq_ex;
  ops.get_srq_num = get_srq_num;
  ops.open_qp = open_qp;
}

}  // namespace softverbs::provider
