// Loading a model file, whichever front-end reads it: the archive's content decides (a
// TorchScript archive, or a torch.export program), never its file name.
#pragma once

#include <memory>
#include <string>

#include "runtime/graph/program.h"

namespace libpipe::graph {

// Throws Error(NotFound) for a missing file, Error(InvalidFormat) for a file of neither format, and
// what the front-end throws for a model it cannot split or run.
std::shared_ptr<const Program> load_program(const std::string& path);

}  // namespace libpipe::graph
