// Memory footprint of QPs and MRs: creates many through the installed
// libibverbs (started under `softverbs run`) and reports the growth of the
// process's resident memory per object, the device memory it touches
// included. Then the time ibv_reg_mr takes for a large buffer, never written
// and written, against first writes and a copy into fresh memory in the same
// process. Usage: footprint [COUNT]
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

long resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  return -1;
}

constexpr size_t kRegisteredBytes = 64u << 20;

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

char* fresh_pages() {
  void* p = mmap(nullptr, kRegisteredBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

// The median of three: ibv_reg_mr of kRegisteredBytes of fresh pages,
// `written` first or not (a pool registered before use). -1 on a failure.
double registration_ms(ibv_pd* pd, bool written) {
  std::vector<double> runs;
  for (int i = 0; i < 3; ++i) {
    char* pages = fresh_pages();
    if (pages == nullptr) return -1;
    if (written) std::memset(pages, 0x5a, kRegisteredBytes);
    const auto start = std::chrono::steady_clock::now();
    ibv_mr* mr = ibv_reg_mr(pd, pages, kRegisteredBytes,
                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    runs.push_back(milliseconds_since(start));
    if (mr != nullptr) ibv_dereg_mr(mr);
    munmap(pages, kRegisteredBytes);
    if (mr == nullptr) return -1;
  }
  std::sort(runs.begin(), runs.end());
  return runs[1];
}

// The median of three: what fresh pages cost to write (`copy` false; the
// least an HCA's pinning of untouched pages does is fault them in) or to copy
// kRegisteredBytes into.
double fresh_memory_ms(bool copy) {
  std::vector<char> source(kRegisteredBytes, 0x33);
  std::vector<double> runs;
  for (int i = 0; i < 3; ++i) {
    char* pages = fresh_pages();
    if (pages == nullptr) return -1;
    const auto start = std::chrono::steady_clock::now();
    if (copy)
      std::memcpy(pages, source.data(), kRegisteredBytes);
    else
      std::memset(pages, 0x5a, kRegisteredBytes);
    runs.push_back(milliseconds_since(start));
    munmap(pages, kRegisteredBytes);
  }
  std::sort(runs.begin(), runs.end());
  return runs[1];
}

}  // namespace

int main(int argc, char** argv) {
  const int count = argc > 1 ? std::atoi(argv[1]) : 1000;
  int devices = 0;
  ibv_device** list = ibv_get_device_list(&devices);
  ibv_context* context = nullptr;
  const long before_open = resident_kib();
  for (int i = 0; list && i < devices; ++i)
    if (std::strncmp(ibv_get_device_name(list[i]), "softverbs", 9) == 0) context = ibv_open_device(list[i]);
  const long after_open = resident_kib();
  if (context == nullptr) {
    std::fprintf(stderr, "footprint: no softverbs device\n");
    return 1;
  }
  ibv_pd* pd = ibv_alloc_pd(context);
  ibv_cq* cq = ibv_create_cq(context, 256, nullptr, nullptr, 0);
  // One QP first, so that one-time costs (mappings, threads) are not counted.
  std::vector<ibv_qp*> qps;
  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.cap = {128, 128, 1, 1, 64};  // ibv_rc_pingpong's shape, a little deeper
  qps.push_back(ibv_create_qp(pd, &init));
  long before = resident_kib();
  for (int i = 0; i < count; ++i) {
    ibv_qp* qp = ibv_create_qp(pd, &init);
    if (qp == nullptr) {
      std::fprintf(stderr, "footprint: QP %d: %s\n", i, std::strerror(errno));
      return 1;
    }
    qps.push_back(qp);
  }
  long after_qps = resident_kib();
  std::vector<char> buffer(static_cast<size_t>(count) * 64);
  std::vector<ibv_mr*> mrs;
  mrs.push_back(ibv_reg_mr(pd, buffer.data(), 64, IBV_ACCESS_LOCAL_WRITE));
  long before_mrs = resident_kib();
  for (int i = 1; i < count; ++i) mrs.push_back(ibv_reg_mr(pd, buffer.data() + i * 64, 64, IBV_ACCESS_LOCAL_WRITE));
  long after_mrs = resident_kib();
  std::printf("footprint_qp_bytes value=%.0f (RC QP, 128 send and 128 receive WRs, %d QPs)\n",
              (after_qps - before) * 1024.0 / count, count);
  std::printf("footprint_open_kib value=%ld (ibv_open_device)\n", after_open - before_open);
  std::printf("footprint_mr_bytes value=%.0f (%d MRs)\n", (after_mrs - before_mrs) * 1024.0 / (count - 1), count);
  for (ibv_mr* mr : mrs) ibv_dereg_mr(mr);
  std::printf("registration_unwritten_ms value=%.1f\n", registration_ms(pd, false));
  std::printf("registration_written_ms value=%.1f\n", registration_ms(pd, true));
  std::printf("fresh_write_ms value=%.1f\n", fresh_memory_ms(false));
  std::printf("fresh_copy_ms value=%.1f\n", fresh_memory_ms(true));
  for (ibv_qp* qp : qps) ibv_destroy_qp(qp);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(context);
  ibv_free_device_list(list);
  return 0;
}
