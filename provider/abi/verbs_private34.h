// Our own declaration of the parts of libibverbs' private provider ABI
// (symbol version IBVERBS_PRIVATE_34) that softverbs uses. rdma-core does not
// install its driver.h; these layouts are written from the documented ABI of
// rdma-core v38..v56 (Debian 12 ships v44), which all export PABI 34 with the
// same structures. The static_asserts at the bottom pin sizes and offsets; a
// test loads the provider into the installed libibverbs to prove them.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>

namespace softverbs::abi {

// How a provider's match table entry is compared with a sysfs device.
enum MatchKind : uint8_t {
  kMatchSentinel = 0,
  kMatchPci = 1,
  kMatchModalias = 2,
  kMatchDriverId = 3,
};

struct verbs_match_ent {
  void* driver_data;
  union {
    const char* modalias;
    uint64_t driver_id;
  } u;
  uint16_t vendor;
  uint16_t device;
  uint8_t kind;
};

// libibverbs' description of a device found in sysfs; opaque to us.
struct verbs_sysfs_dev;
struct verbs_context_ops;
struct verbs_device;

struct verbs_device_ops {
  const char* name;
  uint32_t match_min_abi_version;
  uint32_t match_max_abi_version;
  const verbs_match_ent* match_table;
  const verbs_device_ops** static_providers;
  bool (*match_device)(verbs_sysfs_dev* sysfs_dev);
  verbs_context* (*alloc_context)(ibv_device* device, int cmd_fd, void* private_data);
  verbs_context* (*import_context)(ibv_device* device, int cmd_fd);
  verbs_device* (*alloc_device)(verbs_sysfs_dev* sysfs_dev);
  void (*uninit_device)(verbs_device* device);
};

// ccan's intrusive list node, as embedded in verbs_device.
struct list_node {
  list_node* next;
  list_node* prev;
};

struct verbs_device {
  ibv_device device;  // must be first: libibverbs casts between the two
  const verbs_device_ops* ops;
  int refcount;  // atomic_int in C; touched only by libibverbs
  list_node entry;
  verbs_sysfs_dev* sysfs;
  uint64_t core_support;
};

enum MrType : int {
  kMrTypeMr = 0,
  kMrTypeNullMr = 1,
  kMrTypeImportedMr = 2,
  kMrTypeDmabufMr = 3,
};

// ibv_dereg_mr reads mr_type and access through container_of(mr, verbs_mr,
// ibv_mr), so every MR the provider returns must be embedded in one.
struct verbs_mr {
  ::ibv_mr ibv_mr;  // named as in rdma-core
  MrType mr_type;
  int access;
};

struct verbs_qp {
  union {
    ibv_qp qp;
    ibv_qp_ex qp_ex;
  };
  uint32_t comp_mask;
  void* xrcd;
};

struct verbs_cq {
  union {
    ibv_cq cq;
    ibv_cq_ex cq_ex;
  };
};

struct verbs_srq {
  ibv_srq srq;
  int srq_type;  // enum ibv_srq_type
  void* xrcd;
  ibv_cq* cq;
  uint32_t srq_num;
};

// The provider's operations, 76 entries in alphabetical order (rdma-core
// v38..v57). libibverbs copies the non-null ones over its defaults, which
// answer EOPNOTSUPP.
struct verbs_context_ops {
  int (*advise_mr)(ibv_pd*, ibv_advise_mr_advice, uint32_t flags, ibv_sge*, uint32_t num_sges);
  ibv_dm* (*alloc_dm)(ibv_context*, ibv_alloc_dm_attr*);
  ibv_mw* (*alloc_mw)(ibv_pd*, ibv_mw_type);
  ibv_mr* (*alloc_null_mr)(ibv_pd*);
  ibv_pd* (*alloc_parent_domain)(ibv_context*, ibv_parent_domain_init_attr*);
  ibv_pd* (*alloc_pd)(ibv_context*);
  ibv_td* (*alloc_td)(ibv_context*, ibv_td_init_attr*);
  void (*async_event)(ibv_context*, ibv_async_event*);
  int (*attach_counters_point_flow)(ibv_counters*, ibv_counter_attach_attr*, ibv_flow*);
  int (*attach_mcast)(ibv_qp*, const ibv_gid*, uint16_t lid);
  int (*bind_mw)(ibv_qp*, ibv_mw*, ibv_mw_bind*);
  int (*close_xrcd)(ibv_xrcd*);
  void (*cq_event)(ibv_cq*);
  ibv_ah* (*create_ah)(ibv_pd*, ibv_ah_attr*);
  ibv_counters* (*create_counters)(ibv_context*, ibv_counters_init_attr*);
  ibv_cq* (*create_cq)(ibv_context*, int cqe, ibv_comp_channel*, int comp_vector);
  ibv_cq_ex* (*create_cq_ex)(ibv_context*, ibv_cq_init_attr_ex*);
  ibv_flow* (*create_flow)(ibv_qp*, ibv_flow_attr*);
  ibv_flow_action* (*create_flow_action_esp)(ibv_context*, ibv_flow_action_esp_attr*);
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*);
  ibv_qp* (*create_qp_ex)(ibv_context*, ibv_qp_init_attr_ex*);
  ibv_rwq_ind_table* (*create_rwq_ind_table)(ibv_context*, ibv_rwq_ind_table_init_attr*);
  ibv_srq* (*create_srq)(ibv_pd*, ibv_srq_init_attr*);
  ibv_srq* (*create_srq_ex)(ibv_context*, ibv_srq_init_attr_ex*);
  ibv_wq* (*create_wq)(ibv_context*, ibv_wq_init_attr*);
  int (*dealloc_mw)(ibv_mw*);
  int (*dealloc_pd)(ibv_pd*);
  int (*dealloc_td)(ibv_td*);
  int (*dereg_mr)(verbs_mr*);
  int (*destroy_ah)(ibv_ah*);
  int (*destroy_counters)(ibv_counters*);
  int (*destroy_cq)(ibv_cq*);
  int (*destroy_flow)(ibv_flow*);
  int (*destroy_flow_action)(ibv_flow_action*);
  int (*destroy_qp)(ibv_qp*);
  int (*destroy_rwq_ind_table)(ibv_rwq_ind_table*);
  int (*destroy_srq)(ibv_srq*);
  int (*destroy_wq)(ibv_wq*);
  int (*detach_mcast)(ibv_qp*, const ibv_gid*, uint16_t lid);
  void (*free_context)(ibv_context*);
  int (*free_dm)(ibv_dm*);
  int (*get_srq_num)(ibv_srq*, uint32_t* srq_num);
  ibv_dm* (*import_dm)(ibv_context*, uint32_t dm_handle);
  ibv_mr* (*import_mr)(ibv_pd*, uint32_t mr_handle);
  ibv_pd* (*import_pd)(ibv_context*, uint32_t pd_handle);
  int (*modify_cq)(ibv_cq*, ibv_modify_cq_attr*);
  int (*modify_flow_action_esp)(ibv_flow_action*, ibv_flow_action_esp_attr*);
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int attr_mask);
  int (*modify_qp_rate_limit)(ibv_qp*, ibv_qp_rate_limit_attr*);
  int (*modify_srq)(ibv_srq*, ibv_srq_attr*, int attr_mask);
  int (*modify_wq)(ibv_wq*, ibv_wq_attr*);
  ibv_qp* (*open_qp)(ibv_context*, ibv_qp_open_attr*);
  ibv_xrcd* (*open_xrcd)(ibv_context*, ibv_xrcd_init_attr*);
  int (*poll_cq)(ibv_cq*, int num_entries, ibv_wc*);
  int (*post_recv)(ibv_qp*, ibv_recv_wr*, ibv_recv_wr** bad_wr);
  int (*post_send)(ibv_qp*, ibv_send_wr*, ibv_send_wr** bad_wr);
  int (*post_srq_ops)(ibv_srq*, ibv_ops_wr*, ibv_ops_wr** bad_op);
  int (*post_srq_recv)(ibv_srq*, ibv_recv_wr*, ibv_recv_wr** bad_wr);
  int (*query_device_ex)(ibv_context*, const ibv_query_device_ex_input*, ibv_device_attr_ex*, size_t attr_size);
  int (*query_ece)(ibv_qp*, ibv_ece*);
  int (*query_port)(ibv_context*, uint8_t port_num, ibv_port_attr*);
  int (*query_qp)(ibv_qp*, ibv_qp_attr*, int attr_mask, ibv_qp_init_attr*);
  int (*query_qp_data_in_order)(ibv_qp*, ibv_wr_opcode, uint32_t flags);
  int (*query_rt_values)(ibv_context*, ibv_values_ex*);
  int (*query_srq)(ibv_srq*, ibv_srq_attr*);
  int (*read_counters)(ibv_counters*, uint64_t* values, uint32_t count, uint32_t flags);
  ibv_mr* (*reg_dm_mr)(ibv_pd*, ibv_dm*, uint64_t dm_offset, size_t length, unsigned int access);
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t offset, size_t length, uint64_t iova, int fd, int access);
  ibv_mr* (*reg_mr)(ibv_pd*, void* addr, size_t length, uint64_t hca_va, int access);
  int (*req_notify_cq)(ibv_cq*, int solicited_only);
  int (*rereg_mr)(verbs_mr*, int flags, ibv_pd*, void* addr, size_t length, int access);
  int (*resize_cq)(ibv_cq*, int cqe);
  int (*set_ece)(ibv_qp*, ibv_ece*);
  void (*unimport_dm)(ibv_dm*);
  void (*unimport_mr)(ibv_mr*);
  void (*unimport_pd)(ibv_pd*);
};

// ---- layout checks (x86-64 / aarch64 LP64) --------------------------------
static_assert(sizeof(void*) == 8, "the layouts below are for LP64 targets");
static_assert(sizeof(verbs_match_ent) == 24);
static_assert(offsetof(verbs_match_ent, u) == 8);
static_assert(offsetof(verbs_match_ent, kind) == 20);
static_assert(sizeof(verbs_device_ops) == 72);
static_assert(offsetof(verbs_device_ops, match_table) == 16);
static_assert(offsetof(verbs_device_ops, match_device) == 32);
static_assert(offsetof(verbs_device_ops, alloc_context) == 40);
static_assert(offsetof(verbs_device_ops, alloc_device) == 56);
static_assert(offsetof(verbs_device_ops, uninit_device) == 64);
static_assert(sizeof(ibv_device) == 664);
static_assert(offsetof(verbs_device, device) == 0);
static_assert(offsetof(verbs_device, ops) == 664);
static_assert(offsetof(verbs_device, refcount) == 672);
static_assert(offsetof(verbs_device, entry) == 680);
static_assert(offsetof(verbs_device, sysfs) == 696);
static_assert(offsetof(verbs_device, core_support) == 704);
static_assert(sizeof(verbs_device) == 712);
static_assert(sizeof(verbs_context_ops) == 76 * sizeof(void*));
static_assert(offsetof(verbs_context_ops, free_context) == 39 * sizeof(void*));
static_assert(offsetof(verbs_context_ops, poll_cq) == 53 * sizeof(void*));
static_assert(offsetof(verbs_context_ops, query_device_ex) == 58 * sizeof(void*));
static_assert(offsetof(verbs_context_ops, query_port) == 60 * sizeof(void*));
static_assert(offsetof(verbs_context_ops, unimport_pd) == 75 * sizeof(void*));
static_assert(sizeof(ibv_mr) == 48);
static_assert(offsetof(verbs_mr, mr_type) == 48);
static_assert(offsetof(verbs_mr, access) == 52);
static_assert(sizeof(verbs_mr) == 56);
static_assert(offsetof(verbs_qp, comp_mask) == sizeof(ibv_qp_ex));
static_assert(offsetof(verbs_qp, xrcd) == sizeof(ibv_qp_ex) + 8);
static_assert(offsetof(verbs_srq, srq_type) == sizeof(ibv_srq));
static_assert(offsetof(verbs_srq, srq_num) == sizeof(ibv_srq) + 24);
// libibverbs finds the ibv_context inside the provider's verbs_context.
static_assert(offsetof(verbs_context, context) + sizeof(ibv_context) == sizeof(verbs_context));

}  // namespace softverbs::abi

// Entry points of libibverbs' private ABI (IBVERBS_PRIVATE_34).
extern "C" {
void verbs_register_driver_34(const softverbs::abi::verbs_device_ops* ops);
void* _verbs_init_and_alloc_context(ibv_device* device, int cmd_fd, size_t alloc_size, verbs_context* context_offset,
                                    uint32_t driver_id);
void verbs_uninit_context(verbs_context* context);
void verbs_set_ops(verbs_context* context, const softverbs::abi::verbs_context_ops* ops);
}
