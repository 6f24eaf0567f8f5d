// Linear layers of CPU stages on weights packed once for MKL's GEMM.
//
// aten::linear with a few rows (a decode step: one row per sequence) spends most of its time in
// MKL re-packing the weight on every call, not in the product. MKL can pack a weight once
// (cblas_sgemm_pack) and multiply by the packed form (cblas_sgemm_compute). Measured on the 210
// linear layers of SmolLM2-135M, one thread, AVX-512 (bench/linear_gemm.cpp, bench/RESULTS.md):
// 1.3-1.7x faster from 4 to 64 rows; slower for 1 to 3 rows, where MKL does not pack, and even from
// 128 rows, where the packing of each call pays for itself: aten::linear runs there.
//
// pack_linear_weights rewrites a stage's forward: each aten::linear of a float32 CPU weight that is
// a constant attribute of the stage (not written by the forward) becomes pipe::packed_linear(input,
// packed, weight, bias), the packed form held as a buffer beside the weight (about 1.4x the
// weight's bytes; tied weights are packed once). Stages keep their weights, and their results
// equal aten::linear's up to float32 rounding. Packed in chunks of output features, a product can be
// shared by several threads (SpareCores, spare_cores.h). Nothing is rewritten where MKL's packed GEMM is not
// in the LibTorch this process runs (no MKL: ARM builds), or with LIBPIPE_PACKED_LINEAR=0.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <map>

namespace libpipe::stage {

// The rows for which pipe::packed_linear multiplies by the packed weight; aten::linear otherwise.
constexpr int64_t kPackedMinRows = 4;
constexpr int64_t kPackedMaxRows = 64;

// Call after the stage's weights are loaded and placed; before its first run. `chunks`: into how
// many pieces of output features each weight is cut, so that as many threads can share a product
// (SpareCores: the cores a session's stage may borrow). Returns the number of linear layers
// rewritten. Never throws for a layer it cannot pack: that one stays aten::linear.
size_t pack_linear_weights(torch::jit::Module& stage, int chunks = 1);

// For stages whose weights another runtime holds (exported programs, run by nativert), where no
// packed buffer can be added after load: such a program calls pipe::linear_packed_on_demand(input,
// weight, bias) where it called aten::linear, and the op packs each weight the first time it meets
// it, into the PackedWeights of the stage running on the calling thread (held for the stage's
// lifetime; set with PackedWeights::Use around each run). Without one, or for a weight that cannot
// be packed, the op is aten::linear. The packed forms cost what TorchScript stages' do: MKL asks for
// room for its largest layout, and the pages it never writes are never touched.
class PackedWeights {
 public:
  explicit PackedWeights(int chunks) : chunks_(chunks) {}
  // Makes `weights` the calling thread's until destroyed.
  class Use {
   public:
    explicit Use(PackedWeights& weights);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    PackedWeights* previous_;
  };
  // The packed form of `weight` (undefined: it cannot be packed), made on first use.
  const at::Tensor& packed(const at::Tensor& weight);

 private:
  int chunks_;
  std::map<const void*, at::Tensor> packed_;  // by the weight's data: the runtime keeps it in place
};

// Registers pipe::linear_packed_on_demand (once per process); false where packing is unavailable (no
// MKL, LIBPIPE_PACKED_LINEAR=0), and then no program should call it.
bool register_linear_packed_on_demand();

}  // namespace libpipe::stage
