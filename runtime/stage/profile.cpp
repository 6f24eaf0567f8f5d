#include "runtime/stage/profile.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "runtime/error.h"
#include "runtime/stage/stage.h"

namespace libpipe::stage {

std::vector<double> time_stages(const graph::Plan& plan, const std::vector<c10::IValue>& inputs, int threads,
                                int repeats) {
  const auto& names = plan.model().input_names();
  if (inputs.size() != names.size())
    throw Error(Status::Input, "the example inputs hold " + std::to_string(inputs.size()) +
                                   " tensors but the model takes " + std::to_string(names.size()));
  plan.model().check_inputs(inputs, "the example inputs");
  std::vector<std::unique_ptr<Stage>> stages;
  const StageOptions options;
  BuildOptions build;
  build.options = &options;
  // Tensors the stages update in place (caches) become their own, so timing never writes the model's.
  for (size_t s = 0; s < plan.num_stages(); ++s) stages.push_back(build_stage(plan, s, build));

  std::vector<std::vector<double>> samples(stages.size());
  std::exception_ptr failure;
  // A thread of its own, so the intra-op thread count set here touches nothing else.
  std::thread worker([&] {
    try {
      at::set_num_threads(std::max(1, threads));
      c10::InferenceMode inference;
      for (int run = 0; run < repeats + 2; ++run) {
        std::vector<c10::IValue> env(plan.values().size());
        for (size_t id = 0; id < plan.values().size(); ++id)
          if (plan.values()[id].producer < 0) env[id] = inputs[plan.values()[id].input_index];
        for (size_t s = 0; s < stages.size(); ++s) {
          std::vector<c10::IValue> args;
          for (size_t id : plan.stage(s).inputs) args.push_back(env[id]);
          const auto start = std::chrono::steady_clock::now();
          c10::IValue out;
          try {
            out = stages[s]->forward(std::move(args));
          } catch (const c10::Error& e) {
            throw Error(Status::Execution, "profiling stage " + std::to_string(s) +
                                               " on the example inputs failed: " + e.what_without_backtrace());
          }
          const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
          if (run >= 2) samples[s].push_back(ms);
          if (s + 1 < stages.size()) {
            const auto& items = out.toTupleRef().elements();
            for (size_t k = 0; k < plan.stage(s).outputs.size(); ++k) env[plan.stage(s).outputs[k]] = items[k];
          }
        }
      }
    } catch (...) {
      failure = std::current_exception();
    }
  });
  worker.join();
  if (failure) std::rethrow_exception(failure);

  std::vector<double> fastest;
  for (auto& s : samples) fastest.push_back(*std::min_element(s.begin(), s.end()));
  return fastest;
}

}  // namespace libpipe::stage
