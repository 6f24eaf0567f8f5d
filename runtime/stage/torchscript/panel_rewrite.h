// Linear layers of a TorchScript CPU stage on panels (panel_linear.h): each aten::linear whose weight is a
// constant attribute of the stage becomes pipe::panel_linear on that weight's panels, an embedding reading
// the same tensor pipe::panel_embedding, and the products of one input (q, k, v; gate, up) one
// pipe::panel_linear_group; the originals are freed as their panels are made.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include <cstddef>
#include <optional>

#include "runtime/stage/stage.h"

namespace libpipe::stage {

// Rewrites the stage's forward as above. Call after its weights are loaded and placed, before its first
// run. With `quantize` Int8, the weights that only linear layers read become int8 panels with a scale per
// output feature (quantize_int8), multiplied by pipe::panel_linear_int8; with Int4, int4 panels in groups of
// `group` inputs (quantize_int4; 0: 32), multiplied by pipe::panel_linear_int4; those are not grouped. The output
// head (the linear layer whose result the forward returns, through casts and copies) is stored as head_quantization
// (stage.h) says for `quantize` and `head` (StageOptions::quantize_head; nullopt: the default). Returns the number
// of linear layers rewritten; never throws for a layer it leaves alone.
size_t panel_linear_weights(torch::jit::Module& stage, WeightQuantization quantize = WeightQuantization::None,
                            int64_t group = 0, std::optional<WeightQuantization> head = std::nullopt);

// StageOptions::quantize_embedding Int8: each embedding table that only aten::embedding reads (not tied to a linear
// layer of the stage, nothing writing it) becomes int8 codes with a float32 scale per row (quantize_int8), looked up
// by pipe::embedding_int8 in the table's dtype; the original is dropped. Returns the number of tables quantized.
size_t quantize_embeddings(torch::jit::Module& stage);

// The bytes `stage`'s parameters and buffers take once loaded with `options` (floating ones cast to its dtype) and
// rewritten by panel_linear_weights(stage, options.quantize, options.quantize_group, options.quantize_head): the
// same analysis picks the weights that become panels (stored_panel_bytes), codes, or stay beside them. `stage` is
// build_stage_module's, before its weights are loaded (meta tensors will do). Where panels are unavailable, each
// tensor at the dtype. Embedding tables quantize_embeddings would quantize (options.quantize_embedding) count as
// their int8 codes and a float32 scale per row, panels or not. Tied tensors count once.
uint64_t stored_bytes(torch::jit::Module& stage, const StageOptions& options);

}  // namespace libpipe::stage
