// Progress for deferred sends while the application is not in a verbs call:
// one process-wide thread that sleeps until the earliest RNR or retry timer
// of any context expires (never sooner than 1 ms apart: the application's
// own polling handles finer timers), so that a program blocked in
// ibv_get_cq_event still sees its RNR-delayed send complete.
#pragma once

#include <chrono>

namespace softverbs::provider {

struct ContextState;

using ProgressClock = std::chrono::steady_clock;

void register_for_progress(ContextState* context);
// Returns once no progress pass is running on `context`.
void unregister_from_progress(ContextState* context);
// Asks for a progress pass at `when` (or the earliest time already asked).
void schedule_progress(ProgressClock::time_point when);

// Implemented with the QPs: retries what is due, returns when the next
// deferred send of `context` is due (time_point::max() if none).
ProgressClock::time_point progress_deferred_sends(ContextState& context);

}  // namespace softverbs::provider
