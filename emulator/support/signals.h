// The application's signals, as seen from threads and waits of softverbs.
#pragma once

namespace softverbs {

// For a thread softverbs starts in an application: signals are the
// application's, and its handlers must run on its own threads, where they
// interrupt its blocking calls as they would without softverbs.
void block_signals_on_this_thread();

// Whether a blocking read that a signal handler interrupted would have been
// restarted by the kernel (SA_RESTART), for waits that must answer as such a
// read would but block in poll, which a handler always interrupts. Which
// signal came is unknown afterwards: true when no handler of an asynchronous
// signal lacks SA_RESTART.
bool interrupted_reads_restart();

}  // namespace softverbs
