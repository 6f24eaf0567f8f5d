#include "runtime/stage/torchscript/stage_module.h"

#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/shape_analysis.h>

#include <algorithm>
#include <map>
#include <unordered_map>

#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/log.h"
#include "runtime/stage/torchscript/dtype_casts.h"

namespace libpipe::stage {

using torch::jit::Graph;
using torch::jit::Module;
using torch::jit::Node;
using torch::jit::Value;

namespace {

// Creates the stage module's submodule tree and copies in each attribute the stage reads.
class ModuleTree {
 public:
  ModuleTree(const Module& original, size_t stage_index)
      : cu_(std::make_shared<torch::jit::CompilationUnit>()),
        prefix_("__torch__.libpipe.stage" + std::to_string(stage_index)),
        root_(make_module(prefix_ + ".Stage")),
        original_(original) {}

  void add(const std::vector<std::string>& path) {
    Module stage_parent = root_;
    c10::intrusive_ptr<c10::ivalue::Object> orig = original_._ivalue();
    std::string dotted;
    for (size_t i = 0; i + 1 < path.size(); ++i) {
      dotted += (dotted.empty() ? "" : ".") + path[i];
      orig = orig->getAttr(path[i]).toObject();
      auto it = children_.find(dotted);
      if (it == children_.end()) {
        // Class names must be identifiers ("layers.0" is not): "m_layers_0".
        std::string cls = "m_" + dotted;
        std::replace(cls.begin(), cls.end(), '.', '_');
        Module child = make_module(prefix_ + "." + cls);
        stage_parent.register_module(path[i], child);
        it = children_.emplace(dotted, child).first;
      }
      stage_parent = it->second;
    }
    const std::string& leaf = path.back();
    const auto& type = orig->type();
    const size_t slot = type->getAttributeSlot(leaf);
    stage_parent.register_attribute(leaf, type->getAttribute(slot), orig->getSlot(slot), type->is_parameter(slot),
                                    type->is_buffer(slot));
  }

  Module& root() { return root_; }
  const std::shared_ptr<torch::jit::CompilationUnit>& cu() const { return cu_; }

 private:
  Module make_module(const std::string& qualified_name) {
    Module m(c10::QualifiedName(qualified_name), cu_, /*shouldMangle=*/true);
    // Module::train() expects every module to carry `training`; stages always run in eval mode.
    m.register_attribute("training", c10::BoolType::get(), false);
    return m;
  }

  std::shared_ptr<torch::jit::CompilationUnit> cu_;
  std::string prefix_;
  Module root_;
  const Module& original_;
  std::map<std::string, Module> children_;
};

// Attribute reads cloned inside if/loop blocks still carry the original module's class types;
// re-derive each from the stage module's types so slot lookups resolve against the stage.
void retype_attribute_reads(torch::jit::Block* block) {
  for (Node* node : block->nodes()) {
    if (node->kind() == torch::jit::prim::GetAttr) {
      if (auto cls = node->input()->type()->cast<c10::ClassType>())
        node->output()->setType(cls->getAttribute(node->s(torch::jit::attr::name)));
    }
    for (auto* sub : node->blocks()) retype_attribute_reads(sub);
  }
}

// The name a value was given in the model code ("" for compiler temporaries, which TorchScript
// names by number and refuses as explicit names).
std::string readable_name(const Value* v) { return v->hasDebugName() ? v->debugNameBase() : ""; }

void rewrite_device_constants(torch::jit::Block* block, const c10::Device& device) {
  for (Node* node : block->nodes()) {
    if (node->kind() == torch::jit::prim::Constant && node->output()->type()->kind() == c10::TypeKind::DeviceObjType)
      node->s_(torch::jit::attr::value, device.str());
    for (auto* sub : node->blocks()) rewrite_device_constants(sub, device);
  }
}

}  // namespace

Module build_stage_module(const graph::Plan& plan, size_t stage_index, c10::Device device,
                          std::optional<at::ScalarType> dtype) {
  const graph::StagePlan& sp = plan.stage(stage_index);
  const graph::Model& model = graph::torchscript_model(plan);
  const auto& model_graph = model.graph();
  const Value* model_self = model_graph->inputs()[0];
  const bool last = stage_index + 1 == plan.num_stages();

  std::optional<DtypeCasts> casts;
  if (dtype) casts.emplace(model, *dtype);

  ModuleTree tree(model.module(), stage_index);
  for (size_t a : sp.attributes) tree.add(model.attributes()[a].path);

  auto graph = std::make_shared<Graph>();
  std::unordered_map<const Value*, Value*> env;
  Value* self = graph->addInput("self")->setType(tree.root().type());
  env[model_self] = self;
  for (size_t id : sp.inputs) {
    const Value* v = model.value(plan.values()[id].value);
    // Unshaped: traced graphs record the example's sizes, but micro-batches vary in size.
    env[v] = graph->addInput(readable_name(v))->setType(c10::unshapedType(v->type()));
  }

  // Looks a model value up in the stage graph, recreating constants and attribute reads of self
  // at the current insertion point (the end of the graph) the first time they are needed.
  std::function<Value*(Value*)> lookup = [&](Value* v) -> Value* {
    if (auto it = env.find(v); it != env.end()) return it->second;
    Node* def = v->node();
    Value* made = nullptr;
    if (def->kind() == torch::jit::prim::Constant) {
      made = graph->insertNode(graph->createClone(def, lookup))->output();
    } else if (def->kind() == torch::jit::prim::GetAttr && !graph::attribute_path(v, model_self).empty()) {
      // insertGetAttr types the result from the stage module's own class.
      made = graph->insertGetAttr(lookup(def->input()), def->s(torch::jit::attr::name));
    } else {
      throw Error(Status::Internal, "stage " + std::to_string(stage_index) + " reads value %" + v->debugName() +
                                        " that the plan does not hand to it");
    }
    made->setDebugName(readable_name(v));
    env[v] = made;
    return made;
  };

  size_t cast_count = 0;
  for (size_t id : sp.nodes) {
    Node* node = model.node(id);
    Node* clone = graph->createClone(node, lookup);
    graph->insertNode(clone);
    if (casts) cast_count += casts->apply(node, clone, stage_index);
    for (size_t i = 0; i < node->outputs().size(); ++i) env[node->output(i)] = clone->output(i);
  }
  if (cast_count)
    log::info("stage " + std::to_string(stage_index) + ": " + std::to_string(cast_count) + " values that the trace " +
              "fixed at " + c10::toString(casts->source()) + " are cast to " + c10::toString(casts->target()) +
              " where they meet " + c10::toString(casts->target()) + " ones, as eager code casts back");

  if (last) {
    std::vector<Value*> results;
    for (Value* v : model_graph->outputs()) results.push_back(lookup(v));
    graph->registerOutput(results.size() == 1 ? results[0] : graph->insertNode(graph->createTuple(results))->output());
  } else {
    std::vector<Value*> outs;
    for (size_t id : sp.outputs) outs.push_back(env.at(model.value(plan.values()[id].value)));
    graph->registerOutput(graph->insertNode(graph->createTuple(outs))->output());
  }

  torch::jit::EliminateDeadCode(graph);
  retype_attribute_reads(graph->block());
  rewrite_device_constants(graph->block(), device);
  // Sizes recorded by tracing describe the example input, not the micro-batches that will run.
  torch::jit::EraseShapeInformation(graph);

  Module& root = tree.root();
  auto* fn = tree.cu()->create_function(c10::QualifiedName(*root.type()->name(), "forward"), graph);
  root.type()->addMethod(fn);
  root.eval();
  return root;
}

}  // namespace libpipe::stage
