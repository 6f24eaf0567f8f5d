#include "runtime/stage/torchscript/dtype_casts.h"

#include <ATen/core/jit_type.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/runtime/operator.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"

namespace libpipe::stage {

using torch::jit::Block;
using torch::jit::Node;
using torch::jit::Value;
namespace prim = torch::jit::prim;
namespace aten = torch::jit::aten;

namespace {

// What the analysis knows of a value's dtype once the model runs converted.
struct Kind {
  enum Tag : uint8_t {
    Other,     // not a tensor (an int, a module, None...)
    NotFloat,  // an integer or boolean tensor
    Float,     // a floating tensor of `dtype`
    Input,     // a forward argument: the target dtype if floating (the session converts it), or not floating
    Unknown,   // a tensor of a dtype only known at run time
    Seq,       // a tuple or list: `items`
  };
  // How a floating value got its dtype, which says what eager code would do where it meets a
  // value of another dtype.
  enum How : uint8_t {
    Computed,  // computed in it (arithmetic, a factory, a dtype argument, integers cast to it)
    Restored,  // cast to the dtype it already had: a float32 trace's `.to(input_dtype)`, which eager
               // code meant as a cast back to the activations' dtype
    Widened,   // cast from the target dtype: a copy of a target-dtype value that tracing also stands
               // in for the original with (a residual kept before `x = x.to(torch.float32)`)
  };
  Tag tag = Unknown;
  at::ScalarType dtype = at::kFloat;
  How how = Computed;
  bool scalar = false;           // Float: 0-dim, so promotion lets dimensioned operands decide
  const Node* origin = nullptr;  // Float: the node that fixed the dtype, for messages
  std::vector<Kind> items;       // Seq
  bool homogeneous = false;      // Seq of unknown length: items[0] stands for every element

  static Kind of(Tag tag) {
    Kind k;
    k.tag = tag;
    return k;
  }
  static Kind floating(at::ScalarType dtype, const Node* origin, How how = Computed, bool scalar = false) {
    Kind k = of(Float);
    k.dtype = dtype;
    k.origin = origin;
    k.how = how;
    k.scalar = scalar;
    return k;
  }
  bool operator==(const Kind& o) const {
    return tag == o.tag && (tag != Float || (dtype == o.dtype && how == o.how)) && homogeneous == o.homogeneous &&
           items == o.items;
  }
  bool operator!=(const Kind& o) const { return !(*this == o); }
};

Kind merge(const Kind& a, const Kind& b) {
  if (a == b) return a;
  if (a.tag == Kind::Float && b.tag == Kind::Float && a.dtype == b.dtype) {
    Kind k = a;
    k.how = Kind::Computed;
    return k;
  }
  if (a.tag == Kind::Seq && b.tag == Kind::Seq && a.homogeneous == b.homogeneous && a.items.size() == b.items.size()) {
    Kind k = a;
    for (size_t i = 0; i < k.items.size(); ++i) k.items[i] = merge(a.items[i], b.items[i]);
    return k;
  }
  return Kind::of(a.tag == Kind::Other && b.tag == Kind::Other ? Kind::Other : Kind::Unknown);
}

bool is_tensor(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::TensorType) return true;
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::TensorType;
  return false;
}

bool is_tensor_list(const c10::TypePtr& t) {
  auto list = t->cast<c10::ListType>();
  return list && is_tensor(list->getElementType());
}

// A kind for an output of type `t` whose tensors are `k`.
Kind shaped(const c10::TypePtr& t, const Kind& k) {
  if (is_tensor(t)) return k;
  if (is_tensor_list(t)) {
    Kind seq = Kind::of(Kind::Seq);
    seq.homogeneous = true;
    seq.items.push_back(k);
    return seq;
  }
  return Kind::of(t->kind() == c10::TypeKind::ListType || t->kind() == c10::TypeKind::TupleType ? Kind::Unknown
                                                                                                : Kind::Other);
}

// clang-format off
const std::set<std::string> kNotFloatOutputs = {
    "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "isreal", "signbit",
    "logical_and", "logical_or", "logical_not", "logical_xor", "__and__", "__or__", "__xor__", "__invert__",
    "__lshift__", "__rshift__", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "argmax", "argmin",
    "argsort", "nonzero", "nonzero_static", "argwhere", "searchsorted", "bucketize", "count_nonzero", "any", "all",
    "isin", "isclose", "bincount", "multinomial", "randint", "randint_like", "randperm", "tril_indices",
    "triu_indices", "_shape_as_tensor"};

// Operations returning (values, indices...): the outputs after the first are integer tensors.
const std::set<std::string> kIndicesAfterFirst = {
    "max", "min", "sort", "topk", "kthvalue", "mode", "median", "nanmedian", "cummax", "cummin", "frexp",
    "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "_unique2", "unique_consecutive", "unique_dim", "_unique"};

// Operations that compute in floating point whatever their operands (integer operands give the
// default dtype).
const std::set<std::string> kFloatFromIntegers = {
    "div", "true_divide", "reciprocal", "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "sigmoid", "erf", "erfc",
    "erfinv", "mean", "std", "var", "softmax", "log_softmax", "logsumexp", "lgamma", "digamma"};

// Factories that make the default (floating) dtype when none is given.
const std::set<std::string> kFloatFactories = {
    "zeros", "ones", "empty", "empty_strided", "rand", "randn", "eye", "linspace", "logspace", "normal"};
// Factories whose dtype, when none is given, follows their scalar arguments.
const std::set<std::string> kScalarFactories = {"arange", "full", "scalar_tensor"};

// Operations whose result holds values of their first operand, moved or copied (the cast behind
// them still tells what eager code meant).
const std::set<std::string> kMoves = {
    "unsqueeze", "squeeze", "view", "reshape", "transpose", "t", "permute", "expand", "expand_as", "slice", "select",
    "narrow", "contiguous", "flatten", "unflatten", "chunk", "split", "split_with_sizes", "tensor_split", "unbind",
    "clone", "detach", "dropout", "feature_dropout", "alpha_dropout", "alias", "movedim", "view_as", "reshape_as",
    "repeat", "repeat_interleave", "index", "index_select", "gather", "take", "masked_select", "__getitem__"};

// Operations that need one dtype for their floating operands (PyTorch does not promote them).
const std::set<std::string> kOneDtype = {
    "matmul", "mm", "bmm", "mv", "dot", "vdot", "linear", "bilinear", "addmm", "addmv", "addbmm", "baddbmm",
    "addr", "einsum", "tensordot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "_convolution", "scaled_dot_product_attention", "layer_norm",
    "native_layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "embedding", "embedding_bag",
    "index_put", "index_copy", "index_add", "scatter", "scatter_add", "scatter_reduce", "masked_scatter", "lerp",
    "addcmul", "addcdiv", "prelu", "grid_sampler", "lstm", "gru", "rnn_tanh", "rnn_relu"};

// Arguments that are indices or masks, never operands whose dtype a cast should change.
const std::set<std::string> kIndexArguments = {"index", "indices", "mask", "condition"};
// clang-format on

// The schema `n` calls. Node::maybeSchema would cache it in the node, a write to the model's
// graph, which sessions building stages on several threads share.
const c10::FunctionSchema* schema_of(const Node* n) {
  for (const auto& op : torch::jit::getAllOperatorsFor(n->kind()))
    if (n->matches(op->schema())) return &op->schema();
  return nullptr;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return c10::toString(t);
  }
}

// The largest finite value of a floating dtype.
double largest(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return static_cast<double>(std::numeric_limits<c10::Half>::max());
    case at::kBFloat16: return static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    case at::kFloat: return static_cast<double>(std::numeric_limits<float>::max());
    default: return std::numeric_limits<double>::max();
  }
}

}  // namespace

class DtypeAnalysis {
 public:
  DtypeAnalysis(const graph::Model& model, DtypeCasts& out)
      : model_(model), out_(out), self_(model.graph()->inputs()[0]) {}

  void run() {
    const auto& inputs = model_.graph()->inputs();
    for (size_t i = 1; i < inputs.size(); ++i) set(inputs[i], shaped(inputs[i]->type(), Kind::of(Kind::Input)));
    block(model_.graph()->block());
  }

 private:
  Kind state(const Value* v) const {
    auto it = env_.find(v);
    if (it != env_.end()) return it->second;
    return Kind::of(is_tensor(v->type()) || is_tensor_list(v->type()) ? Kind::Unknown : Kind::Other);
  }
  void set(const Value* v, Kind k) { env_[v] = std::move(k); }
  void set_outputs(const Node* n, const Kind& k) {
    for (const Value* o : n->outputs()) set(o, shaped(o->type(), k));
  }

  void block(Block* b) {
    for (Node* n : b->nodes()) node(n);
  }

  void node(Node* n) {
    const auto kind = n->kind();
    if (kind == prim::Constant) return constant(n);
    if (kind == prim::GetAttr) return attribute(n);
    if (kind == prim::If) return branch(n);
    if (kind == prim::Loop) return loop(n);
    if (kind == prim::ListConstruct || kind == prim::TupleConstruct) {
      Kind seq = Kind::of(Kind::Seq);
      for (const Value* v : n->inputs()) seq.items.push_back(state(v));
      return set(n->output(), seq);
    }
    if (kind == prim::ListUnpack || kind == prim::TupleUnpack) {
      const Kind seq = state(n->input(0));
      for (size_t i = 0; i < n->outputs().size(); ++i) set(n->output(i), item(seq, static_cast<int64_t>(i)));
      return;
    }
    if (kind == prim::TupleIndex || kind == aten::__getitem__) {
      auto index = torch::jit::toIValue(n->input(1));
      const Kind seq = state(n->input(0));
      if (seq.tag == Kind::Seq) return set(n->output(), item(seq, index && index->isInt() ? index->toInt() : -1));
    }
    if (kind == prim::NumToTensor) {
      const auto t = n->input()->type()->kind();
      return set(n->output(), t == c10::TypeKind::FloatType ? Kind::floating(at::kDouble, n, Kind::Computed, true)
                                                            : Kind::of(Kind::NotFloat));
    }
    if (kind == prim::unchecked_cast) return set(n->output(), state(n->input()));
    if (kind.is_aten()) return operation(n);
    set_outputs(n, Kind::of(Kind::Unknown));
  }

  // Element `i` of a sequence (-1: any of them).
  static Kind item(const Kind& seq, int64_t i) {
    if (seq.tag != Kind::Seq || seq.items.empty()) return Kind::of(Kind::Unknown);
    if (seq.homogeneous) return seq.items[0];
    if (i < 0) {
      Kind k = seq.items[0];
      for (const auto& other : seq.items) k = merge(k, other);
      return k;
    }
    return static_cast<size_t>(i) < seq.items.size() ? seq.items[i] : Kind::of(Kind::Unknown);
  }

  void constant(const Node* n) {
    auto value = torch::jit::toIValue(n->output());
    if (value && value->isTensor()) {
      const at::Tensor& t = value->toTensor();
      set(n->output(), at::isFloatingType(t.scalar_type())
                           ? Kind::floating(t.scalar_type(), n, Kind::Computed, t.dim() == 0)
                           : Kind::of(Kind::NotFloat));
    } else {
      set(n->output(), Kind::of(Kind::Other));
    }
  }

  // Parameters and buffers are converted with the weights; other tensor attributes keep their dtype.
  void attribute(const Node* n) {
    const auto path = graph::attribute_path(n->output(), self_);
    if (path.empty()) return set(n->output(), state_of_type(n->output()));
    c10::intrusive_ptr<c10::ivalue::Object> obj = model_.module()._ivalue();
    for (size_t i = 0; i + 1 < path.size(); ++i) obj = obj->getAttr(path[i]).toObject();
    const auto& type = obj->type();
    const auto slot = type->findAttributeSlot(path.back());
    if (!slot) return set(n->output(), state_of_type(n->output()));
    const c10::IValue& value = obj->getSlot(*slot);
    if (!value.isTensor()) return set(n->output(), shaped(n->output()->type(), Kind::of(Kind::Unknown)));
    const at::Tensor& t = value.toTensor();
    if (!at::isFloatingType(t.scalar_type())) return set(n->output(), Kind::of(Kind::NotFloat));
    const bool converted = type->is_parameter(*slot) || type->is_buffer(*slot);
    set(n->output(), Kind::floating(converted ? out_.target_ : t.scalar_type(), n, Kind::Computed, t.dim() == 0));
  }

  Kind state_of_type(const Value* v) const { return shaped(v->type(), Kind::of(Kind::Unknown)); }

  void branch(Node* n) {
    std::vector<Kind> outs(n->outputs().size());
    bool first = true;
    for (Block* b : n->blocks()) {
      block(b);
      for (size_t i = 0; i < outs.size(); ++i)
        outs[i] = first ? state(b->outputs()[i]) : merge(outs[i], state(b->outputs()[i]));
      first = false;
    }
    for (size_t i = 0; i < outs.size(); ++i) set(n->output(i), outs[i]);
  }

  // Carried values start as they enter and are merged with what the body hands back until that
  // settles; decisions are recorded on the last pass only, against the settled kinds.
  void loop(Node* n) {
    Block* body = n->blocks()[0];
    const size_t carried = n->outputs().size();
    std::vector<Kind> kinds;
    for (size_t i = 0; i < carried; ++i) kinds.push_back(state(n->input(2 + i)));
    const bool recording = recording_;
    recording_ = false;
    for (int pass = 0;; ++pass) {
      set(body->inputs()[0], Kind::of(Kind::Other));
      for (size_t i = 0; i < carried; ++i) set(body->inputs()[1 + i], kinds[i]);
      block(body);
      bool changed = false;
      for (size_t i = 0; i < carried; ++i) {
        Kind merged = merge(kinds[i], state(body->outputs()[1 + i]));
        if (pass >= 3 && merged != kinds[i]) merged = Kind::of(Kind::Unknown);
        changed |= merged != kinds[i];
        kinds[i] = merged;
      }
      if (!changed) break;
    }
    recording_ = recording;
    set(body->inputs()[0], Kind::of(Kind::Other));
    for (size_t i = 0; i < carried; ++i) set(body->inputs()[1 + i], kinds[i]);
    block(body);
    for (size_t i = 0; i < carried; ++i) set(n->output(i), kinds[i]);
  }

  struct Operand {
    Kind kind;
    const Node* owner;  // the node whose input it is (a list's construction for list elements)
    size_t input;
    bool castable;
  };

  void operation(Node* n) {
    const std::string name = n->kind().toUnqualString();
    const c10::FunctionSchema* schema = schema_of(n);
    if (!schema) return set_outputs(n, Kind::of(Kind::Unknown));
    // In place (and out=) operations keep the dtype of the tensor they write.
    if (schema->is_mutable()) return set_outputs(n, n->inputs().empty() ? Kind::of(Kind::Unknown) : state(n->input(0)));
    const bool cast = name == "to" || name == "type_as" || name == "_to_copy";
    const Kind self = n->inputs().empty() ? Kind::of(Kind::Other) : state(n->input(0));

    // An explicit dtype decides, whatever the operands.
    if (auto i = schema->argumentIndexWithName("dtype"); i && static_cast<size_t>(*i) < n->inputs().size()) {
      const Value* d = n->input(*i);
      if (auto value = torch::jit::toIValue(d)) {
        if (!value->isNone()) {
          const auto t = static_cast<at::ScalarType>(value->toInt());
          if (!at::isFloatingType(t)) return set_outputs(n, Kind::of(Kind::NotFloat));
          return set_outputs(n, cast ? cast_to(self, Kind::floating(t, n), n) : Kind::floating(t, n));
        }
      } else if (d->node()->kind() == prim::dtype) {
        const Kind like = state(d->node()->input());
        return set_outputs(n, cast ? cast_to(self, like, n) : retagged(like, n));
      } else {
        return set_outputs(n, Kind::of(Kind::Unknown));
      }
    }
    if (name == "to" || name == "type_as") {
      if (auto i = schema->argumentIndexWithName("other"); i && static_cast<size_t>(*i) < n->inputs().size())
        return set_outputs(n, cast_to(self, state(n->input(*i)), n));
    }
    if (kNotFloatOutputs.count(name)) return set_outputs(n, Kind::of(Kind::NotFloat));

    std::vector<Operand> operands;
    for (size_t i = 0; i < n->inputs().size(); ++i) {
      if (i < schema->arguments().size() && kIndexArguments.count(schema->arguments()[i].name())) continue;
      const Value* v = n->input(i);
      if (is_tensor(v->type())) {
        operands.push_back({state(v), n, i, true});
      } else if (is_tensor_list(v->type())) {
        const Node* list = v->node();
        if (list->kind() == prim::ListConstruct) {
          for (size_t j = 0; j < list->inputs().size(); ++j) operands.push_back({state(list->input(j)), list, j, true});
        } else {
          const Kind seq = state(v);
          if (seq.tag == Kind::Seq)
            for (const auto& k : seq.items) operands.push_back({k, nullptr, 0, false});
          else operands.push_back({Kind::of(Kind::Unknown), nullptr, 0, false});
        }
      }
    }

    // Moving values keeps them what they were (a cast back stays one through unsqueeze).
    if (kMoves.count(name) && operands.size() == 1 && operands[0].kind.tag != Kind::Seq) {
      Kind moved = operands[0].kind;
      moved.scalar = moved.scalar && name != "expand" && name != "repeat" && name != "expand_as";
      return set_outputs(n, moved);
    }

    reconcile(n, name, operands);
    set_outputs(n, result(n, name, operands));
    if (kIndicesAfterFirst.count(name))
      for (size_t i = 1; i < n->outputs().size(); ++i)
        set(n->output(i), shaped(n->output(i)->type(), Kind::of(Kind::NotFloat)));
  }

  // The result of casting `from` to the dtype of `to`: cast at the source dtype, it remembers what
  // it was cast from.
  Kind cast_to(const Kind& from, Kind to, const Node* n) const {
    if (to.tag != Kind::Float) return to.tag == Kind::Seq ? Kind::of(Kind::Unknown) : to;
    to.origin = n;
    to.scalar = from.tag == Kind::Float && from.scalar;
    to.how = Kind::Computed;
    if (to.dtype == out_.source_ && from.tag == Kind::Float) {
      if (from.dtype == out_.source_) to.how = Kind::Restored;
      else if (from.dtype == out_.target_) to.how = Kind::Widened;
    }
    return to;
  }

  // Where a value the trace fixed at the source dtype meets one of the target dtype, decides
  // whether it is cast to the target dtype there, and records the casts. Eager code cast back with
  // `.to(input_dtype)` (Restored) or kept the target-dtype original beside its widened copy
  // (Widened): both are cast. A value computed in the source dtype (Computed) is eager code
  // asking for it (`torch.arange(n, dtype=torch.float32)`): PyTorch promotes the operation to it
  // and so does the converted model, unless the operation needs one dtype for all operands.
  void reconcile(const Node* n, const std::string& name, std::vector<Operand>& operands) {
    const at::ScalarType target = out_.target_, source = out_.source_;
    auto dimensioned = [](const Operand& o, at::ScalarType t) {
      return o.kind.tag == Kind::Float && !o.kind.scalar && o.kind.dtype == t;
    };
    const bool one_dtype = kOneDtype.count(name) > 0;
    const bool meets_target =
        std::any_of(operands.begin(), operands.end(), [&](const Operand& o) { return dimensioned(o, target); });
    for (auto& o : operands) {
      if (!dimensioned(o, source)) continue;
      if (meets_target && (one_dtype || o.kind.how != Kind::Computed)) {
        if (recording_ && o.castable) out_.casts_[o.owner].push_back(o.input);
        if (recording_ && !o.castable)
          undecided(n, o, "in a list of tensors that the graph does not build where a cast could go");
        o.kind.dtype = target;
        o.kind.how = Kind::Computed;
      } else if (!meets_target && one_dtype) {
        for (const auto& other : operands)
          if (other.kind.tag == Kind::Input || other.kind.tag == Kind::Unknown) {
            if (recording_)
              undecided(n, o,
                        std::string("with ") + (other.kind.tag == Kind::Input ? "a forward argument" : "a value") +
                            " whose dtype is only known at run time");
            break;
          }
      }
    }
  }

  // The dtype an operation computes in, from its operands (after the casts decided for it).
  Kind result(const Node* n, const std::string& name, const std::vector<Operand>& operands) const {
    std::vector<const Kind*> floats, scalars;
    bool unknown = false, input = false;
    for (const auto& o : operands) {
      if (o.kind.tag == Kind::Float) (o.kind.scalar ? scalars : floats).push_back(&o.kind);
      unknown |= o.kind.tag == Kind::Unknown || o.kind.tag == Kind::Seq;
      input |= o.kind.tag == Kind::Input;
    }
    const bool only_scalars = floats.empty();
    // A 0-dim float beside a tensor that may be floating: which decides is only known at run time.
    if (only_scalars && (unknown || input) && !scalars.empty()) return Kind::of(Kind::Unknown);
    if (only_scalars) floats = scalars;
    if (!floats.empty()) {
      at::ScalarType t = floats[0]->dtype;
      for (const Kind* f : floats) t = c10::promoteTypes(t, f->dtype);
      const bool scalar = only_scalars && std::none_of(operands.begin(), operands.end(),
                                                       [](const Operand& o) { return o.kind.tag == Kind::NotFloat; });
      return Kind::floating(t, n, Kind::Computed, scalar);
    }
    if (unknown) return Kind::of(Kind::Unknown);
    const bool to_float = kFloatFromIntegers.count(name) > 0 && !rounds(n);
    if (input) return Kind::of(to_float ? Kind::Unknown : Kind::Input);
    if (operands.empty()) return factory(n, name);
    return to_float ? Kind::floating(default_dtype(), n) : Kind::of(Kind::NotFloat);
  }

  // div with a rounding mode keeps integers integral.
  static bool rounds(const Node* n) {
    const auto* schema = schema_of(n);
    auto i = schema ? schema->argumentIndexWithName("rounding_mode") : std::nullopt;
    if (!i || static_cast<size_t>(*i) >= n->inputs().size()) return false;
    auto value = torch::jit::toIValue(n->input(*i));
    return !value || !value->isNone();
  }

  Kind factory(const Node* n, const std::string& name) const {
    if (kFloatFactories.count(name)) return Kind::floating(default_dtype(), n);
    if (kScalarFactories.count(name)) {
      for (const Value* v : n->inputs())
        if (v->type()->kind() == c10::TypeKind::FloatType)
          return Kind::floating(default_dtype(), n, Kind::Computed, name == "scalar_tensor");
        else if (v->type()->kind() == c10::TypeKind::NumberType) return Kind::of(Kind::Unknown);
      return Kind::of(Kind::NotFloat);
    }
    return Kind::of(Kind::Unknown);
  }

  static at::ScalarType default_dtype() { return c10::typeMetaToScalarType(c10::get_default_dtype()); }

  // `k` as the result of `n`, which computes in its dtype.
  static Kind retagged(Kind k, const Node* n) {
    if (k.tag == Kind::Float) {
      k.origin = n;
      k.scalar = false;
      k.how = Kind::Computed;
    }
    return k;
  }

  std::string describe(const Node* n) const {
    std::string s = std::string("`") + n->kind().toQualString() + "`";
    // A loaded archive's ranges point into its serialized code; the Python behind it is better.
    auto range = n->sourceRange().findSourceRangeThatGenerated();
    if (auto loc = (range ? *range : n->sourceRange()).file_line_col())
      s += " at " + std::get<0>(*loc) + ":" + std::to_string(std::get<1>(*loc));
    const auto& sites = model_.sites_of(n);
    if (!sites.empty()) s += " (in module '" + model_.call_sites()[sites.back()].path + "')";
    return s;
  }

  // Records why `n` cannot be converted: its operand `fixed` holds a value the trace fixed at the
  // source dtype, and `why` says what keeps the cast from being decided.
  void undecided(const Node* n, const Operand& fixed, const std::string& why) {
    if (out_.undecided_.count(n)) return;
    const std::string source = dtype_name(out_.source_), target = dtype_name(out_.target_);
    const std::string by = fixed.kind.origin ? " (by " + describe(fixed.kind.origin) + ")" : "";
    out_.undecided_[n] = "converting this " + source + " model to " + target + ": " + describe(n) +
                         " combines a value the trace fixed at " + source + by + " " + why +
                         ", so it cannot be given the cast to " + target + " that eager " + target +
                         " code would have; trace the model after model.to(torch." + target + ") with " + target +
                         " example inputs and run it without a dtype, or run it in " + source;
  }

  const graph::Model& model_;
  DtypeCasts& out_;
  const Value* self_;
  std::unordered_map<const Value*, Kind> env_;
  bool recording_ = true;
};

namespace {

// The dtype of most of the model's floating parameters and buffers, by elements.
at::ScalarType weights_dtype(const torch::jit::Module& module) {
  std::map<at::ScalarType, int64_t> elements;
  for (const auto& p : module.named_parameters())
    if (at::isFloatingType(p.value.scalar_type())) elements[p.value.scalar_type()] += p.value.numel();
  for (const auto& b : module.named_buffers())
    if (at::isFloatingType(b.value.scalar_type())) elements[b.value.scalar_type()] += b.value.numel();
  at::ScalarType best = at::kFloat;
  int64_t most = -1;
  for (const auto& [t, n] : elements)
    if (n > most) best = t, most = n;
  return best;
}

// x cast to `target`, saturating at its finite range when that is narrower than `source`'s.
Value* saturating_cast(torch::jit::Graph& g, Value* x, at::ScalarType source, at::ScalarType target) {
  if (largest(target) < largest(source)) {
    const double m = largest(target);
    x = g.insert(aten::clamp, {x, -m, m});
  }
  return g.insert(aten::to, {x, static_cast<int64_t>(target), false, false});
}

size_t apply_to(const DtypeCasts& casts, const std::unordered_map<const Node*, std::vector<size_t>>& decided,
                const std::unordered_map<const Node*, std::string>& undecided, const Node* original, Node* clone,
                size_t stage_index) {
  if (auto it = undecided.find(original); it != undecided.end())
    throw Error(Status::Unsupported, "stage " + std::to_string(stage_index) + ": " + it->second);
  size_t inserted = 0;
  if (auto it = decided.find(original); it != decided.end()) {
    torch::jit::WithInsertPoint here(clone);
    std::set<size_t> done;
    for (size_t i : it->second) {
      if (!done.insert(i).second) continue;
      clone->replaceInput(i, saturating_cast(*clone->owningGraph(), clone->input(i), casts.source(), casts.target()));
      ++inserted;
    }
  }
  for (size_t b = 0; b < original->blocks().size(); ++b) {
    auto from = original->blocks()[b]->nodes().begin();
    auto to = clone->blocks()[b]->nodes().begin();
    // Casts go before their node, so the node after each is still the next one's copy.
    for (; from != original->blocks()[b]->nodes().end(); ++from, ++to)
      inserted += apply_to(casts, decided, undecided, *from, *to, stage_index);
  }
  return inserted;
}

}  // namespace

DtypeCasts::DtypeCasts(const graph::Model& model, at::ScalarType dtype)
    : source_(weights_dtype(model.module())), target_(dtype) {
  // A model already in the target dtype runs as traced.
  if (source_ == target_) return;
  DtypeAnalysis(model, *this).run();
}

size_t DtypeCasts::apply(const Node* original, Node* clone, size_t stage_index) const {
  return apply_to(*this, casts_, undecided_, original, clone, stage_index);
}

}  // namespace libpipe::stage
