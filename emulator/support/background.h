// The process's background runtime: one thread running a Boost.Asio
// io_context, for the work that must go on while the application is in no
// verbs or rdma_cm call: RNR and retry timers, the rdma_cm's MADs and their
// resends. The UDP engine keeps its own io thread: its hand-off with the
// application is tuned per packet.
#pragma once

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <memory>

namespace softverbs::background {

// The runtime's io_context; the first call (in a process, or in a forked
// child) starts its thread.
boost::asio::io_context& io_context();

// The fork policy. A forked child inherits no thread, and the parent's
// io_context may have been mid-update at fork(): the child's first
// io_context() makes a new one, and whatever was made on the parent's
// (timers, descriptors, posted work) is the parent's. generation() changes
// in the child so that an owner can tell; it abandons such objects rather
// than destroy them (their destructors would touch the parent's io_context).
uint64_t generation();

// Keeps `object` allocated and reachable for good, never run nor destroyed.
void abandon_raw(void* object);
template <class T>
void abandon(std::unique_ptr<T> object) {
  abandon_raw(object.release());
}

}  // namespace softverbs::background
