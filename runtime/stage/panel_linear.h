// Linear layers of CPU stages on weights stored once, as panels (runtime/cpu/panel_gemm.h).
//
// A decode step multiplies a few rows by every weight: its time is the time to stream the weights from
// memory. aten::linear re-packs each weight on every call for MKL (a second pass over it), reads it on
// the stage's one thread, and runs bfloat16 through a path that streamed a third of the memory's speed
// (bench/RESULTS.md, "Linear layers of few rows"). So each linear layer of a CPU stage whose weight is a
// constant attribute becomes pipe::panel_linear(input, panels, bias, out_features, in_features): the
// weight repacked once into panels in memory on huge pages, the original freed, so the stage holds one
// copy in the layout it computes with. An embedding that reads the same tensor (a head tied to the
// token embedding) becomes pipe::panel_embedding, which reads its rows back from the panels. This file
// holds the operators and the panels, for both formats' stages; the rewrite of a TorchScript stage is
// torchscript/panel_rewrite.h, an exported program's is pipe::linear_packed_on_demand below.
//
// Quantized weights too: int8 (a scale per output feature; pipe::panel_linear_int8, float rows) and int4 (Q4_0-style
// groups of 32/64/128 inputs with float16 scales; pipe::panel_linear_int4, whose rows are rounded to int8 per block
// of 32 for integer dot products, panel_gemm.h).
//
// float32, bfloat16 and float16 weights; activations in the weight's dtype; float32 accumulation. The
// product is cut in units of 16 output features, shared by the cores a stage may borrow (SpareCores, in
// a session of one-thread stages) or by its own intra-op threads; each unit is computed by one thread,
// so results never depend on the sharing. Nothing is rewritten on a CPU without AVX-512 (the kernels'
// instruction set), for a weight the forward writes or reads otherwise (then the weight stays and the
// layer stays aten::linear), or with LIBPIPE_PACKED_LINEAR=0.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "runtime/stage/stage.h"

namespace libpipe::cpu {
class HugePageBuffer;
}  // namespace libpipe::cpu

namespace libpipe::stage {

// Whether linear layers are rewritten in this process (CPU and LIBPIPE_PACKED_LINEAR).
bool panel_linear_available();

// A weight as 8-bit codes: weight ~= scales[:, None] * codes, symmetric per output feature (the largest magnitude
// of a row maps to 127). `codes` [n, k] int8 packs with PanelArena into int8 panels (panel_gemm.h).
struct Int8Weight {
  at::Tensor codes;   // [n, k] int8
  at::Tensor scales;  // [n] float32
};
Int8Weight quantize_int8(const at::Tensor& weight);

// A weight as 4-bit codes in groups of `group` (32, 64 or 128) consecutive inputs: weight[o, i] ~= scales[o, i / group]
// * codes[o, i], codes in [-8, 7]. Per (output, group) the value of largest magnitude maps to -8 (llama.cpp's Q4_0:
// scale = that value / -8, rounded to float16; the others round to nearest and clamp at 7), which measured a lower
// error than scale = max |w| / 7 (relative RMS 8.6% against 9.7% on Gaussian weights at group 32). K is padded with
// zero codes to a multiple of the group. `codes` [n, depth] int8, `scales` [n, depth / group] float16.
struct Int4Weight {
  at::Tensor codes;
  at::Tensor scales;
  int64_t group = 32;
};
// The group sizes int4 takes; 0 asks for the default.
constexpr int64_t kDefaultInt4Group = 32;
bool valid_int4_group(int64_t group);
Int4Weight quantize_int4(const at::Tensor& weight, int64_t group = kDefaultInt4Group);
// The weight q holds, [n, k] float32 (for tests and references).
at::Tensor dequantize_int4(const Int4Weight& q, int64_t k);

// out = input @ W^T + bias for `panels` the int4 panels of a quantize_int4 weight W (PanelArena::pack_int4), the
// operator pipe::panel_linear_int4: the input's rows are quantized to int8 per block of 32 (cpu::quantize_rows, the
// same on every CPU), multiplied in integers, accumulated in float32; returned in the input's dtype.
at::Tensor panel_linear_int4(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                             int64_t out_features, int64_t in_features, int64_t group);

// out = input @ (scales[:, None] * codes)^T + bias for `panels` the int8 panels of `codes`: input float32, bfloat16
// or float16 (computed in float32, returned in the input's dtype), the operator pipe::panel_linear_int8.
at::Tensor panel_linear_int8(const at::Tensor& input, const at::Tensor& panels, const at::Tensor& scales,
                             const std::optional<at::Tensor>& bias, int64_t out_features, int64_t in_features);

// Whether to_panels can pack `weight` (2-d, non-empty, a supported dtype, on the CPU; `any_device`: wherever it is,
// for a weight still to be loaded).
bool can_pack(const at::Tensor& weight, bool any_device = false);

// The bytes an [n, k] weight of `dtype` (float32, bfloat16 or float16) takes as panels stored `as`, as PanelArena and
// PanelWeights make them: unquantized, the panels in `dtype`; int8, the codes' panels and a float32 scale per output
// feature; int4, the panels with their float16 scales inside, in groups of `group` inputs (0: 32).
size_t stored_panel_bytes(int64_t n, int64_t k, at::ScalarType dtype, WeightQuantization as, int64_t group);

// Registers pipe::panel_linear, pipe::panel_linear_int8, pipe::panel_linear_int4, pipe::panel_embedding,
// pipe::embedding_int8 and the
// grouped products of one input, pipe::panel_linear_group, pipe::panel_linear_int8_group and
// pipe::panel_linear_int4_group (once per process).
void register_panel_ops();

// Panels of several weights in one buffer on huge pages, each a tensor that keeps the buffer alive; the
// weights are packed one by one, so their originals can go as their panels are made.
class PanelArena {
 public:
  // Room for the panels of `weights` (each can_pack, or int8 codes), each at a 4 KiB boundary.
  explicit PanelArena(const std::vector<at::Tensor>& weights);
  // Room for entries of these sizes in bytes (int4_bytes for an int4 weight), each at a 4 KiB boundary.
  explicit PanelArena(const std::vector<size_t>& bytes);
  // The panels of weights[i], packed (on the intra-op threads of the calling thread).
  at::Tensor pack(size_t i, const at::Tensor& weight);
  // The int4 panels of entry i (a uint8 tensor of cpu::int4_panel_bytes).
  at::Tensor pack_int4(size_t i, const Int4Weight& q, int64_t k);
  static size_t bytes_of(const at::Tensor& w);
  static size_t int4_bytes(int64_t n, int64_t k, int64_t group);

 private:
  std::vector<size_t> offsets_;
  std::shared_ptr<cpu::HugePageBuffer> buffer_;
};

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
// pipe::embedding_int8: aten::embedding(weight, indices) for a table stored as quantize_int8(weight) (a float32
// scale per row), each selected row dequantized to float32 (code * scale) and then cast to `dtype`, the table's.
// Indices out of range are refused as aten's ("index out of range in self").
at::Tensor embedding_int8(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& indices,
                          at::ScalarType dtype);

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
  // The same as int8 panels with their scales (quantize_int8), for pipe::linear_int8_on_demand.
  struct Int8Panels {
    at::Tensor panels, scales;
  };
  const Int8Panels& int8_panels(const at::Tensor& weight);
  // The same as int4 panels (quantize_int4 in groups of int4_group), for pipe::linear_int4_on_demand.
  int64_t int4_group = kDefaultInt4Group;
  const at::Tensor& int4_panels(const at::Tensor& weight);

 private:
  std::map<const void*, at::Tensor> panels_;  // by the weight's data: the runtime keeps it in place
  std::map<const void*, Int8Panels> int8_;
  std::map<const void*, at::Tensor> int4_;
};

// Registers pipe::linear_packed_on_demand and pipe::linear_int8_on_demand (its int8 twin, where a stage's
// weights are quantized) once per process; false where panels are unavailable (panel_linear_available), and
// then no program should call them.
bool register_linear_packed_on_demand();

}  // namespace libpipe::stage
