// The exported-program stage builder (exported_stages() in stage_format.h): one stage of a plan made from a
// torch.export program, as an exported program itself (a .pt2 holding one program named "model", loadable by
// torch.export.load), run by LibTorch's nativert (torch::nativert::ModelRunnerHandle).
//
// A stage program is the original program's JSON cut down to the stage's nodes (and the nodes that
// compute the symbolic sizes they read, recomputed there), with the crossing values as its inputs
// and outputs, and only the weights it reads, each written as its own record: from the model's
// archive, or from a checkpoint. Device fields are rewritten for the stage's device.
//
// nativert reads a program from a file only, so a stage to run is written to an anonymous
// in-memory file (memfd), which nativert reads its weights from once.
#pragma once

#include "runtime/graph/exported/model.h"
#include "runtime/stage/checkpoint.h"
#include "runtime/stage/stage.h"

namespace libpipe::stage {

// The stage as a .pt2 archive's bytes. With `leave_out` set, tensors `checkpoint` holds, and tensors
// the program writes in place that have no data (KV caches), are written as empty records (a worker
// process fills them from the checkpoint itself, or allocates them as zeros). Throws Error: Unsupported
// for a dtype the program was not exported in or a symbolic size crossing between stages, NotFound /
// Input / InvalidFormat as the weights' checks do (naming the tensor and the stage). Only PyTorch's own
// operators: it is a program for torch.export.load as much as for libpipe.
std::string exported_stage_archive(const graph::exported::ExportedModel& model, const graph::Plan& plan, size_t index,
                                   const c10::Device& device, const StageOptions& options, Checkpoint* checkpoint,
                                   bool leave_out = false);

// Builds stage `index` to run: its archive goes straight into an anonymous in-memory file (memfd)
// that nativert reads (it reads files only). On the CPU (`build.cpu_rewrites`) its linear layers
// call libpipe's pipe::linear_packed_on_demand instead of aten::linear, which multiplies by the weight's
// panels, made once, as TorchScript stages' linear layers do (panel_linear.h). Throws as exported_stage_archive does,
// and Error(InvalidFormat) when nativert refuses the program (its message included).
std::unique_ptr<Stage> build_exported_stage(const graph::exported::ExportedModel& model, const graph::Plan& plan,
                                            size_t index, const BuildOptions& build);
// The same for a stage program as a worker received it (exported_stage_archive with leave_out), made
// whole: its left-out tensors read from the checkpoint (also under the other names `tied` gives
// them: the model's tied names the stage itself lacks). `what` names it in messages.
std::unique_ptr<Stage> receive_exported_stage(const graph::exported::ExportedModel& received, const BuildOptions& build,
                                              const AliasGroups& tied, const std::string& what);
// The other names, in the whole model, of the tensors stage `index` holds (for its worker's lookups).
AliasGroups exported_stage_aliases(const graph::exported::ExportedModel& model, const graph::Plan& plan, size_t index);

}  // namespace libpipe::stage
