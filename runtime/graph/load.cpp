#include "runtime/graph/load.h"

#include "runtime/graph/exported/model.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/io/archive_check.h"

namespace libpipe::graph {

std::shared_ptr<const Program> load_program(const std::string& path) {
  if (io::check_model_archive(path) == io::ModelFormat::Exported) return exported::ExportedModel::load(path);
  return Model::load(path);
}

}  // namespace libpipe::graph
