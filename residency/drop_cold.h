// --drop-cold-experts F: skipping a routed expert that would have to be read
// from the slowest tier when its router weight is small, as the flash
// streamer's cache-aware dropping does. A dropped rank's weight becomes 0 (the
// others keep theirs: no renormalization), its expert is neither looked up nor
// admitted nor read. The rule, on the host and the device alike.
#pragma once

#include <cstdint>

#include "loader/host_device.h"

namespace moegraph {

// Whether rank `rank` of a k-expert selection, of combine weight `weight`,
// is dropped at strength F: never the top expert (rank 0), never at k 1;
// else when it is not resident and its weight is below F / k. F 0 drops
// nothing; F k drops every non-top miss (weights below 1).
MG_HD inline bool drop_routing(int32_t rank, int32_t k, double weight, double strength,
                               bool resident) {
  return strength > 0 && k > 1 && rank > 0 && !resident &&
         weight < strength / static_cast<double>(k);
}

}  // namespace moegraph
