/* The table of functions libpipe_cuda_graph.so exports (cuda_graph_plugin.cpp) and libpipe loads (cuda_graph.cpp).
 * Each function that can fail returns 0 on success, or non-zero with the reason written into `error` (`size` bytes,
 * NUL-terminated). A change to a signature changes the version, and a table of another version is refused. */
#ifndef LIBPIPE_CUDA_GRAPH_API_H
#define LIBPIPE_CUDA_GRAPH_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LIBPIPE_CUDA_GRAPH_API_VERSION 1

typedef struct libpipe_cuda_graph_api {
  int version;
  /* A memory pool that graphs may share (LibTorch's graph_pool_handle): an id of two numbers. */
  int (*new_pool)(unsigned long long pool[2], char* error, size_t size);
  /* A new graph, not captured yet; null on failure. */
  void* (*create)(char* error, size_t size);
  /* Starts recording what the calling thread queues on its current stream (which must not be the default stream),
   * its allocations from `pool`. */
  int (*capture_begin)(void* graph, const unsigned long long pool[2], char* error, size_t size);
  /* Ends the recording; after a failed capture it still ends it, and fails. */
  int (*capture_end)(void* graph, char* error, size_t size);
  /* Queues the recorded work on the calling thread's current stream. */
  int (*replay)(void* graph, char* error, size_t size);
  void (*destroy)(void* graph);
} libpipe_cuda_graph_api;

/* The table; the one symbol the library exports. */
const libpipe_cuda_graph_api* libpipe_cuda_graph_api_get(void);
typedef const libpipe_cuda_graph_api* (*libpipe_cuda_graph_api_get_fn)(void);

#ifdef __cplusplus
}
#endif

#endif
