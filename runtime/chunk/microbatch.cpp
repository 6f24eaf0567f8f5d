#include "runtime/chunk/microbatch.h"

#include <ATen/ATen.h>

#include "runtime/error.h"
#include "runtime/log.h"

namespace libpipe::chunk {

namespace {

// The dimension an input is split along, or -1 if it is given whole to every micro-batch.
int64_t split_dim(const c10::IValue& input, const InputSpec& spec, const std::string& name) {
  if (spec.kind == InputSpec::Kind::Replicate) return -1;
  const bool splittable = input.isTensor() && input.toTensor().dim() > 0;
  if (spec.kind == InputSpec::Kind::Default) return splittable ? 0 : -1;
  if (!splittable)
    throw Error(Status::Input, "input '" + name + "' is " +
                                   (input.isTensor() ? "a 0-d tensor" : std::string("a ") + input.tagKind()) +
                                   " and cannot be split into micro-batches; give it a replicate spec");
  const int64_t rank = input.toTensor().dim();
  if (spec.dim < -rank || spec.dim >= rank)
    throw Error(Status::Input, "input '" + name + "' has " + std::to_string(rank) +
                                   " dimensions; its spec splits dimension " + std::to_string(spec.dim));
  return spec.dim < 0 ? spec.dim + rank : spec.dim;
}

}  // namespace

std::vector<std::vector<c10::IValue>> split_inputs(const std::vector<c10::IValue>& inputs,
                                                   const std::vector<std::string>& names, int64_t requested,
                                                   const std::vector<InputSpec>& specs) {
  if (requested < 1)
    throw Error(Status::InvalidArgument,
                "the number of micro-batches must be at least 1, got " + std::to_string(requested));
  std::vector<int64_t> dims(inputs.size());
  int64_t batch = -1;
  size_t batch_from = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    dims[i] = split_dim(inputs[i], i < specs.size() ? specs[i] : InputSpec{}, names.at(i));
    if (dims[i] < 0) continue;
    const int64_t n = inputs[i].toTensor().size(dims[i]);
    if (batch < 0) {
      batch = n;
      batch_from = i;
    } else if (n != batch) {
      throw Error(Status::Input, "input '" + names.at(i) + "' has " + std::to_string(n) + " rows along dimension " +
                                     std::to_string(dims[i]) + " but input '" + names.at(batch_from) + "' has " +
                                     std::to_string(batch) +
                                     "; inputs split into micro-batches must share their batch size");
    }
  }

  int64_t count = requested;
  if (batch >= 0 && batch < requested) {
    count = std::max<int64_t>(batch, 1);
    log::warning("batch of " + std::to_string(batch) + " is smaller than the " + std::to_string(requested) +
                 " micro-batches asked for; running " + std::to_string(count) + " micro-batch" +
                 (count == 1 ? "" : "es"));
  }
  if (batch < 0) count = 1;  // nothing to split: every argument is replicated

  std::vector<std::vector<c10::IValue>> out(count);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (dims[i] >= 0 && count > 1) {
      auto pieces = at::tensor_split(inputs[i].toTensor(), count, dims[i]);
      for (int64_t m = 0; m < count; ++m) out[m].emplace_back(std::move(pieces[m]));
    } else {
      for (int64_t m = 0; m < count; ++m) out[m].push_back(inputs[i]);
    }
  }
  return out;
}

namespace {

void flatten_into(const c10::IValue& v, const std::string& name, std::vector<NamedTensor>& out) {
  if (v.isTensor()) {
    out.push_back({name, v.toTensor()});
  } else if (v.isTuple()) {
    const auto& items = v.toTupleRef().elements();
    for (size_t i = 0; i < items.size(); ++i) flatten_into(items[i], name + "." + std::to_string(i), out);
  } else if (v.isList()) {
    const auto items = v.toListRef();
    for (size_t i = 0; i < items.size(); ++i) flatten_into(items[i], name + "." + std::to_string(i), out);
  } else if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) {
      const auto& key = entry.key();
      std::string k = key.isString() ? key.toStringRef()
                      : key.isInt()
                          ? std::to_string(key.toInt())
                          : throw Error(Status::Unsupported, "output '" + name + "' is a dict with " + key.tagKind() +
                                                                 " keys; use str or int keys");
      flatten_into(entry.value(), name + "." + k, out);
    }
  } else {
    throw Error(Status::Unsupported, "output '" + name + "' is a " + v.tagKind() +
                                         "; models must return tensors (or tuples, lists or dicts of tensors)");
  }
}

at::Tensor combine(const std::string& name, std::vector<at::Tensor>& parts, const OutputSpec& spec) {
  switch (spec.kind) {
    case OutputSpec::Kind::Sum: {
      at::Tensor total = parts[0].clone();
      for (size_t m = 1; m < parts.size(); ++m) total.add_(parts[m]);
      return total;
    }
    case OutputSpec::Kind::Equal:
      for (size_t m = 1; m < parts.size(); ++m)
        if (!parts[m].equal(parts[0]))
          throw Error(Status::Execution, "output '" + name + "' is specified as equal across micro-batches, but " +
                                             "micro-batch " + std::to_string(m) + " differs from micro-batch 0");
      return parts[0];
    case OutputSpec::Kind::Concat: break;
  }
  const int64_t rank = parts[0].dim();
  if (rank == 0)
    throw Error(Status::Execution, "output '" + name +
                                       "' is a 0-d tensor and cannot be concatenated across micro-batches; "
                                       "give it a sum or equal spec, or run with one micro-batch");
  if (spec.dim < -rank || spec.dim >= rank)
    throw Error(Status::Execution, "output '" + name + "' has " + std::to_string(rank) +
                                       " dimensions; its spec concatenates along dimension " +
                                       std::to_string(spec.dim));
  return at::cat(parts, spec.dim);
}

}  // namespace

std::vector<NamedTensor> flatten_output(const c10::IValue& value) {
  std::vector<NamedTensor> out;
  flatten_into(value, "output", out);
  return out;
}

std::vector<NamedTensor> merge_outputs(const std::vector<c10::IValue>& results, const std::vector<OutputSpec>& specs) {
  if (results.empty()) throw Error(Status::Internal, "merge_outputs called with no results");
  std::vector<NamedTensor> merged = flatten_output(results[0]);
  if (results.size() == 1) return merged;

  std::vector<std::vector<at::Tensor>> parts(merged.size());
  for (size_t i = 0; i < merged.size(); ++i) parts[i].push_back(merged[i].tensor);
  for (size_t m = 1; m < results.size(); ++m) {
    auto flat = flatten_output(results[m]);
    if (flat.size() != merged.size())
      throw Error(Status::Execution, "micro-batch " + std::to_string(m) + " returned " + std::to_string(flat.size()) +
                                         " outputs but micro-batch 0 returned " + std::to_string(merged.size()));
    for (size_t i = 0; i < flat.size(); ++i) {
      if (flat[i].name != merged[i].name)
        throw Error(Status::Execution, "micro-batch " + std::to_string(m) + " returned output '" + flat[i].name +
                                           "' where micro-batch 0 returned '" + merged[i].name + "'");
      parts[i].push_back(std::move(flat[i].tensor));
    }
  }
  for (size_t i = 0; i < merged.size(); ++i)
    merged[i].tensor = combine(merged[i].name, parts[i], i < specs.size() ? specs[i] : OutputSpec{});
  return merged;
}

}  // namespace libpipe::chunk
