#include "runtime/chunk/microbatch.h"

#include <ATen/ATen.h>

#include "runtime/error.h"
#include "runtime/log.h"

namespace libpipe::chunk {

std::vector<std::vector<c10::IValue>> split_inputs(const std::vector<c10::IValue>& inputs,
                                                   const std::vector<std::string>& names,
                                                   int64_t requested) {
  if (requested < 1)
    throw Error(Status::InvalidArgument,
                "the number of micro-batches must be at least 1, got " + std::to_string(requested));
  int64_t batch = -1;
  size_t batch_from = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor() || inputs[i].toTensor().dim() == 0) continue;
    const int64_t n = inputs[i].toTensor().size(0);
    if (batch < 0) {
      batch = n;
      batch_from = i;
    } else if (n != batch) {
      throw Error(Status::Input, "input '" + names.at(i) + "' has " + std::to_string(n) +
                                     " rows along dimension 0 but input '" + names.at(batch_from) +
                                     "' has " + std::to_string(batch) +
                                     "; inputs split into micro-batches must share their batch size");
    }
  }

  int64_t count = requested;
  if (batch >= 0 && batch < requested) {
    count = std::max<int64_t>(batch, 1);
    log::warning("batch of " + std::to_string(batch) + " is smaller than the " +
                 std::to_string(requested) + " micro-batches asked for; running " +
                 std::to_string(count) + " micro-batch" + (count == 1 ? "" : "es"));
  }
  if (batch < 0) count = 1;  // nothing to split: every argument is replicated

  std::vector<std::vector<c10::IValue>> out(count);
  for (const auto& input : inputs) {
    if (input.isTensor() && input.toTensor().dim() > 0 && count > 1) {
      auto pieces = at::tensor_split(input.toTensor(), count, 0);
      for (int64_t m = 0; m < count; ++m) out[m].emplace_back(std::move(pieces[m]));
    } else {
      for (int64_t m = 0; m < count; ++m) out[m].push_back(input);
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
                      : key.isInt()  ? std::to_string(key.toInt())
                                     : throw Error(Status::Unsupported,
                                                   "output '" + name + "' is a dict with " +
                                                       key.tagKind() + " keys; use str or int keys");
      flatten_into(entry.value(), name + "." + k, out);
    }
  } else {
    throw Error(Status::Unsupported, "output '" + name + "' is a " + v.tagKind() +
                                         "; models must return tensors (or tuples, lists or dicts "
                                         "of tensors)");
  }
}

}  // namespace

std::vector<NamedTensor> flatten_output(const c10::IValue& value) {
  std::vector<NamedTensor> out;
  flatten_into(value, "output", out);
  return out;
}

std::vector<NamedTensor> merge_outputs(const std::vector<c10::IValue>& results) {
  if (results.empty()) throw Error(Status::Internal, "merge_outputs called with no results");
  std::vector<NamedTensor> merged = flatten_output(results[0]);
  if (results.size() == 1) return merged;

  std::vector<std::vector<at::Tensor>> parts(merged.size());
  for (size_t i = 0; i < merged.size(); ++i) parts[i].push_back(merged[i].tensor);
  for (size_t m = 1; m < results.size(); ++m) {
    auto flat = flatten_output(results[m]);
    if (flat.size() != merged.size())
      throw Error(Status::Execution, "micro-batch " + std::to_string(m) + " returned " +
                                         std::to_string(flat.size()) + " outputs but micro-batch 0 returned " +
                                         std::to_string(merged.size()));
    for (size_t i = 0; i < flat.size(); ++i) {
      if (flat[i].name != merged[i].name)
        throw Error(Status::Execution, "micro-batch " + std::to_string(m) + " returned output '" +
                                           flat[i].name + "' where micro-batch 0 returned '" +
                                           merged[i].name + "'");
      parts[i].push_back(std::move(flat[i].tensor));
    }
  }
  for (size_t i = 0; i < merged.size(); ++i) {
    if (merged[i].tensor.dim() == 0)
      throw Error(Status::Execution, "output '" + merged[i].name +
                                         "' is a 0-d tensor and cannot be concatenated across "
                                         "micro-batches; run with one micro-batch");
    merged[i].tensor = at::cat(parts[i], 0);
  }
  return merged;
}

}  // namespace libpipe::chunk
