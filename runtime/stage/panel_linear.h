// Linear layers of CPU stages on weights stored once, as panels (runtime/cpu/panel_gemm.h).
//
// A decode step multiplies a few rows by every weight: its time is the time to stream the weights from
// memory. aten::linear re-packs each weight on every call for MKL (a second pass over it), reads it on
// the stage's one thread, and runs bfloat16 through a path that streamed a third of the memory's speed
// (bench/RESULTS.md, "Linear layers of few rows"). So each linear layer of a CPU stage whose weight is a
// constant attribute becomes pipe::panel_linear(input, panels, bias, out_features, in_features): the
// weight repacked once into panels in memory on huge pages, the original freed, so the stage holds one
// copy in the layout it computes with. An embedding that reads the same tensor (a head tied to the
// token embedding) becomes pipe::panel_embedding, which reads its rows back from the panels.
//
// float32, bfloat16 and float16 weights; activations in the weight's dtype; float32 accumulation. The
// product is cut in units of 16 output features, shared by the cores a stage may borrow (SpareCores, in
// a session of one-thread stages) or by its own intra-op threads; each unit is computed by one thread,
// so results never depend on the sharing. Nothing is rewritten on a CPU without AVX-512 (the kernels'
// instruction set), for a weight the forward writes or reads otherwise (then the weight stays and the
// layer stays aten::linear), or with LIBPIPE_PACKED_LINEAR=0.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/jit/api/module.h>

#include <map>
#include <optional>
#include <vector>

namespace libpipe::stage {

// Whether linear layers are rewritten in this process (CPU and LIBPIPE_PACKED_LINEAR).
bool panel_linear_available();

// Rewrites the stage's forward as above. Call after its weights are loaded and placed, before its first
// run. Returns the number of linear layers rewritten; never throws for a layer it leaves alone.
size_t panel_linear_weights(torch::jit::Module& stage);

// One weight [N, K] (float32, bfloat16 or float16, CPU) as panels: a 1-d tensor of its dtype, on huge
// pages when large. Undefined if it cannot be (another dtype or device, not 2-d, empty).
at::Tensor to_panels(const at::Tensor& weight);
// The panels of several weights in one mapping (each from 4 KiB boundary): weights smaller than a huge
// page get huge pages too. An entry is undefined where to_panels' would be.
std::vector<at::Tensor> to_panels(const std::vector<at::Tensor>& weights);

// The operators, for tests and benchmarks: aten::linear(input, weight, bias) and
// aten::embedding(weight, indices) for `panels` = to_panels(weight).
at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t in_features);
at::Tensor panel_embedding(const at::Tensor& panels, const at::Tensor& indices, int64_t num_embeddings,
                           int64_t embedding_dim);

// For stages whose weights another runtime holds (exported programs, run by nativert), where nothing
// can be added to the stage after load: such a program calls pipe::linear_packed_on_demand(input,
// weight, bias) where it called aten::linear, and the op makes each weight's panels the first time it
// meets it, held by the PanelWeights of the stage running on the calling thread (set with
// PanelWeights::Use around each run). Without one, or for a weight that cannot be packed, the op is
// aten::linear. The runtime keeps its own copy of the weights, so such a stage holds two.
class PanelWeights {
 public:
  // Makes `weights` the calling thread's until destroyed.
  class Use {
   public:
    explicit Use(PanelWeights& weights);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    PanelWeights* previous_;
  };
  // The panels of `weight` (undefined: it cannot be packed), made on first use.
  const at::Tensor& panels(const at::Tensor& weight);

 private:
  std::map<const void*, at::Tensor> panels_;  // by the weight's data: the runtime keeps it in place
};

// Registers pipe::linear_packed_on_demand (once per process); false where panels are unavailable
// (panel_linear_available), and then no program should call it.
bool register_linear_packed_on_demand();

}  // namespace libpipe::stage
