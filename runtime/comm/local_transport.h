// The local transport: ranks that are threads of one process. Messages are handed over as they
// are (tensors shared, nothing copied or encoded), so a session's driver and workers can run and
// be tested inside one process.
#pragma once

#include <memory>
#include <vector>

#include "runtime/comm/transport.h"

namespace libpipe::comm {

// One connected endpoint per rank, 0 .. world_size-1. abort() on any endpoint aborts them all,
// as a broken process group would.
std::vector<std::unique_ptr<Transport>> make_local_transports(int world_size);

}  // namespace libpipe::comm
