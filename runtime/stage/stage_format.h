// StageFormat: how one model format's stages are built, saved, shipped to a worker process and received
// there. Each format implements it in its own folder (torchscript/, exported/), and stage.cpp picks one
// by the plan's model's format() (or, for bytes a worker received, by what the archive holds), so nothing
// outside runtime/stage and runtime/graph names a format. A third format adds a folder here and a case
// in stage.cpp.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "runtime/graph/plan.h"
#include "runtime/stage/checkpoint.h"
#include "runtime/stage/stage.h"

namespace libpipe::stage {

class StageFormat {
 public:
  virtual ~StageFormat() = default;
  // As stage.h's build_stage, save_stage, ship_stage and receive_stage say.
  virtual std::unique_ptr<Stage> build(const graph::Plan& plan, size_t index, const BuildOptions& build) const = 0;
  virtual void save(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
                    const std::string& path) const = 0;
  virtual ShippedStage ship(const graph::Plan& plan, size_t index, const c10::Device& device,
                            const StageOptions& options, Checkpoint* checkpoint) const = 0;
  virtual std::unique_ptr<Stage> receive(ShippedStage shipped, size_t index, const BuildOptions& build,
                                         const std::string& what) const = 0;
  // As stage.h's stored_weight_bytes says, without its checks.
  virtual uint64_t stored_bytes(const graph::Plan& plan, size_t index, const StageOptions& options) const = 0;
};

// Each defined in its format's folder.
const StageFormat& torchscript_stages();
const StageFormat& exported_stages();

}  // namespace libpipe::stage
