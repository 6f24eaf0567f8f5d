#include "runtime/stage/panel_linear.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/cpu/huge_pages.h"
#include "runtime/cpu/panel_gemm.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/stage/spare_cores.h"
#include "runtime/stage/warm_ahead.h"

namespace libpipe::stage {

namespace {

using cpu::WeightType;

// At most this many units (2048 output features) per piece of a product shared with borrowed cores:
// a helper leaves between two pieces when the stage it borrowed from wants its core back, and a
// piece of the 576 x 49152 head of this size is 0.1-0.4 ms of memory traffic.
constexpr int64_t kMaxUnitsPerPiece = 128;
// Below this many weight bytes per piece, OpenMP's hand-over costs more than the piece.
constexpr int64_t kMinBytesPerPiece = 32 << 10;

std::optional<WeightType> weight_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return WeightType::kFloat32;
    case at::kBFloat16: return WeightType::kBFloat16;
    case at::kHalf: return WeightType::kFloat16;
    default: return std::nullopt;
  }
}

// What PanelArena packs: a floating weight, or int8 codes (to_int8_panels).
std::optional<WeightType> stored_type(at::ScalarType t) {
  return t == at::kChar ? std::optional<WeightType>(WeightType::kInt8) : weight_type(t);
}

bool packable_weight(const at::Tensor& w, bool any_device = false) {
  return w.defined() && (any_device || w.device().is_cpu()) && w.dim() == 2 && w.numel() > 0 &&
         weight_type(w.scalar_type()) && w.size(0) <= std::numeric_limits<int32_t>::max() &&
         w.size(1) <= std::numeric_limits<int32_t>::max();
}

// Refuses what aten::linear would refuse (with its words where users know them), and panels of another shape.
WeightType check_product(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, int64_t in_features) {
  const auto type = weight_type(panels.scalar_type());
  if (!type || panels.dim() != 1 || !panels.is_contiguous() ||
      panels.numel() != cpu::panel_elements(*type, out_features, in_features))
    throw Error(Status::InvalidArgument, "pipe::panel_linear: the panels do not hold a " +
                                             std::to_string(out_features) + " x " + std::to_string(in_features) +
                                             " weight (make them with to_panels)");
  if (!input.device().is_cpu())
    throw Error(Status::InvalidArgument,
                "pipe::panel_linear: the input is on " + input.device().str() + ", the stage's weights are on the CPU");
  if (input.scalar_type() != panels.scalar_type())
    throw Error(Status::InvalidArgument, std::string("pipe::panel_linear: the input is ") +
                                             c10::toString(input.scalar_type()) + ", the layer's weights are " +
                                             c10::toString(panels.scalar_type()) +
                                             " (mat1 and mat2 must have the same dtype)");
  if (input.dim() < 1 || input.size(-1) != in_features)
    throw Error(Status::InvalidArgument,
                "pipe::panel_linear: mat1 and mat2 shapes cannot be multiplied: the input's last "
                "dimension is " +
                    (input.dim() ? std::to_string(input.size(-1)) : std::string("missing")) + ", the layer takes " +
                    std::to_string(in_features) + " features");
  const at::Tensor* b = bias && bias->defined() ? &*bias : nullptr;
  if (b && (b->scalar_type() != panels.scalar_type() || b->numel() != out_features || !b->device().is_cpu()))
    throw Error(Status::InvalidArgument, "pipe::panel_linear: the bias must be " + std::to_string(out_features) + " " +
                                             c10::toString(panels.scalar_type()) + " values on the CPU");
  return *type;
}

// Runs products of one input on the lent cores in one hand-over: their output units are numbered one product after
// the other and cut into pieces, each unit computed as by its product alone (so grouping changes no bit). Then
// the products that follow are read ahead (warm_ahead.h). `unit_bytes`: the weight bytes of one unit.
void run_products(const std::vector<cpu::PanelProduct>& products, int64_t unit_bytes,
                  const std::vector<at::Tensor>& weights) {
  std::vector<int64_t> first_unit;  // of each product, in the units of all
  int64_t units = 0;
  for (const cpu::PanelProduct& p : products) {
    first_unit.push_back(units);
    units += cpu::panel_units(p.n);
  }
  SpareCores::for_ranges(units, kMinBytesPerPiece / std::max<int64_t>(unit_bytes, 1), kMaxUnitsPerPiece,
                         [&](int64_t begin, int64_t end) {
                           for (size_t i = 0; i < products.size(); ++i) {
                             const int64_t lo = std::max(begin, first_unit[i]);
                             const int64_t hi = std::min(end, first_unit[i] + cpu::panel_units(products[i].n));
                             if (lo < hi) cpu::panel_product(products[i], lo - first_unit[i], hi - first_unit[i]);
                           }
                         });
  warm_next_product(weights);
}

at::Tensor linear_op(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                     int64_t out_features, int64_t in_features) {
  const WeightType type = check_product(input, panels, bias, out_features, in_features);
  const at::Tensor* b = bias && bias->defined() ? &*bias : nullptr;
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  const at::Tensor bias_values = b ? b->contiguous() : at::Tensor();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = out_features;
  at::Tensor out = at::empty({x.size(0), out_features}, input.options());
  if (x.size(0) > 0) {
    cpu::PanelProduct p;
    p.type = type;
    p.x = x.data_ptr();
    p.ldx = in_features;
    p.panels = panels.data_ptr();
    p.bias = b ? bias_values.data_ptr() : nullptr;
    p.out = out.data_ptr();
    p.ldo = out_features;
    p.m = x.size(0);
    p.n = out_features;
    p.k = in_features;
    run_products({p}, cpu::kUnitWidth * in_features * static_cast<int64_t>(panels.element_size()), {panels});
  }
  return out.view(sizes);
}

// Several products of one input (a layer's q, k and v; gate and up) as one: one hand-over to the lent cores and
// one wait for them instead of one per product. Each output unit is computed as by linear_op alone, so the
// outputs have the same bits.
std::vector<at::Tensor> linear_group_op(const at::Tensor& input, const std::vector<at::Tensor>& panels,
                                        const std::vector<std::optional<at::Tensor>>& biases,
                                        const std::vector<int64_t>& out_features, int64_t in_features) {
  if (panels.empty() || panels.size() != biases.size() || panels.size() != out_features.size())
    throw Error(Status::InvalidArgument, "pipe::panel_linear_group: " + std::to_string(panels.size()) + " panels, " +
                                             std::to_string(biases.size()) + " biases and " +
                                             std::to_string(out_features.size()) + " output sizes: give one of each");
  std::vector<WeightType> types;
  for (size_t i = 0; i < panels.size(); ++i)
    types.push_back(check_product(input, panels[i], biases[i], out_features[i], in_features));
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  std::vector<at::Tensor> outs;
  std::vector<cpu::PanelProduct> products;
  std::vector<at::Tensor> bias_values;
  for (size_t i = 0; i < panels.size(); ++i) {
    outs.push_back(at::empty({x.size(0), out_features[i]}, input.options()));
    const at::Tensor* b = biases[i] && biases[i]->defined() ? &*biases[i] : nullptr;
    bias_values.push_back(b ? b->contiguous() : at::Tensor());
    cpu::PanelProduct p;
    p.type = types[i];
    p.x = x.data_ptr();
    p.ldx = in_features;
    p.panels = panels[i].data_ptr();
    p.bias = b ? bias_values.back().data_ptr() : nullptr;
    p.out = outs.back().data_ptr();
    p.ldo = out_features[i];
    p.m = x.size(0);
    p.n = out_features[i];
    p.k = in_features;
    products.push_back(p);
  }
  if (x.size(0) > 0) {
    run_products(products, cpu::kUnitWidth * in_features * static_cast<int64_t>(panels[0].element_size()), panels);
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    sizes.back() = out_features[i];
    outs[i] = outs[i].view(sizes);
  }
  return outs;
}

// A product's rows as quantize_rows makes them, in buffers of the calling thread that only grow: a decode step's 210
// products (SmolLM2) would otherwise allocate three tensors each. The helpers that share the product read them
// while the calling thread waits for them in SpareCores::for_ranges.
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> sums;
};

QuantizedRows& quantize_rows_here(const at::Tensor& x, int64_t in_features, int64_t depth) {
  thread_local QuantizedRows rows;
  const int64_t m = x.size(0), blocks = depth / cpu::kInt4RowBlock;
  if (rows.codes.size() < static_cast<size_t>(m * depth)) rows.codes.resize(m * depth);
  if (rows.scales.size() < static_cast<size_t>(m * blocks)) {
    rows.scales.resize(m * blocks);
    rows.sums.resize(m * blocks);
  }
  cpu::quantize_rows(x.data_ptr<float>(), in_features, in_features, depth, rows.codes.data(), rows.scales.data(),
                     rows.sums.data(), 0, m);
  return rows;
}

// Refusals of the quantized products, in the words of aten::linear where users know them. `op` names the operator.
void check_quantized_input(const std::string& op, const at::Tensor& input, int64_t in_features) {
  if (!input.device().is_cpu() || !at::isFloatingType(input.scalar_type()))
    throw Error(Status::InvalidArgument, op + ": the input must be floating on the CPU, not " +
                                             c10::toString(input.scalar_type()) + " on " + input.device().str());
  if (input.dim() < 1 || input.size(-1) != in_features)
    throw Error(Status::InvalidArgument,
                op + ": mat1 and mat2 shapes cannot be multiplied: the input's last dimension is " +
                    (input.dim() ? std::to_string(input.size(-1)) : std::string("missing")) + ", the layer takes " +
                    std::to_string(in_features) + " features");
}

const at::Tensor* checked_bias(const std::string& op, const std::optional<at::Tensor>& bias, int64_t out_features) {
  const at::Tensor* b = bias && bias->defined() ? &*bias : nullptr;
  if (b && (b->numel() != out_features || !b->device().is_cpu() || !at::isFloatingType(b->scalar_type())))
    throw Error(Status::InvalidArgument,
                op + ": the bias must be " + std::to_string(out_features) + " floating values on the CPU");
  return b;
}

void check_int8_panels(const std::string& op, const at::Tensor& panels, const at::Tensor& scales, int64_t out_features,
                       int64_t in_features) {
  if (panels.scalar_type() != at::kChar || panels.dim() != 1 || !panels.is_contiguous() ||
      panels.numel() != cpu::panel_elements(WeightType::kInt8, out_features, in_features))
    throw Error(Status::InvalidArgument, op + ": the panels do not hold a " + std::to_string(out_features) + " x " +
                                             std::to_string(in_features) +
                                             " int8 weight (make them with to_int8_panels)");
  if (scales.scalar_type() != at::kFloat || scales.numel() != out_features || !scales.is_contiguous() ||
      !scales.device().is_cpu())
    throw Error(Status::InvalidArgument,
                op + ": the scales must be " + std::to_string(out_features) + " contiguous float32 values on the CPU");
}

void check_int4_panels(const std::string& op, const at::Tensor& panels, int64_t out_features, int64_t in_features,
                       int64_t group) {
  if (!valid_int4_group(group))
    throw Error(Status::InvalidArgument, op + ": the group size is " + std::to_string(group) + ", not 32, 64 or 128");
  if (panels.scalar_type() != at::kByte || panels.dim() != 1 || !panels.is_contiguous() || out_features <= 0 ||
      in_features <= 0 || panels.numel() != cpu::int4_panel_bytes(out_features, in_features, group))
    throw Error(Status::InvalidArgument, op + ": the panels do not hold a " + std::to_string(out_features) + " x " +
                                             std::to_string(in_features) + " int4 weight in groups of " +
                                             std::to_string(group) + " (make them with PanelArena::pack_int4)");
}

// One layer of a quantized product, checked.
struct QuantizedLayer {
  const at::Tensor* panels;
  const at::Tensor* scales;  // int8: a float32 scale per output feature; int4: null (the panels hold theirs)
  const at::Tensor* bias;    // null: none
  int64_t out_features;
};

// Products of one input by quantized panels of one kind (int8, or int4 in groups of `group`): the rows go to
// float32, then to int8 per block of 32 once, on the calling thread (the same codes for any sharing); each layer is
// multiplied in integers per 16 outputs, all of them in one hand-over to the lent cores. A unit's outputs are
// computed as for its layer alone, so grouping layers changes no bit. The results come back in the input's dtype.
std::vector<at::Tensor> quantized_products(const at::Tensor& input, WeightType type,
                                           const std::vector<QuantizedLayer>& layers, int64_t in_features,
                                           int64_t group) {
  const at::Tensor x = input.reshape({-1, in_features}).to(at::kFloat).contiguous();
  const int64_t m = x.size(0);
  const int64_t depth = type == WeightType::kInt4 ? cpu::int4_depth(in_features, group)
                                                  : cpu::panel_depth(WeightType::kInt8, in_features);
  std::vector<at::Tensor> outs, bias_values;
  std::vector<cpu::PanelProduct> products;
  for (const QuantizedLayer& layer : layers) {
    outs.push_back(at::empty({m, layer.out_features}, input.options().dtype(at::kFloat)));
    bias_values.push_back(layer.bias ? layer.bias->to(at::kFloat).contiguous() : at::Tensor());
    cpu::PanelProduct p;
    p.type = type;
    p.group = type == WeightType::kInt4 ? group : 0;
    p.panels = layer.panels->data_ptr();
    p.scales = layer.scales ? layer.scales->data_ptr<float>() : nullptr;
    p.bias = layer.bias ? bias_values.back().data_ptr() : nullptr;
    p.out = outs.back().data_ptr();
    p.ldo = layer.out_features;
    p.m = m;
    p.n = layer.out_features;
    p.k = depth;
    products.push_back(p);
  }
  if (m > 0) {
    const QuantizedRows& rows = quantize_rows_here(x, in_features, depth);
    for (cpu::PanelProduct& p : products) {
      p.xq = rows.codes.data();
      p.xscales = rows.scales.data();
      p.xsums = rows.sums.data();
    }
    std::vector<at::Tensor> weights;
    for (const QuantizedLayer& layer : layers) weights.push_back(*layer.panels);
    run_products(products, type == WeightType::kInt4 ? cpu::kUnitWidth * depth / 2 : cpu::kUnitWidth * depth, weights);
  }
  std::vector<int64_t> sizes = input.sizes().vec();
  for (size_t i = 0; i < outs.size(); ++i) {
    sizes.back() = layers[i].out_features;
    outs[i] = outs[i].to(input.scalar_type()).view(sizes);
  }
  return outs;
}

// A product by int8 panels (to_int8_panels): rows quantized per block of 32 as for int4, see quantized_products.
at::Tensor linear_int8_op(const at::Tensor& input, const at::Tensor& panels, const at::Tensor& scales,
                          const std::optional<at::Tensor>& bias, int64_t out_features, int64_t in_features) {
  const std::string op = "pipe::panel_linear_int8";
  check_int8_panels(op, panels, scales, out_features, in_features);
  check_quantized_input(op, input, in_features);
  const at::Tensor* b = checked_bias(op, bias, out_features);
  return quantized_products(input, WeightType::kInt8, {{&panels, &scales, b, out_features}}, in_features, 0)[0];
}

// A product by int4 panels (PanelArena::pack_int4), see quantized_products.
at::Tensor linear_int4_op(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                          int64_t out_features, int64_t in_features, int64_t group) {
  const std::string op = "pipe::panel_linear_int4";
  check_int4_panels(op, panels, out_features, in_features, group);
  check_quantized_input(op, input, in_features);
  const at::Tensor* b = checked_bias(op, bias, out_features);
  return quantized_products(input, WeightType::kInt4, {{&panels, nullptr, b, out_features}}, in_features, group)[0];
}

// Several int8 products of one input (a layer's q, k and v; gate and up) as one: the rows quantized once, one
// hand-over to the lent cores and one wait for them instead of one per product; the same bits as one by one.
std::vector<at::Tensor> linear_int8_group_op(const at::Tensor& input, const std::vector<at::Tensor>& panels,
                                             const std::vector<at::Tensor>& scales,
                                             const std::vector<std::optional<at::Tensor>>& biases,
                                             const std::vector<int64_t>& out_features, int64_t in_features) {
  const std::string op = "pipe::panel_linear_int8_group";
  if (panels.empty() || panels.size() != scales.size() || panels.size() != biases.size() ||
      panels.size() != out_features.size())
    throw Error(Status::InvalidArgument, op + ": " + std::to_string(panels.size()) + " panels, " +
                                             std::to_string(scales.size()) + " scales, " +
                                             std::to_string(biases.size()) + " biases and " +
                                             std::to_string(out_features.size()) + " output sizes: give one of each");
  check_quantized_input(op, input, in_features);
  std::vector<QuantizedLayer> layers;
  for (size_t i = 0; i < panels.size(); ++i) {
    check_int8_panels(op, panels[i], scales[i], out_features[i], in_features);
    layers.push_back({&panels[i], &scales[i], checked_bias(op, biases[i], out_features[i]), out_features[i]});
  }
  return quantized_products(input, WeightType::kInt8, layers, in_features, 0);
}

// The same for int4 products of one group size.
std::vector<at::Tensor> linear_int4_group_op(const at::Tensor& input, const std::vector<at::Tensor>& panels,
                                             const std::vector<std::optional<at::Tensor>>& biases,
                                             const std::vector<int64_t>& out_features, int64_t in_features,
                                             int64_t group) {
  const std::string op = "pipe::panel_linear_int4_group";
  if (panels.empty() || panels.size() != biases.size() || panels.size() != out_features.size())
    throw Error(Status::InvalidArgument, op + ": " + std::to_string(panels.size()) + " panels, " +
                                             std::to_string(biases.size()) + " biases and " +
                                             std::to_string(out_features.size()) + " output sizes: give one of each");
  check_quantized_input(op, input, in_features);
  std::vector<QuantizedLayer> layers;
  for (size_t i = 0; i < panels.size(); ++i) {
    check_int4_panels(op, panels[i], out_features[i], in_features, group);
    layers.push_back({&panels[i], nullptr, checked_bias(op, biases[i], out_features[i]), out_features[i]});
  }
  return quantized_products(input, WeightType::kInt4, layers, in_features, group);
}

at::Tensor embedding_op(const at::Tensor& panels, const at::Tensor& indices, int64_t num_embeddings,
                        int64_t embedding_dim) {
  const auto type = weight_type(panels.scalar_type());
  if (!type || panels.dim() != 1 || !panels.is_contiguous() ||
      panels.numel() != cpu::panel_elements(*type, num_embeddings, embedding_dim))
    throw Error(Status::InvalidArgument, "pipe::panel_embedding: the panels do not hold a " +
                                             std::to_string(num_embeddings) + " x " + std::to_string(embedding_dim) +
                                             " weight");
  if (indices.scalar_type() != at::kLong && indices.scalar_type() != at::kInt)
    throw Error(Status::InvalidArgument, std::string("pipe::panel_embedding: indices must be int64 or int32, not ") +
                                             c10::toString(indices.scalar_type()));
  const at::Tensor ids = indices.to(at::kLong).contiguous();
  std::vector<int64_t> sizes = ids.sizes().vec();
  sizes.push_back(embedding_dim);
  at::Tensor out = at::empty(sizes, panels.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  char* o = static_cast<char*>(out.data_ptr());
  const size_t row_bytes = static_cast<size_t>(embedding_dim) * panels.element_size();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (id[i] < 0 || id[i] >= num_embeddings)
      throw Error(Status::InvalidArgument,
                  "pipe::panel_embedding: index out of range in self: " + std::to_string(id[i]) + " is not in 0 .. " +
                      std::to_string(num_embeddings - 1));
    cpu::unpack_row(*type, panels.data_ptr(), num_embeddings, embedding_dim, id[i], o + i * row_bytes);
  }
  return out;
}

at::Tensor embedding_int8_op(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& indices,
                             at::ScalarType dtype) {
  if (codes.scalar_type() != at::kChar || codes.dim() != 2 || !codes.is_contiguous() ||
      scales.scalar_type() != at::kFloat || scales.dim() != 1 || scales.size(0) != codes.size(0) ||
      !scales.is_contiguous())
    throw Error(Status::InvalidArgument,
                "pipe::embedding_int8: the table is not 2-d int8 codes with a float32 scale per row (quantize_int8)");
  if (indices.scalar_type() != at::kLong && indices.scalar_type() != at::kInt)
    throw Error(Status::InvalidArgument, std::string("pipe::embedding_int8: indices must be int64 or int32, not ") +
                                             c10::toString(indices.scalar_type()));
  const int64_t rows = codes.size(0), dim = codes.size(1);
  const at::Tensor ids = indices.to(at::kLong).contiguous();
  std::vector<int64_t> sizes = ids.sizes().vec();
  sizes.push_back(dim);
  // float32 first, as the reference dequantizes (code * scale), then the table's dtype in one rounding.
  at::Tensor out = at::empty({ids.numel(), dim}, at::kFloat);
  const int64_t* id = ids.data_ptr<int64_t>();
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (id[i] < 0 || id[i] >= rows)
      throw Error(Status::InvalidArgument, "pipe::embedding_int8: index out of range in self: " +
                                               std::to_string(id[i]) + " is not in 0 .. " + std::to_string(rows - 1));
    const int8_t* row = c + id[i] * dim;
    for (int64_t j = 0; j < dim; ++j) o[i * dim + j] = static_cast<float>(row[j]) * s[id[i]];
  }
  return out.to(dtype).view(sizes);
}

void register_panel_ops_once() {
  static const bool once = [] {
    if (c10::Dispatcher::singleton().findSchema({"pipe::panel_linear", ""}).has_value()) return true;
    static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
    lib.def(torch::schema("pipe::panel_linear(Tensor input, Tensor panels, Tensor? bias, int out_features, "
                          "int in_features) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_op);
    lib.def(torch::schema("pipe::panel_linear_int8(Tensor input, Tensor panels, Tensor scales, Tensor? bias, "
                          "int out_features, int in_features) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_int8_op);
    lib.def(torch::schema("pipe::panel_linear_int4(Tensor input, Tensor panels, Tensor? bias, int out_features, "
                          "int in_features, int group) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_int4_op);
    lib.def(torch::schema("pipe::panel_embedding(Tensor panels, Tensor indices, int num_embeddings, "
                          "int embedding_dim) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &embedding_op);
    lib.def(torch::schema("pipe::embedding_int8(Tensor codes, Tensor scales, Tensor indices, ScalarType dtype) -> "
                          "Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &embedding_int8_op);
    lib.def(torch::schema("pipe::panel_linear_group(Tensor input, Tensor[] panels, Tensor?[] biases, "
                          "int[] out_features, int in_features) -> Tensor[]",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_group_op);
    lib.def(torch::schema("pipe::panel_linear_int8_group(Tensor input, Tensor[] panels, Tensor[] scales, "
                          "Tensor?[] biases, int[] out_features, int in_features) -> Tensor[]",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_int8_group_op);
    lib.def(torch::schema("pipe::panel_linear_int4_group(Tensor input, Tensor[] panels, Tensor?[] biases, "
                          "int[] out_features, int in_features, int group) -> Tensor[]",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_int4_group_op);
    return true;
  }();
  (void)once;
}

thread_local PanelWeights* current_weights = nullptr;

at::Tensor linear_packed_on_demand(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  if (!current_weights) return at::linear(input, weight, bias);
  const at::Tensor& panels = current_weights->panels(weight);
  if (!panels.defined() || input.scalar_type() != weight.scalar_type()) return at::linear(input, weight, bias);
  return linear_op(input, panels, bias, weight.size(0), weight.size(1));
}

at::Tensor linear_int8_on_demand(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  if (!current_weights) return at::linear(input, weight, bias);
  const PanelWeights::Int8Panels& q = current_weights->int8_panels(weight);
  if (!q.panels.defined() || !at::isFloatingType(input.scalar_type())) return at::linear(input, weight, bias);
  return linear_int8_op(input, q.panels, q.scales, bias, weight.size(0), weight.size(1));
}

at::Tensor linear_int4_on_demand(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  if (!current_weights) return at::linear(input, weight, bias);
  const at::Tensor& panels = current_weights->int4_panels(weight);
  if (!panels.defined() || !at::isFloatingType(input.scalar_type())) return at::linear(input, weight, bias);
  return linear_int4_op(input, panels, bias, weight.size(0), weight.size(1), current_weights->int4_group);
}

}  // namespace

PanelArena::PanelArena(const std::vector<size_t>& bytes) {
  size_t total = 0;
  for (size_t b : bytes) {
    offsets_.push_back(total);
    total += (b + 4095) / 4096 * 4096;
  }
  buffer_ = std::make_shared<cpu::HugePageBuffer>(total);
}

size_t PanelArena::int4_bytes(int64_t n, int64_t k, int64_t group) {
  return static_cast<size_t>(cpu::int4_panel_bytes(n, k, group));
}

at::Tensor PanelArena::pack_int4(size_t i, const Int4Weight& q, int64_t k) {
  const int64_t n = q.codes.size(0);
  void* data = static_cast<char*>(buffer_->data()) + offsets_[i];
  const at::Tensor codes = q.codes.contiguous(), scales = q.scales.contiguous();
  at::parallel_for(0, (n + cpu::kPanelWidth - 1) / cpu::kPanelWidth, 1, [&](int64_t begin, int64_t end) {
    cpu::pack_int4_panels(codes.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), n, k, q.group,
                          data, begin, end);
  });
  std::shared_ptr<cpu::HugePageBuffer> keep = buffer_;
  return at::from_blob(
      data, {cpu::int4_panel_bytes(n, k, q.group)}, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

PanelArena::PanelArena(const std::vector<at::Tensor>& weights) {
  size_t total = 0;
  for (const auto& w : weights) {
    offsets_.push_back(total);
    total += (bytes_of(w) + 4095) / 4096 * 4096;
  }
  buffer_ = std::make_shared<cpu::HugePageBuffer>(total);
}

at::Tensor PanelArena::pack(size_t i, const at::Tensor& weight) {
  const WeightType type = *stored_type(weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  void* data = static_cast<char*>(buffer_->data()) + offsets_[i];
  const at::Tensor w = weight.contiguous();
  at::parallel_for(0, (n + cpu::kPanelWidth - 1) / cpu::kPanelWidth, 1,
                   [&](int64_t begin, int64_t end) { cpu::pack_panels(type, w.data_ptr(), n, k, data, begin, end); });
  std::shared_ptr<cpu::HugePageBuffer> keep = buffer_;
  return at::from_blob(
      data, {cpu::panel_elements(type, n, k)}, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(weight.scalar_type()).device(at::kCPU));
}

size_t PanelArena::bytes_of(const at::Tensor& w) {
  return static_cast<size_t>(cpu::panel_elements(*stored_type(w.scalar_type()), w.size(0), w.size(1))) *
         w.element_size();
}

bool panel_linear_available() {
  if (!cpu::cpu_has_panel_kernels()) return false;
  const char* env = std::getenv("LIBPIPE_PACKED_LINEAR");
  return !(env && std::strcmp(env, "0") == 0);
}

bool can_pack(const at::Tensor& weight, bool any_device) { return packable_weight(weight, any_device); }

size_t stored_panel_bytes(int64_t n, int64_t k, at::ScalarType dtype, WeightQuantization as, int64_t group) {
  const auto meta = [&](at::ScalarType t) { return at::empty({n, k}, at::TensorOptions().dtype(t).device(at::kMeta)); };
  switch (as) {
    case WeightQuantization::Int4: return PanelArena::int4_bytes(n, k, group ? group : kDefaultInt4Group);
    case WeightQuantization::Int8:
      return PanelArena::bytes_of(meta(at::kChar)) + static_cast<size_t>(n) * sizeof(float);
    case WeightQuantization::None: break;
  }
  return PanelArena::bytes_of(meta(dtype));
}

void register_panel_ops() { register_panel_ops_once(); }

at::Tensor to_panels(const at::Tensor& weight) { return to_panels(std::vector<at::Tensor>{weight})[0]; }

std::vector<at::Tensor> to_panels(const std::vector<at::Tensor>& weights) {
  std::vector<at::Tensor> packable_ones;
  for (const auto& w : weights)
    if (packable_weight(w)) packable_ones.push_back(w);
  std::vector<at::Tensor> out(weights.size());
  if (packable_ones.empty()) return out;
  PanelArena arena(packable_ones);
  for (size_t i = 0, j = 0; i < weights.size(); ++i)
    if (packable_weight(weights[i])) {
      out[i] = arena.pack(j, weights[i]);
      ++j;
    }
  return out;
}

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t in_features) {
  return linear_op(input, panels, bias, out_features, in_features);
}

Int8Weight quantize_int8(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  Int8Weight q{at::empty({n, k}, at::TensorOptions().dtype(at::kChar)), at::empty({n}, at::kFloat)};
  // A block of rows at a time: the temporaries of a 128256 x 2048 head in float32 would be gigabytes.
  constexpr int64_t kRowsPerBlock = 1024;
  for (int64_t r = 0; r < n; r += kRowsPerBlock) {
    const int64_t rows = std::min(kRowsPerBlock, n - r);
    const at::Tensor w = weight.narrow(0, r, rows).to(at::kFloat);
    // Symmetric per output feature: the largest magnitude maps to 127; an all-zero row keeps scale 1.
    at::Tensor scales = w.abs().amax(1) / 127.0;
    scales = at::where(scales > 0, scales, at::ones_like(scales));
    q.scales.narrow(0, r, rows).copy_(scales);
    q.codes.narrow(0, r, rows).copy_(at::round(w / scales.unsqueeze(1)).clamp(-127, 127));
  }
  return q;
}

bool valid_int4_group(int64_t group) { return group == 32 || group == 64 || group == 128; }

Int4Weight quantize_int4(const at::Tensor& weight, int64_t group) {
  if (!valid_int4_group(group))
    throw Error(Status::InvalidArgument,
                "int4 weights take groups of 32, 64 or 128 inputs, not " + std::to_string(group));
  const int64_t n = weight.size(0), k = weight.size(1), depth = cpu::int4_depth(k, group), groups = depth / group;
  Int4Weight q{at::empty({n, depth}, at::TensorOptions().dtype(at::kChar)), at::empty({n, groups}, at::kHalf), group};
  constexpr int64_t kRowsPerBlock = 1024;  // the temporaries of a block of rows only (quantize_int8)
  for (int64_t r = 0; r < n; r += kRowsPerBlock) {
    const int64_t rows = std::min(kRowsPerBlock, n - r);
    at::Tensor w = weight.narrow(0, r, rows).to(at::kFloat);
    if (depth != k) w = at::constant_pad_nd(w, {0, depth - k});
    w = w.view({rows, groups, group});
    // Q4_0: the value of largest magnitude (the first such) maps to -8; the scale as float16 holds it.
    const at::Tensor extreme = w.gather(2, w.abs().argmax(2, true));
    const at::Tensor scales = (extreme / -8.0).to(at::kHalf).squeeze(2);
    const at::Tensor s = scales.to(at::kFloat).unsqueeze(2);
    const at::Tensor codes = at::where(s != 0, at::round(w / s), at::zeros_like(w)).clamp(-8, 7);
    q.scales.narrow(0, r, rows).copy_(scales);
    q.codes.narrow(0, r, rows).copy_(codes.view({rows, depth}));
  }
  return q;
}

at::Tensor dequantize_int4(const Int4Weight& q, int64_t k) {
  const int64_t n = q.codes.size(0), depth = q.codes.size(1);
  const at::Tensor w =
      q.codes.to(at::kFloat).view({n, depth / q.group, q.group}) * q.scales.to(at::kFloat).unsqueeze(2);
  return w.view({n, depth}).narrow(1, 0, k).contiguous();
}

at::Tensor panel_linear_int4(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                             int64_t out_features, int64_t in_features, int64_t group) {
  return linear_int4_op(input, panels, bias, out_features, in_features, group);
}

at::Tensor panel_linear_int8(const at::Tensor& input, const at::Tensor& panels, const at::Tensor& scales,
                             const std::optional<at::Tensor>& bias, int64_t out_features, int64_t in_features) {
  return linear_int8_op(input, panels, scales, bias, out_features, in_features);
}

at::Tensor panel_embedding(const at::Tensor& panels, const at::Tensor& indices, int64_t num_embeddings,
                           int64_t embedding_dim) {
  return embedding_op(panels, indices, num_embeddings, embedding_dim);
}

at::Tensor embedding_int8(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& indices,
                          at::ScalarType dtype) {
  return embedding_int8_op(codes, scales, indices, dtype);
}

PanelWeights::Use::Use(PanelWeights& weights) : previous_(current_weights) { current_weights = &weights; }
PanelWeights::Use::~Use() { current_weights = previous_; }

const at::Tensor& PanelWeights::panels(const at::Tensor& weight) {
  auto [it, fresh] = panels_.try_emplace(weight.data_ptr());
  if (fresh) it->second = to_panels(weight);
  return it->second;
}

const PanelWeights::Int8Panels& PanelWeights::int8_panels(const at::Tensor& weight) {
  auto [it, fresh] = int8_.try_emplace(weight.data_ptr());
  if (fresh && can_pack(weight)) {
    Int8Weight q = quantize_int8(weight);
    PanelArena arena({q.codes});
    it->second = {arena.pack(0, q.codes), std::move(q.scales)};
  }
  return it->second;
}

const at::Tensor& PanelWeights::int4_panels(const at::Tensor& weight) {
  auto [it, fresh] = int4_.try_emplace(weight.data_ptr());
  if (fresh && can_pack(weight)) {
    const Int4Weight q = quantize_int4(weight, int4_group);
    PanelArena arena(std::vector<size_t>{PanelArena::int4_bytes(weight.size(0), weight.size(1), int4_group)});
    it->second = arena.pack_int4(0, q, weight.size(1));
  }
  return it->second;
}

bool register_linear_packed_on_demand() {
  static const bool available = [] {
    if (!panel_linear_available()) return false;
    register_panel_ops_once();
    if (!c10::Dispatcher::singleton().findSchema({"pipe::linear_packed_on_demand", ""}).has_value()) {
      static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
      lib.def(torch::schema("pipe::linear_packed_on_demand(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
                            c10::AliasAnalysisKind::FROM_SCHEMA),
              &linear_packed_on_demand);
      lib.def(torch::schema("pipe::linear_int8_on_demand(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
                            c10::AliasAnalysisKind::FROM_SCHEMA),
              &linear_int8_on_demand);
      lib.def(torch::schema("pipe::linear_int4_on_demand(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
                            c10::AliasAnalysisKind::FROM_SCHEMA),
              &linear_int4_on_demand);
    }
    return true;
  }();
  return available;
}

}  // namespace libpipe::stage
