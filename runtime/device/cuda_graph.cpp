#include "runtime/device/cuda_graph.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

#include "runtime/device/cuda_graph_api.h"
#include "runtime/device/cuda_library.h"
#include "runtime/error.h"

namespace libpipe::device {

namespace {

constexpr const char* kPlugin = "libpipe_cuda_graph.so";

// The plugin beside the library (or program) this code is linked into, as installed and as built; the bare name
// (the run path) otherwise.
std::string plugin_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&cuda_graph_factory), &info) && info.dli_fname) {
    std::string path = info.dli_fname;
    const size_t slash = path.rfind('/');
    if (slash != std::string::npos) return path.substr(0, slash + 1) + kPlugin;
  }
  return kPlugin;
}

struct Plugin {
  const libpipe_cuda_graph_api* api = nullptr;
  std::string why;  // why there is none
};

const Plugin& plugin() {
  static const Plugin loaded = [] {
    Plugin p;
    void* handle = dlopen(plugin_path().c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) handle = dlopen(kPlugin, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      p.why = std::string(kPlugin) + " could not be loaded (" + dlerror() +
              "): this build of libpipe has no CUDA graphs (it found no CUDA headers), or the file is missing";
      return p;
    }
    auto get = reinterpret_cast<libpipe_cuda_graph_api_get_fn>(dlsym(handle, "libpipe_cuda_graph_api_get"));
    const libpipe_cuda_graph_api* api = get ? get() : nullptr;
    if (!api || api->version != LIBPIPE_CUDA_GRAPH_API_VERSION) {
      p.why = std::string(kPlugin) + " is not the one this libpipe was built with (its table's version differs)";
      return p;
    }
    p.api = api;
    return p;
  }();
  return loaded;
}

[[noreturn]] void failed(const char* what, const char* error) {
  throw Error(Status::Execution, std::string("CUDA graph: ") + what + ": " + error);
}

class CudaStepGraph final : public StepGraph {
 public:
  CudaStepGraph(const libpipe_cuda_graph_api* api, std::array<unsigned long long, 2> pool) : api_(api), pool_(pool) {
    char error[512] = {0};
    graph_ = api_->create(error, sizeof error);
    if (!graph_) failed("cannot create a graph", error);
  }
  ~CudaStepGraph() override { api_->destroy(graph_); }

  void capture(const std::function<void()>& work) override {
    char error[512] = {0};
    if (api_->capture_begin(graph_, pool_.data(), error, sizeof error) != 0) failed("cannot begin a capture", error);
    try {
      work();
    } catch (...) {
      // The stream must leave capture mode whatever happened, or its next work fails too.
      char ignored[512] = {0};
      api_->capture_end(graph_, ignored, sizeof ignored);
      throw;
    }
    if (api_->capture_end(graph_, error, sizeof error) != 0) failed("the step could not be captured", error);
  }

  void replay() override {
    char error[512] = {0};
    if (api_->replay(graph_, error, sizeof error) != 0) failed("replay failed", error);
  }

 private:
  const libpipe_cuda_graph_api* api_;
  std::array<unsigned long long, 2> pool_;
  void* graph_ = nullptr;
};

}  // namespace

StepGraphFactory cuda_graph_factory(const c10::Device& device) {
  try {
    require_device(device, "a CUDA graph");
  } catch (const Error& e) {
    throw Error(Status::Unsupported, e.what());
  }
  const Plugin& p = plugin();
  if (!p.api) throw Error(Status::Unsupported, p.why);
  std::array<unsigned long long, 2> pool{};
  char error[512] = {0};
  if (p.api->new_pool(pool.data(), error, sizeof error) != 0) failed("cannot make a memory pool", error);
  const libpipe_cuda_graph_api* api = p.api;
  return [api, pool] { return std::make_unique<CudaStepGraph>(api, pool); };
}

bool cuda_graphs_enabled() {
  const char* v = std::getenv("LIBPIPE_CUDA_GRAPHS");
  return !(v && std::strcmp(v, "0") == 0);
}

}  // namespace libpipe::device
