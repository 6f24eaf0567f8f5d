// Stage: one stage of a plan, built and ready to run, whatever format its model came in. A
// TorchScript model's stages are TorchScript modules (torchscript/); an exported program's are
// exported programs run by LibTorch's nativert (exported/). The session, the worker processes and
// the profiler run stages through this interface only, and build, save and ship them through the
// functions below, which pick the format's builder (stage_format.h) from the plan's model.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/graph/plan.h"
#include "runtime/stage/checkpoint.h"

namespace libpipe::stage {

class Stage {
 public:
  virtual ~Stage() = default;
  // Runs the stage on its inputs (the plan's crossing values it reads, in order). Returns a tuple of
  // the values it defines for later stages, or, for the last stage, the model's own result. Called by
  // one thread at a time.
  virtual c10::IValue forward(std::vector<c10::IValue> inputs) = 0;
};

// How a CPU stage stores the weights of its linear layers: in the stage's dtype, as 8-bit codes with a scale per
// output feature, or as 4-bit codes with a scale per group of inputs and output feature (panel_linear.h).
enum class WeightQuantization { None, Int8, Int4 };

// What a stage's tensors are: from the model or a checkpoint, and in which dtype.
struct StageOptions {
  std::string weights;                  // checkpoint file or index; empty: keep the model's tensors
  std::optional<at::ScalarType> dtype;  // cast floating parameters and buffers (and inputs) to this
  // Linear layers' weights of CPU stages with the CPU rewrites (BuildOptions::cpu_rewrites); activations stay
  // in `dtype`.
  WeightQuantization quantize = WeightQuantization::None;
  int64_t quantize_group = 0;  // Int4 (the weights' or the head's): inputs per scale, 32, 64 or 128; 0: 32
  // The output head's storage (the linear layer whose result the forward returns); nullopt: head_quantization's
  // default. Meaningful only when `quantize` is not None.
  std::optional<WeightQuantization> quantize_head;
  // Embedding tables that only aten::embedding reads, of CPU stages with the CPU rewrites: None (their dtype) or
  // Int8 (codes with a float32 scale per row, pipe::embedding_int8). Independent of `quantize`.
  WeightQuantization quantize_embedding = WeightQuantization::None;
  // Called as each tensor is loaded: (stage, bytes loaded so far, bytes the stage needs).
  std::function<void(size_t, uint64_t, uint64_t)> progress;
};

// How the output head of a stage built with `options` is stored: quantize_head if given (and `quantize` is not
// None), else as the other weights, except int8 under int4: every token's logits go through the head, and 4-bit
// codes there cost far more quality than anywhere else (bench/RESULTS.md, "Perplexity"). None without `quantize`.
WeightQuantization head_quantization(const StageOptions& options);

// The bytes stage `index`'s parameters and buffers take once built as a CPU stage with `options` (the CPU rewrites
// on): floating tensors in options.dtype, linear layers' weights as panels, int8 or int4 codes as options.quantize
// and head_quantization say, worked out by the same analysis the build runs, from shapes and dtypes alone (nothing
// is loaded or quantized). An exported program's stage keeps its originals beside the panels, and they count.
// Throws Error(Unsupported) for quantized weights where the CPU has no kernels for them, as building would.
uint64_t stored_weight_bytes(const graph::Plan& plan, size_t index, const StageOptions& options);

// How a stage is built for running: its weights (from the model, or the checkpoint in
// `options.weights`, open as `checkpoint`), its dtype and its device. `cpu_rewrites` applies the
// CPU rewrites (linear layers on panels, both formats; for TorchScript stages also attention from the
// KV cache and fused element-wise chains; see panel_linear.h, torchscript/cache_attention.h); false leaves the stage's
// code as the model wrote it.
struct BuildOptions {
  const StageOptions* options = nullptr;  // required
  Checkpoint* checkpoint = nullptr;
  c10::Device device = c10::Device(c10::kCPU);
  bool cpu_rewrites = false;
};

// Throws Error as the format's builder does (Unsupported, NotFound, Input for weights that do not fit).
std::unique_ptr<Stage> build_stage(const graph::Plan& plan, size_t index, const BuildOptions& build);

// Writes stage `index` to `path` as a model of its own (a TorchScript archive, or a .pt2 holding one
// exported program named "model"), on the CPU, with its weights. Throws Error(Io) when the file
// cannot be written.
void save_stage(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
                const std::string& path);

// A stage as it travels to a worker process: bytes, and the tied-weight names the worker needs to
// look its tensors up in `checkpoint`. With a checkpoint, the tensors it holds are left out (the
// worker reads them itself); the rest travel with their data.
struct ShippedStage {
  std::string bytes;
  AliasGroups aliases;
};
ShippedStage ship_stage(const graph::Plan& plan, size_t index, const c10::Device& device, const StageOptions& options,
                        Checkpoint* checkpoint);
// The worker's side: builds the stage from what ship_stage sent (the format is read from the bytes).
// Throws Error(InvalidFormat) naming `what` for bytes that are no stage.
std::unique_ptr<Stage> receive_stage(ShippedStage shipped, size_t index, const BuildOptions& build,
                                     const std::string& what);

}  // namespace libpipe::stage
