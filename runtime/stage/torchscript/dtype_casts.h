// Running a model traced in one floating dtype in another: the stage options' dtype (--dtype,
// pipe_stage_options.dtype) converts floating parameters, buffers and inputs, and this pass makes
// the graph follow.
//
// Why a graph pass is needed: eager code casts to the dtype of its input (`x.to(input_dtype)`,
// `cos.to(x.dtype)`, `softmax(w, dtype=torch.float32).to(q.dtype)`), but a trace records the dtype
// the example had as a constant. Hugging Face's RMSNorm and rotary embedding upcast to float32 on
// purpose and cast back; in a float32 trace the cast back is a cast to float32, so once the
// weights are bfloat16, float32 activations meet bfloat16 weights and the first matmul fails (as
// PyTorch's own `traced.to(torch.bfloat16)` does).
//
// What it does: every cast the trace recorded is kept, so the deliberate upcasts still compute in
// float32, as eager bfloat16 code does. Where a value that the trace fixed at the model's own
// dtype (the "source" dtype, that of its floating weights) meets a value of the target dtype in
// one operation, what eager code did there depends on how the value got its dtype:
//  - a cast to the dtype it already had (in a float32 trace, `.to(input_dtype)`, cos/sin's
//    `.to(x.dtype)`, `softmax(..., dtype=torch.float32).to(q.dtype)`) was a cast back: it is cast
//    to the target dtype there (RMSNorm's `weight * x.to(input_dtype)`, cos/sin meeting q and k);
//  - a widened copy of a target-dtype value (`x.to(torch.float32)`) also stands, in a trace, for
//    the original wherever the code kept it (a residual): it is cast back too, which is exact;
//  - a value computed in the source dtype (`torch.arange(n, dtype=torch.float32)`, integers cast
//    to it, arithmetic on float32 values) was asked for: PyTorch promotes the operation to it, and
//    so does the converted model, unless the operation needs one dtype for all its operands
//    (matmul, linear, convolution, attention, normalisation...), where it is cast.
// The cast saturates at the target dtype's finite range, so `torch.finfo(torch.float32).min`
// masks become the target's minimum, as eager code computing `finfo(dtype).min` gets, not -inf.
// For Hugging Face decoders (Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, GPT-NeoX, OPT) and
// encoders (BERT, ViT) this gives the bits eager `model.to(torch.bfloat16)` gives (on CPU, where it
// was measured). What it cannot see is a branch the trace did not take (T5's norm casts to the
// weights' dtype only when they are half precision): such a model runs with those values in
// float32, as computed.
//
// The dtypes are worked out statically over the whole model (so a stage knows what the earlier
// ones hand it): floating parameters, buffers and forward arguments are the target dtype (an
// argument may also be an integer tensor), casts and dtype arguments fix theirs, other operations
// follow PyTorch's promotion. A value fixed at the source dtype that meets a forward argument (or
// a value of unknown dtype) in an operation that needs one dtype for all its operands (matmul,
// linear, convolution, attention, normalisation...) cannot be decided before run time: building
// a stage holding such an operation fails with Error(Unsupported), naming it and the cast, and
// saying how to export instead.
#pragma once

#include <torch/csrc/jit/ir/ir.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace libpipe::graph {
class Model;
}

namespace libpipe::stage {

class DtypeCasts {
 public:
  // Works out where `model` must cast when it runs with its floating tensors converted to `dtype`.
  DtypeCasts(const graph::Model& model, at::ScalarType dtype);

  // The dtype of most of the model's floating parameters and buffers (float32 when it has none).
  at::ScalarType source() const { return source_; }
  at::ScalarType target() const { return target_; }

  // Copies what was decided for `original` (a node of the model's graph) onto `clone`, its copy in
  // a stage graph, blocks included: inserts the casts before the nodes that need them. Returns how
  // many it inserted. Throws Error(Unsupported) naming stage `stage_index` for a node whose cast
  // cannot be decided before run time.
  size_t apply(const torch::jit::Node* original, torch::jit::Node* clone, size_t stage_index) const;

 private:
  friend class DtypeAnalysis;

  at::ScalarType source_;
  at::ScalarType target_;
  // node -> indices of its inputs to cast to the target dtype
  std::unordered_map<const torch::jit::Node*, std::vector<size_t>> casts_;
  // node -> why its operands' dtypes cannot be reconciled before run time
  std::unordered_map<const torch::jit::Node*, std::string> undecided_;
};

}  // namespace libpipe::stage
