// Check: a CQ overran (more completions were due than it holds). The device
// raised IBV_EVENT_CQ_ERR and moved the QPs to ERR, as an HCA does; check
// mode also tells the owner which completion was lost first.
#pragma once

#include "verbs_objects.h"

namespace softverbs::provider::check {

// At the owner's polls and destroy: reports, once per CQ, an overrun the
// device recorded.
void report_cq_overrun(ProviderCq& cq);

}  // namespace softverbs::provider::check
