#include "runtime/processes/assignment.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstring>

#include "runtime/error.h"

namespace libpipe::processes {

using schedule::StageIO;

using Json = nlohmann::json;

std::vector<std::pair<size_t, size_t>> place_stages(size_t num_stages, int world_size) {
  const auto ranks = static_cast<size_t>(world_size);
  if (world_size < 1 || num_stages < ranks)
    throw Error(Status::InvalidArgument, "the plan has " + std::to_string(num_stages) + " stage" +
                                             (num_stages == 1 ? "" : "s") + " but " + std::to_string(world_size) +
                                             " processes were asked for; every process hosts at least one stage, so "
                                             "use at most " +
                                             std::to_string(num_stages) + " processes or split into more stages");
  std::vector<std::pair<size_t, size_t>> ranges;
  size_t first = 0;
  for (size_t r = 0; r < ranks; ++r) {
    const size_t count = num_stages / ranks + (r < num_stages % ranks ? 1 : 0);
    ranges.emplace_back(first, first + count);
    first += count;
  }
  return ranges;
}

comm::Message encode_assignment(const WorkerAssignment& a) {
  Json stages = Json::array();
  for (size_t i = 0; i < a.stages.size(); ++i) {
    const auto& io = a.stages[i];
    stages.push_back({{"index", io.index},
                      {"inputs", io.inputs},
                      {"outputs", io.outputs},
                      {"dead_after", io.dead_after},
                      {"producers", io.producers},
                      {"last", io.last},
                      {"device", a.devices.at(i).str()},
                      {"aliases", a.aliases.at(i)}});
  }
  Json j = {{"world_size", a.world_size},
            {"num_values", a.num_values},
            {"stages", stages},
            {"threads_per_stage", a.threads_per_stage},
            {"weights", a.weights},
            {"dtype", a.dtype ? static_cast<int>(*a.dtype) : -1},
            {"quantize", a.quantize == stage::WeightQuantization::Int8   ? "int8"
                         : a.quantize == stage::WeightQuantization::Int4 ? "int4"
                                                                         : "none"},
            {"quantize_group", a.quantize_group},
            {"quantize_head", !a.quantize_head                                      ? "default"
                              : *a.quantize_head == stage::WeightQuantization::Int8 ? "int8"
                              : *a.quantize_head == stage::WeightQuantization::Int4 ? "int4"
                                                                                    : "none"},
            {"quantize_embedding", a.quantize_embedding == stage::WeightQuantization::Int8 ? "int8" : "none"},
            {"heartbeat_interval_ms", a.heartbeat_interval.count()}};
  comm::Message m;
  m.kind = comm::Kind::Setup;
  m.text = j.dump();
  for (const auto& bytes : a.modules) {
    auto t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    m.values.emplace_back(t);
  }
  return m;
}

WorkerAssignment decode_assignment(const comm::Message& m) {
  if (m.kind != comm::Kind::Setup)
    throw Error(Status::Communication, "the driver sent message kind " + std::to_string(static_cast<int>(m.kind)) +
                                           " where the stage assignment was expected");
  WorkerAssignment a;
  try {
    const Json j = Json::parse(m.text);
    a.world_size = j.at("world_size").get<int>();
    a.num_values = j.at("num_values").get<size_t>();
    for (const auto& s : j.at("stages")) {
      StageIO io;
      io.index = s.at("index").get<size_t>();
      io.inputs = s.at("inputs").get<std::vector<size_t>>();
      io.outputs = s.at("outputs").get<std::vector<size_t>>();
      io.dead_after = s.at("dead_after").get<std::vector<size_t>>();
      io.producers = s.at("producers").get<std::vector<int>>();
      io.last = s.at("last").get<bool>();
      a.stages.push_back(std::move(io));
      a.devices.emplace_back(s.at("device").get<std::string>());
      a.aliases.push_back(s.at("aliases").get<stage::AliasGroups>());
    }
    a.threads_per_stage = j.at("threads_per_stage").get<int>();
    a.heartbeat_interval = std::chrono::milliseconds(j.at("heartbeat_interval_ms").get<int64_t>());
    a.weights = j.at("weights").get<std::string>();
    const int dtype = j.at("dtype").get<int>();
    if (dtype >= 0) a.dtype = static_cast<at::ScalarType>(dtype);
    const std::string quantize = j.at("quantize").get<std::string>();
    if (quantize != "none" && quantize != "int8" && quantize != "int4")
      throw Error(Status::Communication, "the driver's stage assignment asks for weight quantization '" + quantize +
                                             "', which this worker does not know");
    a.quantize = quantize == "int8"   ? stage::WeightQuantization::Int8
                 : quantize == "int4" ? stage::WeightQuantization::Int4
                                      : stage::WeightQuantization::None;
    a.quantize_group = j.value("quantize_group", int64_t{0});
    const std::string head = j.value("quantize_head", std::string("default"));
    if (head == "int8") a.quantize_head = stage::WeightQuantization::Int8;
    else if (head == "int4") a.quantize_head = stage::WeightQuantization::Int4;
    else if (head == "none") a.quantize_head = stage::WeightQuantization::None;
    else if (head != "default")
      throw Error(Status::Communication, "the driver's stage assignment asks for an output head stored as '" + head +
                                             "', which this worker does not know");
    const std::string embedding = j.value("quantize_embedding", std::string("none"));
    if (embedding == "int8") a.quantize_embedding = stage::WeightQuantization::Int8;
    else if (embedding != "none")
      throw Error(Status::Communication, "the driver's stage assignment asks for an embedding stored as '" + embedding +
                                             "', which this worker does not know");
    if (a.quantize_group != 0 && a.quantize_group != 32 && a.quantize_group != 64 && a.quantize_group != 128)
      throw Error(Status::Communication, "the driver's stage assignment asks for int4 groups of " +
                                             std::to_string(a.quantize_group) + " inputs, not 32, 64 or 128");
  } catch (const Json::exception& e) {
    throw Error(Status::Communication, std::string("the driver's stage assignment is malformed: ") + e.what());
  } catch (const c10::Error& e) {  // a device name this LibTorch does not know
    throw Error(Status::Communication,
                std::string("the driver's stage assignment is malformed: ") + e.what_without_backtrace());
  }
  if (m.values.size() != a.stages.size())
    throw Error(Status::Communication, "the driver's stage assignment has " + std::to_string(m.values.size()) +
                                           " modules for " + std::to_string(a.stages.size()) + " stages");
  for (const auto& v : m.values) {
    const at::Tensor t = v.toTensor().contiguous();
    a.modules.emplace_back(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
  }
  return a;
}

}  // namespace libpipe::processes
