#include "runtime/stage/stage.h"

#include "runtime/error.h"
#include "runtime/graph/exported/model.h"
#include "runtime/io/archive_check.h"
#include "runtime/stage/exported_stage.h"
#include "runtime/stage/torchscript_stage.h"

namespace libpipe::stage {

namespace {

const graph::exported::ExportedModel* exported(const graph::Plan& plan) {
  return dynamic_cast<const graph::exported::ExportedModel*>(&plan.model());
}

}  // namespace

std::unique_ptr<Stage> build_stage(const graph::Plan& plan, size_t index, const BuildOptions& build) {
  if (const auto* model = exported(plan)) return build_exported_stage(*model, plan, index, build);
  return build_torchscript_stage(plan, index, build);
}

void save_stage(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
                const std::string& path) {
  if (const auto* model = exported(plan)) {
    const std::string bytes = exported_stage_archive(*model, plan, index, c10::Device(c10::kCPU), options, checkpoint);
    FILE* f = std::fopen(path.c_str(), "wb");
    const bool ok = f && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if (f && std::fclose(f) != 0) throw Error(Status::Io, "cannot write '" + path + "'");
    if (!ok) throw Error(Status::Io, "cannot write '" + path + "'");
    return;
  }
  save_torchscript_stage(plan, index, options, checkpoint, path);
}

ShippedStage ship_stage(const graph::Plan& plan, size_t index, const c10::Device& device, const StageOptions& options,
                        Checkpoint* checkpoint) {
  if (const auto* model = exported(plan))
    return {exported_stage_archive(*model, plan, index, device, options, checkpoint, /*leave_out=*/true),
            exported_stage_aliases(*model, plan, index)};
  return ship_torchscript_stage(plan, index, device, options, checkpoint);
}

std::unique_ptr<Stage> receive_stage(ShippedStage shipped, size_t index, const BuildOptions& build,
                                     const std::string& what) {
  const auto format = io::check_model_archive(shipped.bytes.data(), shipped.bytes.size(), what);
  if (format == io::ModelFormat::Exported) {
    auto received = graph::exported::ExportedModel::from_archive(
        graph::exported::Pt2Archive::from_bytes(std::move(shipped.bytes), what));
    return receive_exported_stage(*received, build, shipped.aliases, what);
  }
  return receive_torchscript_stage(shipped, index, build, what);
}

}  // namespace libpipe::stage
