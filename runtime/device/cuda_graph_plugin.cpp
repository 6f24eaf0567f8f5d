// libpipe_cuda_graph.so: LibTorch's CUDA graphs (at::cuda::CUDAGraph) behind a C table of functions.
//
// libpipe does not link libtorch_cuda (cuda_library.h: CPU users would load the CUDA runtime, cuBLAS and cuDNN for
// nothing), and capturing a graph needs it: the capture must go through LibTorch's caching allocator, which gives
// the graph's tensors a private pool so that memory they use is not handed to anything else between two replays.
// This small library links it and is loaded (cuda_graph.cpp) only when a GPU stage first captures a step, after
// libtorch_cuda itself is loaded. A C table rather than C++ classes across the boundary: nothing but these
// functions' signatures has to agree between the two libraries, and errors come back as text.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>

#include "runtime/device/cuda_graph_api.h"

namespace {

int fail(const std::exception& e, char* error, size_t size) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::snprintf(error, size, "%s", c10_error ? c10_error->what_without_backtrace() : e.what());
  return 1;
}

template <typename F>
int guarded(F&& f, char* error, size_t size) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    return fail(e, error, size);
  }
}

at::cuda::CUDAGraph* graph_of(void* graph) { return static_cast<at::cuda::CUDAGraph*>(graph); }

int new_pool(unsigned long long pool[2], char* error, size_t size) {
  return guarded(
      [&] {
        const auto id = at::cuda::graph_pool_handle();
        pool[0] = id.first;
        pool[1] = id.second;
      },
      error, size);
}

void* create(char* error, size_t size) {
  try {
    return new at::cuda::CUDAGraph();
  } catch (const std::exception& e) {
    fail(e, error, size);
    return nullptr;
  }
}

// Thread-local capture: the other stages' threads (and the uploader's) keep using the GPU while one stage captures,
// and a global capture would make their synchronizing calls fail.
int capture_begin(void* graph, const unsigned long long pool[2], char* error, size_t size) {
  return guarded([&] { graph_of(graph)->capture_begin({pool[0], pool[1]}, cudaStreamCaptureModeThreadLocal); }, error,
                 size);
}

int capture_end(void* graph, char* error, size_t size) {
  return guarded([&] { graph_of(graph)->capture_end(); }, error, size);
}

int replay(void* graph, char* error, size_t size) {
  return guarded([&] { graph_of(graph)->replay(); }, error, size);
}

void destroy(void* graph) { delete graph_of(graph); }

const libpipe_cuda_graph_api kApi = {
    LIBPIPE_CUDA_GRAPH_API_VERSION, new_pool, create, capture_begin, capture_end, replay, destroy};

}  // namespace

extern "C" __attribute__((visibility("default"))) const libpipe_cuda_graph_api* libpipe_cuda_graph_api_get(void) {
  return &kApi;
}
