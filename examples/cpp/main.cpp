// libpipe from C++: the C ABI with RAII owners and exceptions. Loads the demo model, cuts it
// into 2 stages just before module blocks.2, runs the inputs with 4 micro-batches, and compares
// the result with the reference output the model generator wrote.
//
//   example_cpp MODEL.pt INPUTS.safetensors REFERENCE.safetensors
#include <pipe/pipe.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// A failed call as an exception carrying libpipe's status and message.
struct PipeError : std::runtime_error {
  pipe_status status;
  PipeError(const char* what, pipe_status st)
      : std::runtime_error(std::string(what) + ": " + pipe_last_error() + " (" + pipe_status_string(st) + ")"),
        status(st) {}
};

void check(pipe_status st, const char* what) {
  if (st != PIPE_OK) throw PipeError(what, st);
}

// Each handle owned by a unique_ptr whose deleter is the matching pipe_*_destroy.
template <typename T, void (*Destroy)(T*)>
struct Deleter {
  void operator()(T* p) const { Destroy(p); }
};
using Model = std::unique_ptr<pipe_model, Deleter<pipe_model, pipe_model_destroy>>;
using PlanOptions = std::unique_ptr<pipe_plan_options, Deleter<pipe_plan_options, pipe_plan_options_destroy>>;
using Plan = std::unique_ptr<pipe_plan, Deleter<pipe_plan, pipe_plan_destroy>>;
using Session = std::unique_ptr<pipe_session, Deleter<pipe_session, pipe_session_destroy>>;
using TensorList = std::unique_ptr<pipe_tensor_list, Deleter<pipe_tensor_list, pipe_tensor_list_destroy>>;

TensorList read_safetensors(const char* path) {
  pipe_tensor_list* raw = nullptr;
  check(pipe_safetensors_read(path, &raw), path);
  return TensorList(raw);
}

const DLManagedTensor* find(pipe_tensor_list* list, const char* name) {
  size_t index = 0;
  check(pipe_tensor_list_find(list, name, &index), name);
  const DLManagedTensor* t = nullptr;
  check(pipe_tensor_list_get(list, index, &t), name);
  return t;
}

std::vector<float> floats(const DLManagedTensor* t) {
  const DLTensor& d = t->dl_tensor;
  if (d.dtype.code != kDLFloat || d.dtype.bits != 32) throw std::runtime_error("expected a float32 tensor");
  int64_t n = 1;
  for (int i = 0; i < d.ndim; ++i) n *= d.shape[i];
  const auto* first = reinterpret_cast<const float*>(static_cast<const char*>(d.data) + d.byte_offset);
  return std::vector<float>(first, first + n);
}

int run(const char* model_path, const char* inputs_path, const char* reference_path) {
  pipe_model* raw_model = nullptr;
  check(pipe_model_load(model_path, &raw_model), model_path);
  Model model(raw_model);

  pipe_plan_options* raw_cut = nullptr;
  check(pipe_plan_options_create(&raw_cut), "plan options");
  PlanOptions cut(raw_cut);
  check(pipe_plan_options_add_split_point(cut.get(), "blocks.2:begin"), "split point");
  pipe_plan* raw_plan = nullptr;
  check(pipe_plan_create(model.get(), cut.get(), &raw_plan), "plan");
  Plan plan(raw_plan);
  size_t stages = 0;
  check(pipe_plan_num_stages(plan.get(), &stages), "stages");

  pipe_session_options options = PIPE_SESSION_OPTIONS_INIT;
  options.num_microbatches = 4;
  pipe_session* raw_session = nullptr;
  check(pipe_session_create(plan.get(), &options, &raw_session), "session");
  Session session(raw_session);

  // Forward arguments in order, looked up by name in the inputs file.
  TensorList inputs = read_safetensors(inputs_path);
  size_t num_inputs = 0;
  check(pipe_model_num_inputs(model.get(), &num_inputs), "inputs");
  std::vector<const DLManagedTensor*> args;
  for (size_t i = 0; i < num_inputs; ++i) {
    const char* name = nullptr;
    check(pipe_model_input_name(model.get(), i, &name), "input name");
    args.push_back(find(inputs.get(), name));
  }
  pipe_tensor_list* raw_outputs = nullptr;
  check(pipe_session_run(session.get(), args.data(), args.size(), nullptr, &raw_outputs), "run");
  TensorList outputs(raw_outputs);

  TensorList reference = read_safetensors(reference_path);
  const auto got = floats(find(outputs.get(), "output"));
  const auto want = floats(find(reference.get(), "output"));
  if (got.size() != want.size()) throw std::runtime_error("output and reference differ in size");
  double max_diff = 0;
  for (size_t i = 0; i < got.size(); ++i) max_diff = std::max(max_diff, std::fabs(double(got[i]) - double(want[i])));
  std::printf("libpipe %s from C++: %zu stages, 4 micro-batches, %zu values, max |diff| vs PyTorch = %.3g\n",
              pipe_version(), stages, got.size(), max_diff);
  const bool ok = max_diff <= 1e-4;
  std::printf("%s\n", ok ? "output matches PyTorch" : "output DIFFERS from PyTorch");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MODEL.pt INPUTS.safetensors REFERENCE.safetensors\n", argv[0]);
    return 2;
  }
  try {
    return run(argv[1], argv[2], argv[3]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_cpp: %s\n", e.what());
    return 1;
  }
}
