// Memory windows: ibv_alloc_mw, ibv_dealloc_mw and ibv_bind_mw (type 1).
// A bind of either type is a send work request the device executes in
// queue order (see emulator/device/memory_window.h).
#include <unistd.h>

#include <cerrno>
#include <memory>

#include "provider_context.h"
#include "udp/transport.h"
#include "verbs_objects.h"

namespace softverbs::provider {

namespace {

ibv_mw* alloc_mw(ibv_pd* pd, ibv_mw_type type) {
  if (type != IBV_MW_TYPE_1 && type != IBV_MW_TYPE_2) {
    errno = EINVAL;
    return nullptr;
  }
  if (device_removed(pd->context)) return nullptr;
  DeviceMemory& memory = memory_of(pd->context);
  const int process = owner_process_slot(memory);
  if (process < 0) return nullptr;
  std::optional<uint32_t> key;
  {
    ExclusiveLock lock(memory.shared().memory_lock);
    key = memory.shared().mrs.allocate_window(pd->handle, getpid(), process, static_cast<uint8_t>(type));
  }
  if (!key) {
    errno = ENOMEM;
    return nullptr;
  }
  auto mw = std::make_unique<ibv_mw>();
  mw->context = pd->context;
  mw->pd = pd;
  mw->rkey = *key;
  mw->handle = *key;  // the window's identity; its rkey's low 8 bits change with binds
  mw->type = type;
  use_pd(pd);
  return mw.release();
}

int dealloc_mw(ibv_mw* mw) {
  DeviceMemory& memory = memory_of(mw->context);
  bool removed = false;
  // A window a forked child inherited stays its maker's.
  const bool inherited = made_elsewhere(memory, mw->handle);
  // The UDP engines of this process use the window's range without the
  // table's lock: they are held off while it goes.
  if (!inherited)
    UdpTransport::hold_data_paths(memory, [&] {
      ExclusiveLock lock(memory.shared().memory_lock);
      removed = memory.shared().mrs.deallocate_window(mw->handle);
    });
  if (!removed && !inherited) return EINVAL;
  unuse_pd(mw->pd);
  std::unique_ptr<ibv_mw> owner(mw);
  return 0;
}

// ibv_bind_mw: libibverbs has checked the type (1) and the MR's PD. The
// window's rkey gets the next value of its low 8 bits now, as rxe does (an
// application that gets an IBV_WC_MW_BIND_ERR undoes it).
int bind_mw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* bind) {
  if (bind->bind_info.mw_access_flags & IBV_ACCESS_ZERO_BASED) return EINVAL;
  ibv_send_wr wr{};
  wr.wr_id = bind->wr_id;
  wr.send_flags = bind->send_flags;
  wr.opcode = IBV_WR_BIND_MW;
  wr.bind_mw.mw = mw;
  wr.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
  wr.bind_mw.bind_info = bind->bind_info;
  ibv_send_wr* bad = nullptr;
  if (int error = post_send_requests(qp, &wr, &bad, SendVerb::BindMw)) return error;
  mw->rkey = wr.bind_mw.rkey;
  return 0;
}

}  // namespace

void add_memory_window_ops(abi::verbs_context_ops& ops) {
  ops.alloc_mw = alloc_mw;
  ops.dealloc_mw = dealloc_mw;
  ops.bind_mw = bind_mw;
}

}  // namespace softverbs::provider
