/*
 * libpipe — pipelined inference for TorchScript models, behind a stable C ABI.
 *
 * The flow is:  pipe_model_load  ->  pipe_plan_create  ->  pipe_session_create  ->  pipe_session_run.
 *
 *   model    a loaded TorchScript archive (torch.jit.trace or torch.jit.script output)
 *   plan     the model cut into stages: at pipe::split() markers, at module boundaries
 *            ("layers.3:end"), or into N stages balanced by layers, parameter bytes or time
 *   session  one worker thread per stage; a call is cut into micro-batches that stream through
 *            the stages, micro-batches of concurrent calls interleave, and the outputs are put
 *            back together
 *
 * Rules that hold for every function in this header:
 *   - Every fallible function returns a pipe_status; PIPE_OK (0) is success.
 *   - Output parameters are written only on success; on failure they are left untouched.
 *   - On failure, pipe_last_error() returns a message saying what was wrong and what to do.
 *     The message is per thread and stays valid until that thread's next libpipe call.
 *   - No C++ exception ever crosses this boundary.
 *   - Every pipe_x_destroy accepts NULL and does nothing with it.
 *   - Tensors cross as DLPack DLManagedTensor. Inputs are borrowed for the duration of the call
 *     (libpipe never calls their deleter); outputs belong to the caller, who frees them by calling
 *     their deleter.
 *   - Tensors may be in CPU memory (kDLCPU) or on a CUDA device (kDLCUDA) of this process. libpipe
 *     reads a CUDA input after the work queued so far on the calling thread's current CUDA stream
 *     of that device (LibTorch's current stream; the legacy default stream for callers that set
 *     none), as PyTorch itself would.
 *   - Strings returned as `const char *` are owned by libpipe; their lifetime is stated per function.
 *
 * Thread-safety notes use three words:
 *   global     safe from any thread at any time; touches no handle.
 *   thread-safe  safe to call concurrently on the same handle.
 *   exclusive  the caller must not call another function on the same handle concurrently.
 */
#ifndef PIPE_PIPE_H
#define PIPE_PIPE_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PIPE_API __attribute__((visibility("default")))
#else
#define PIPE_API
#endif

/* ---- Version ------------------------------------------------------------------------------- */

#define PIPE_VERSION_MAJOR 0
#define PIPE_VERSION_MINOR 5
#define PIPE_VERSION_PATCH 0

/* "MAJOR.MINOR.PATCH" of the loaded library; equals the PIPE_VERSION_* it was built with.
 * Global. Never fails; the string lives as long as the library is loaded. */
PIPE_API const char *pipe_version(void);

/* ---- Status codes --------------------------------------------------------------------------- */

typedef int32_t pipe_status;

#define PIPE_OK 0
/* An argument is NULL, out of range, or otherwise not acceptable. */
#define PIPE_ERR_INVALID_ARGUMENT 1
/* A file named by the caller does not exist or cannot be opened. */
#define PIPE_ERR_NOT_FOUND 2
/* A file exists but is not in the expected format (not TorchScript, corrupt safetensors, ...). */
#define PIPE_ERR_INVALID_FORMAT 3
/* The model cannot be split as asked (no markers where required, marker inside a block, ...). */
#define PIPE_ERR_SPLIT 4
/* Inputs do not fit the call, as checked before anything runs: wrong count, a device this process
 * cannot use (a CUDA tensor without a GPU), a DLPack tensor libpipe cannot read, batch sizes that
 * disagree or specs that do not fit. */
#define PIPE_ERR_INPUT 5
/* A stage failed while running: the model's own code raised an error, which includes a dtype or
 * shape its operators reject (the message names the stage and quotes the operator's error). */
#define PIPE_ERR_EXECUTION 6
/* Reading or writing a file failed after it was opened. */
#define PIPE_ERR_IO 7
/* Memory could not be allocated. */
#define PIPE_ERR_OUT_OF_MEMORY 8
/* The request is valid but this build or device cannot do it. */
#define PIPE_ERR_UNSUPPORTED 9
/* A bug in libpipe; the message says where. Please report it. */
#define PIPE_ERR_INTERNAL 10
/* pipe_request_wait: the call is not finished yet; it goes on, wait again later. */
#define PIPE_ERR_TIMEOUT 11
/* The call was cancelled (pipe_request_cancel, or its session was destroyed). */
#define PIPE_ERR_CANCELLED 12
/* The call did not finish before its deadline (pipe_run_options.timeout_ms). */
#define PIPE_ERR_DEADLINE_EXCEEDED 13
/* Talking to another process failed: a worker died, stopped answering for longer than the
 * session's comm_timeout_ms, could not be reached, or the rendezvous store address is wrong. A
 * session that reports this is broken for good (pipe_session_check says so): destroy it, start
 * its workers again and create a new one. Since 0.4. */
#define PIPE_ERR_COMMUNICATION 14

/* The name of a status code ("PIPE_OK", "PIPE_ERR_INPUT", ...), or "PIPE_ERR_UNKNOWN" for a code
 * this version does not define. Global. Never fails; the string is static. */
PIPE_API const char *pipe_status_string(pipe_status status);

/* The message of the last failed call on this thread ("" if none). Global. Valid until this
 * thread's next libpipe call. */
PIPE_API const char *pipe_last_error(void);

/* ---- Logging ---------------------------------------------------------------------------------- */

#define PIPE_LOG_DEBUG 0
#define PIPE_LOG_INFO 1
#define PIPE_LOG_WARNING 2
#define PIPE_LOG_ERROR 3

/* A log sink. `message` is valid only during the call. It may be called from libpipe's worker
 * threads, concurrently; it must not call back into libpipe. */
typedef void (*pipe_log_fn)(void *user_data, int32_t level, const char *message);

/* Replace the default logger (warnings and errors to stderr). `fn` NULL restores the default.
 * Messages below `min_level` (a PIPE_LOG_* value) are dropped.
 * Global: safe from any thread; takes effect for messages emitted after it returns. */
PIPE_API pipe_status pipe_set_log_callback(pipe_log_fn fn, void *user_data, int32_t min_level);

/* ---- Named tensor lists ---------------------------------------------------------------------- */

/* An ordered list of named tensors owned by libpipe: the outputs of a run, or the contents of a
 * safetensors file. */
typedef struct pipe_tensor_list pipe_tensor_list;

/* Number of entries. Thread-safe. */
PIPE_API pipe_status pipe_tensor_list_size(const pipe_tensor_list *list, size_t *size);

/* Name of entry `index`; valid until the list is destroyed. Thread-safe. */
PIPE_API pipe_status pipe_tensor_list_name(const pipe_tensor_list *list, size_t index,
                                           const char **name);

/* Index of the entry called `name`; PIPE_ERR_NOT_FOUND if there is none. Thread-safe. */
PIPE_API pipe_status pipe_tensor_list_find(const pipe_tensor_list *list, const char *name,
                                           size_t *index);

/* Borrow entry `index` as DLPack. The tensor stays owned by the list: do not call its deleter;
 * it is valid until the entry is taken or the list is destroyed. Exclusive. */
PIPE_API pipe_status pipe_tensor_list_get(pipe_tensor_list *list, size_t index,
                                          const DLManagedTensor **tensor);

/* Take entry `index` out of the list: the caller owns `*tensor` and frees it with its deleter.
 * The entry keeps its name but holds no tensor afterwards (get/take on it then fail).
 * Exclusive. */
PIPE_API pipe_status pipe_tensor_list_take(pipe_tensor_list *list, size_t index,
                                           DLManagedTensor **tensor);

/* A new empty list, to fill with pipe_tensor_list_append (e.g. to write the caller's own tensors
 * with pipe_safetensors_write). The caller destroys it. Global. Since 0.3. */
PIPE_API pipe_status pipe_tensor_list_create(pipe_tensor_list **list);

/* Append a copy of `tensor` under `name`; the caller keeps `tensor` (its deleter is not called).
 * PIPE_ERR_INVALID_ARGUMENT for an empty name or one already in the list; PIPE_ERR_INPUT for a
 * DLPack tensor libpipe cannot read. Exclusive. Since 0.3. */
PIPE_API pipe_status pipe_tensor_list_append(pipe_tensor_list *list, const char *name,
                                             const DLManagedTensor *tensor);

/* Free the list and every tensor still in it. NULL is ignored. Exclusive. */
PIPE_API void pipe_tensor_list_destroy(pipe_tensor_list *list);

/* ---- safetensors files ------------------------------------------------------------------------ */

/* Read every tensor of a safetensors file into a new list (CPU tensors, file order).
 * PIPE_ERR_NOT_FOUND if the file cannot be opened; PIPE_ERR_INVALID_FORMAT if its header or data
 * is malformed (the message says which entry and why). Global. */
PIPE_API pipe_status pipe_safetensors_read(const char *path, pipe_tensor_list **list);

/* Write every tensor of `list` to a safetensors file (tensors are copied to CPU and made
 * contiguous as needed). Entries already taken are an error. The file is written to a temporary
 * name and renamed, so a failed write never leaves a truncated file at `path`.
 * Thread-safe on `list`. */
PIPE_API pipe_status pipe_safetensors_write(const pipe_tensor_list *list, const char *path);

/* ---- Model ------------------------------------------------------------------------------------- */

typedef struct pipe_model pipe_model;

/* Load a TorchScript archive. A TorchScript archive is code: load only models you trust.
 * PIPE_ERR_NOT_FOUND if the file is missing; PIPE_ERR_INVALID_FORMAT if it is not a TorchScript
 * archive or has no forward method. Global. */
PIPE_API pipe_status pipe_model_load(const char *path, pipe_model **model);

/* Number of forward inputs (not counting `self`). Thread-safe. */
PIPE_API pipe_status pipe_model_num_inputs(const pipe_model *model, size_t *count);

/* Name of forward input `index` as written in the model code (x, y, input_ids, ...); valid until
 * the model is destroyed. Thread-safe. */
PIPE_API pipe_status pipe_model_input_name(const pipe_model *model, size_t index,
                                           const char **name);

/* Number of modules in the model's module tree (the root included). Thread-safe. */
PIPE_API pipe_status pipe_model_num_modules(const pipe_model *model, size_t *count);

/* Module `index` of the tree, in pre-order: its dotted path ("" for the root, "layers.0.attn"),
 * its class name, its depth (0 for the root), and the number and bytes of the parameters it holds
 * with all its descendants (a tensor shared under two names counted once). Any output pointer may
 * be NULL when not wanted. Strings are valid until the model is destroyed. Thread-safe. */
PIPE_API pipe_status pipe_model_module(const pipe_model *model, size_t index, const char **path,
                                       const char **type_name, int32_t *depth, uint64_t *num_params,
                                       uint64_t *param_bytes);

/* Free the model. Plans and sessions made from it keep what they need and stay valid.
 * NULL is ignored. Exclusive. */
PIPE_API void pipe_model_destroy(pipe_model *model);

/* ---- Plan ---------------------------------------------------------------------------------------- */

typedef struct pipe_plan pipe_plan;

/* How to cut a model: an opaque builder. Without one (or with an empty one) the cuts are the
 * pipe::split() markers in the model code. Exclusive per handle. */
typedef struct pipe_plan_options pipe_plan_options;

PIPE_API pipe_status pipe_plan_options_create(pipe_plan_options **options);
PIPE_API void pipe_plan_options_destroy(pipe_plan_options *options);

/* Cut at a module boundary, as PyTorch's SplitPoint: "FQN:begin" cuts just before module FQN
 * runs, "FQN:end" just after ("layers.3:end", "transformer.h.0:begin"). A module called several
 * times gives a cut at every call; "FQN@K:end" picks its K-th call (from 0). Repeatable.
 * PIPE_ERR_INVALID_ARGUMENT for bad syntax; unknown modules are reported by pipe_plan_create. */
PIPE_API pipe_status pipe_plan_options_add_split_point(pipe_plan_options *options, const char *split_point);

/* Ask for `num_stages` stages chosen by `policy` instead of split points:
 *   "uniform"  equal numbers of layers per stage; the layers are the calls of one module's
 *              children that share a class, the module with the most such calls winning
 *              (transformer.h.* in GPT-2, layers.* in Llama, layer1..layer4 in ResNet);
 *   "params"   the cut minimising the largest stage's parameter bytes;
 *   "time"     the cut minimising the slowest stage, measured on the example inputs.
 * Cuts never fall inside a layer or a `with` block. */
PIPE_API pipe_status pipe_plan_options_set_stages(pipe_plan_options *options, int32_t num_stages,
                                                  const char *policy);

/* Example inputs (forward's arguments in order; copied). Required by policy "time"; with any
 * split they make the plan report each stage's measured time and the balance. */
PIPE_API pipe_status pipe_plan_options_set_example_inputs(pipe_plan_options *options,
                                                          const DLManagedTensor *const *inputs,
                                                          size_t num_inputs);

/* Cut `model` into stages as `options` say (NULL: at the pipe::split() markers; a model without
 * markers gives one stage). PIPE_ERR_SPLIT when the model cannot be cut so: a marker or split
 * point inside an if/loop block or a `with` block, an unknown module (the message names the
 * nearest ones), a stage left empty, more stages than places to cut. PIPE_ERR_INVALID_ARGUMENT
 * for split points together with a stage count, an unknown policy, or N < 1.
 * Thread-safe on `model`; `options` is only read. */
PIPE_API pipe_status pipe_plan_create(const pipe_model *model, const pipe_plan_options *options,
                                      pipe_plan **plan);

/* Number of stages. Thread-safe. */
PIPE_API pipe_status pipe_plan_num_stages(const pipe_plan *plan, size_t *count);

/* What pipe_plan_stage_count_names / pipe_plan_stage_name enumerate. */
#define PIPE_NAMES_PARAMETERS 0 /* parameters the stage reads, original dotted names */
#define PIPE_NAMES_BUFFERS 1    /* buffers the stage reads, original dotted names */

/* Number of names of `kind` (a PIPE_NAMES_* value) in stage `stage`. Thread-safe. */
PIPE_API pipe_status pipe_plan_stage_count_names(const pipe_plan *plan, size_t stage, int32_t kind,
                                                 size_t *count);

/* Name `index` of `kind` in stage `stage`; valid until the plan is destroyed. Thread-safe. */
PIPE_API pipe_status pipe_plan_stage_name(const pipe_plan *plan, size_t stage, int32_t kind,
                                          size_t index, const char **name);

/* Bytes of parameters and buffers stage `stage` holds. Thread-safe. */
PIPE_API pipe_status pipe_plan_stage_param_bytes(const pipe_plan *plan, size_t stage,
                                                 uint64_t *bytes);

/* How each stage gets its weights. Start from PIPE_STAGE_OPTIONS_INIT. */

/* Floating parameters, buffers and inputs keep their dtype / become float32 / float16 / bfloat16.
 * Integer and bool tensors are never converted. */
#define PIPE_DTYPE_KEEP 0
#define PIPE_DTYPE_FLOAT32 1
#define PIPE_DTYPE_FLOAT16 2
#define PIPE_DTYPE_BFLOAT16 3

/* Weight loading progress: `bytes_done` of the `bytes_total` stage `stage` reads. Called on the
 * thread that builds the stage; must not call back into libpipe. */
typedef void (*pipe_progress_fn)(void *user_data, size_t stage, uint64_t bytes_done, uint64_t bytes_total);

typedef struct pipe_stage_options {
  uint32_t struct_size;
  /* A dtype for floating weights (PIPE_DTYPE_*); inputs are converted to it too. */
  int32_t dtype;
  /* A safetensors checkpoint: one .safetensors file, or a Hugging Face style index
   * (*.safetensors.index.json, "weight_map": tensor name -> shard file next to it). Each stage
   * reads only its own tensors, memory-mapped. Names match exactly, through tied names (a head
   * tied to the embedding and stored once), or with a leading prefix such as "model." added or
   * removed. This is how a skeleton model (weights on the meta device) gets its weights; for a
   * full model it overrides them. NULL: keep the model's own weights. */
  const char *weights;
  pipe_progress_fn progress; /* NULL: no progress reports */
  void *progress_user_data;
} pipe_stage_options;

#define PIPE_STAGE_OPTIONS_INIT {(uint32_t)sizeof(pipe_stage_options), PIPE_DTYPE_KEEP, NULL, NULL, NULL}

/* Measured time of stage `stage` on the example inputs in milliseconds, or -1 when the plan was
 * made without example inputs. Thread-safe. */
PIPE_API pipe_status pipe_plan_stage_estimated_ms(const pipe_plan *plan, size_t stage, double *ms);

/* Save stage `stage` as a standalone TorchScript file: forward(<its inputs>) runs the stage and
 * the file holds only the parameters and buffers that stage reads, under their original names,
 * loaded and converted as `options` say (NULL: the model's own weights). torch.jit.load /
 * torch::jit::load reload it. Errors about weights name the tensor and the stage:
 * PIPE_ERR_NOT_FOUND (a tensor missing from the checkpoint, a missing shard), PIPE_ERR_INPUT
 * (shape or dtype mismatch), PIPE_ERR_INVALID_FORMAT (a corrupt checkpoint),
 * PIPE_ERR_INVALID_ARGUMENT (a skeleton's tensor left without data). Thread-safe. */
PIPE_API pipe_status pipe_plan_save_stage(const pipe_plan *plan, size_t stage, const pipe_stage_options *options,
                                          const char *path);

/* The whole plan as JSON:
 *   {"num_stages": N, "method": "pipe::split() markers" | "split points" | "policy <name>",
 *    "balance": sum(t) / (N * max t) or null,
 *    "boundaries": [{"between": [i, i+1], "reason": "layers.0:end (call 0)"}],
 *    "stages": [{"index": i, "parameters": [...], "buffers": [...], "param_bytes": n,
 *                "estimated_ms": t or null, "num_nodes": k,
 *                "inputs": [{"name": ..., "from": <stage index> or "input"}],
 *                "outputs": [{"name": ..., "to": [stage indices] or "caller"}]}]}
 * ("input" is a forward argument of the model; "caller" is the model's result.)
 * Valid until the plan is destroyed. Thread-safe. */
PIPE_API pipe_status pipe_plan_describe(const pipe_plan *plan, const char **json);

/* Free the plan. Sessions made from it stay valid. NULL is ignored. Exclusive. */
PIPE_API void pipe_plan_destroy(pipe_plan *plan);

/* ---- Session ------------------------------------------------------------------------------------ */

typedef struct pipe_session pipe_session;

/* How one input is cut into micro-batches, or how one output is put back together. */
typedef struct pipe_chunk_spec {
  int32_t kind; /* a PIPE_CHUNK_* value */
  int32_t dim;  /* the dimension for SPLIT and CONCAT; negative counts from the end */
} pipe_chunk_spec;

/* Inputs: tensors of rank >= 1 split along 0, everything else replicated. Outputs: concat along 0. */
#define PIPE_CHUNK_DEFAULT 0
/* Input: split along `dim` (torch.tensor_split sizes; every split input must agree on the size). */
#define PIPE_CHUNK_SPLIT 1
/* Input: every micro-batch gets the whole tensor. */
#define PIPE_CHUNK_REPLICATE 2
/* Output: concatenate the micro-batches' results along `dim`. */
#define PIPE_CHUNK_CONCAT 3
/* Output: add the micro-batches' results (e.g. a loss or a count summed over the batch). */
#define PIPE_CHUNK_SUM 4
/* Output: every micro-batch must give the same value, which is returned once; differing values
 * fail the call with PIPE_ERR_EXECUTION. */
#define PIPE_CHUNK_EQUAL 5

/* Session options. Always start from PIPE_SESSION_OPTIONS_INIT: fields are only ever added at the
 * end, and `struct_size` tells the library which ones the caller knows about. */
typedef struct pipe_session_options {
  uint32_t struct_size;
  /* Micro-batches per call (>= 1); see `microbatching` for when a call gets fewer. A batch
   * smaller than this runs as that many micro-batches, with a logged warning. Default 1. */
  int32_t num_microbatches;
  /* Intra-op threads per stage worker; 0 picks max(1, cores / stages) so that stages do not
   * oversubscribe the machine. Default 0. */
  int32_t threads_per_stage;
  /* Micro-batches admitted into the pipeline at once, over all calls; submitting more waits for
   * room (backpressure). 0 picks max(2 x num_microbatches, 4 x stages). Default 0. */
  int32_t max_inflight;
  /* Per forward argument, in order (NULL / fewer than the inputs: the rest are DEFAULT). */
  const pipe_chunk_spec *input_specs;
  size_t num_input_specs;
  /* Per output in the order pipe_session_run names them (NULL / fewer: the rest CONCAT along 0). */
  const pipe_chunk_spec *output_specs;
  size_t num_output_specs;
  /* Weights and dtype of every stage (NULL: the model's own weights, dtypes kept). */
  const pipe_stage_options *stage_options;
  /* PIPE_MICROBATCHING_ADAPTIVE (default) or PIPE_MICROBATCHING_FIXED. Since 0.3. */
  int32_t microbatching;
  /* How stages talk: PIPE_TRANSPORT_LOCAL (default: every stage in this process),
   * PIPE_TRANSPORT_GLOO (CPU stages spread over world_size processes) or PIPE_TRANSPORT_NCCL
   * (GPU stages spread over world_size processes, one GPU each). Since 0.4. */
  int32_t transport;
  /* Processes taking part, this one (rank 0, the driver) included; the others are workers
   * (pipe_worker_run / `pipe worker`) with ranks 1 .. world_size-1. The stages are spread over
   * the ranks in order, in contiguous groups as equal in count as possible (rank 0 gets the first
   * stages, and every rank at least one). 1 (or 0) with PIPE_TRANSPORT_LOCAL. Since 0.4. */
  int32_t world_size;
  /* "HOST:PORT" of the rendezvous store (c10d's TCPStore), which this process hosts: it listens
   * on PORT, and HOST is this machine's address as the workers reach it (also the address its
   * transport listens on). Required unless the transport is local. Since 0.4. */
  const char *store;
  /* How long a worker may stay silent while it holds work (and how long joining and loading the
   * stages may take) before the session fails its calls with PIPE_ERR_COMMUNICATION and reports
   * itself broken. A worker that dies is noticed at once. 0 means 60000 (one minute). Since 0.4. */
  int32_t comm_timeout_ms;
  /* Where each stage runs, as a comma-separated list: one device per stage ("cpu,cuda:0"), one
   * device for every stage ("cuda:0"), or "auto" (the visible GPUs in order, each taking a
   * contiguous group of stages; every stage on the CPU when there is no GPU). Devices are "cpu",
   * "cuda" (cuda:0) and "cuda:N". NULL or "": every stage on the CPU. Each stage's weights go
   * only to its own device (from a checkpoint through pinned memory); each GPU stage queues its
   * work on a CUDA stream of its own, and a micro-batch passes to the next stage with an event,
   * not a host synchronisation. Stages in worker processes (Gloo) run on the devices named here,
   * of the machine they run on. With PIPE_TRANSPORT_NCCL it must be NULL: every process runs its
   * stages on its own GPU. PIPE_ERR_UNSUPPORTED, naming the stage, for a device this machine
   * does not have (or a libpipe whose LibTorch has no CUDA); PIPE_ERR_INVALID_ARGUMENT for a
   * malformed list or one whose length is neither 1 nor the number of stages. Copied. Since 0.5. */
  const char *devices;
  /* PIPE_OUTPUTS_ON_CPU (default): results come back in CPU memory. PIPE_OUTPUTS_ON_DEVICE:
   * results stay on the last stage's device (DLPack kDLCUDA for a GPU), ready to read on the
   * calling thread's current CUDA stream when the call returns. Since 0.5. */
  int32_t outputs;
} pipe_session_options;

#define PIPE_OUTPUTS_ON_CPU 0
#define PIPE_OUTPUTS_ON_DEVICE 1

#define PIPE_TRANSPORT_LOCAL 0
#define PIPE_TRANSPORT_GLOO 1
#define PIPE_TRANSPORT_NCCL 2

/* A call that finds the pipeline empty is cut into num_microbatches; a call that arrives while
 * others are in flight gets only as many as bring the pipeline to one micro-batch per stage
 * (at least 1). Other calls already keep the stages busy then, and finer cuts would only cost
 * efficiency (smaller matrix products, each stage's weights read once per micro-batch). */
#define PIPE_MICROBATCHING_ADAPTIVE 0
/* Every call is cut into num_microbatches, e.g. to bound the activation memory of one
 * micro-batch. */
#define PIPE_MICROBATCHING_FIXED 1

#define PIPE_SESSION_OPTIONS_INIT \
  {(uint32_t)sizeof(pipe_session_options), 1, 0, 0, NULL, 0, NULL, 0, NULL, PIPE_MICROBATCHING_ADAPTIVE, \
   PIPE_TRANSPORT_LOCAL, 1, NULL, 0, NULL, PIPE_OUTPUTS_ON_CPU}

/* Build every stage of `plan` on its device (options->devices; the CPU by default), loading weights
 * as options->stage_options says, and start one worker thread per stage. `options` NULL means
 * PIPE_SESSION_OPTIONS_INIT; the spec arrays and the device list are copied. Weight errors as for
 * pipe_plan_save_stage. Thread-safe on `plan`.
 * With a Gloo or NCCL transport this process hosts the rendezvous store at options->store, waits
 * (up to comm_timeout_ms) for the world_size-1 workers to join, sends each one its stages
 * (without their weights when stage_options->weights names a checkpoint: each worker then reads
 * its own stages' tensors from that path, which must be readable there), waits for them to load,
 * and warms up every connection. PIPE_ERR_COMMUNICATION (naming the missing ranks or the
 * unusable address) when that fails; PIPE_ERR_INVALID_ARGUMENT for fewer stages than processes or
 * a malformed address; PIPE_ERR_UNSUPPORTED for NCCL in a build or on a machine without it. */
PIPE_API pipe_status pipe_session_create(const pipe_plan *plan, const pipe_session_options *options,
                                         pipe_session **session);

/* Per-call options. Start from PIPE_RUN_OPTIONS_INIT. */
typedef struct pipe_run_options {
  uint32_t struct_size;
  /* The call fails with PIPE_ERR_DEADLINE_EXCEEDED if it has not finished this many
   * milliseconds after it started (waiting for room in the pipeline included). 0: no deadline. */
  int64_t timeout_ms;
} pipe_run_options;

#define PIPE_RUN_OPTIONS_INIT {(uint32_t)sizeof(pipe_run_options), 0}

/* Run one call through the pipeline and block until it is done. `inputs` are the forward
 * arguments in order (pipe_model_input_name names them), borrowed: when this returns, with any
 * status, libpipe no longer reads them. `options` may be NULL. On success `*outputs` is a new list
 * the caller destroys: one entry "output" for a tensor result, "output.0", "output.1", ... for a
 * tuple or list, "output.<key>" for a dict (nested containers join with '.').
 * Inputs may be on any device: each stage brings what it reads to its own device.
 * PIPE_ERR_INPUT for a wrong input count or inputs that do not split; PIPE_ERR_EXECUTION if a
 * stage raised (the message names the stage); PIPE_ERR_OUT_OF_MEMORY if a stage ran out of
 * memory on its device (e.g. a GPU; only that call fails); PIPE_ERR_DEADLINE_EXCEEDED;
 * PIPE_ERR_CANCELLED if the session is being destroyed. The session stays usable after a failed
 * call.
 * Thread-safe: many threads may run on one session at once; their micro-batches interleave. */
PIPE_API pipe_status pipe_session_run(pipe_session *session, const DLManagedTensor *const *inputs,
                                      size_t num_inputs, const pipe_run_options *options,
                                      pipe_tensor_list **outputs);

/* An asynchronous call. */
typedef struct pipe_request pipe_request;

/* Start one call and return without waiting for it (it may wait for room when max_inflight
 * micro-batches are already in the pipeline). The inputs are copied, so the caller may free them
 * as soon as this returns. Errors in the inputs (count, batch sizes) are reported here; errors
 * while running are reported by pipe_request_wait. Thread-safe. */
PIPE_API pipe_status pipe_session_submit(pipe_session *session, const DLManagedTensor *const *inputs,
                                         size_t num_inputs, const pipe_run_options *options,
                                         pipe_request **request);

/* Wait for the call. `timeout_ms` < 0 waits as long as it takes; 0 only checks. Returns
 * PIPE_ERR_TIMEOUT if it is still running when the time is up (wait again, cancel, or destroy);
 * otherwise the call's own status, and on PIPE_OK a new `*outputs` list (as pipe_session_run's).
 * A finished call may be waited for again and gives the same result. Exclusive per request. */
PIPE_API pipe_status pipe_request_wait(pipe_request *request, int64_t timeout_ms, pipe_tensor_list **outputs);

/* Ask the call to stop: micro-batches not yet run are dropped and it fails with
 * PIPE_ERR_CANCELLED. A call that already finished keeps its result. Thread-safe. */
PIPE_API pipe_status pipe_request_cancel(pipe_request *request);

/* Free the request; a call still running is cancelled. It may outlive its session. NULL is
 * ignored. Exclusive. */
PIPE_API void pipe_request_destroy(pipe_request *request);

/* Number of stages of the session (those in worker processes included). Thread-safe. */
PIPE_API pipe_status pipe_session_num_stages(const pipe_session *session, size_t *count);

/* What one stage worker has done since the session was created. Start from
 * PIPE_STAGE_STATS_INIT; the library fills the fields that `struct_size` covers. */
typedef struct pipe_stage_stats {
  uint32_t struct_size;
  uint64_t microbatches; /* micro-batches run (failed ones included) */
  uint64_t failures;     /* micro-batches whose stage code raised */
  double busy_ms;        /* time spent running the stage (a GPU stage: queueing its work) */
  double idle_ms;        /* time spent waiting for work */
  uint64_t queue_depth;  /* micro-batches waiting for this stage now */
} pipe_stage_stats;

#define PIPE_STAGE_STATS_INIT {(uint32_t)sizeof(pipe_stage_stats), 0, 0, 0.0, 0.0, 0}

/* Statistics of stage `stage`. A stage hosted by a worker process reports zeros (its process
 * keeps no statistics for the driver yet). Thread-safe. */
PIPE_API pipe_status pipe_session_stage_stats(const pipe_session *session, size_t stage, pipe_stage_stats *stats);

/* Record a timeline of every micro-batch each stage runs from now on (clears an earlier one).
 * Thread-safe. */
PIPE_API pipe_status pipe_session_trace_start(pipe_session *session);

/* Stop recording and write the timeline to `path` as Chrome trace JSON (the Trace Event Format:
 * one track per stage, one slice per micro-batch; open it in Perfetto or chrome://tracing).
 * `path` NULL discards it. Thread-safe. */
PIPE_API pipe_status pipe_session_trace_stop(pipe_session *session, const char *path);

/* PIPE_OK while the session works; PIPE_ERR_COMMUNICATION (with the reason as the last error)
 * once a transport failure broke it: every later call fails with that status at once, and the
 * session should be destroyed and created again. Thread-safe. Since 0.4. */
PIPE_API pipe_status pipe_session_check(const pipe_session *session);

/* Stop the workers and free the session. Calls still in flight fail with PIPE_ERR_CANCELLED
 * (their requests stay valid). Worker processes of a Gloo or NCCL session are told to finish and
 * pipe_worker_run returns PIPE_OK there (a broken session just closes its connections; its
 * workers then return PIPE_ERR_COMMUNICATION). Never blocks longer than comm_timeout_ms.
 * No pipe_session_run or pipe_session_submit on this session may be running in another thread.
 * NULL is ignored. Exclusive. */
PIPE_API void pipe_session_destroy(pipe_session *session);

/* ---- Workers ---------------------------------------------------------------------------------- */

/* What a worker process needs to join a session. Start from PIPE_WORKER_OPTIONS_INIT. Since 0.4. */
typedef struct pipe_worker_options {
  uint32_t struct_size;
  /* This worker's rank, 1 .. world_size-1 (rank 0 is the driver that creates the session). */
  int32_t rank;
  /* Processes in the session, the driver included; must match the driver's. */
  int32_t world_size;
  /* "HOST:PORT" of the driver's rendezvous store. */
  const char *store;
  /* How long to keep trying to reach the store, and to wait for the driver's stages, before
   * failing with PIPE_ERR_COMMUNICATION. 0 means 60000 (one minute). Once serving, a worker waits
   * for work as long as its driver is alive. */
  int32_t comm_timeout_ms;
  /* Intra-op threads per stage; 0 takes the driver's setting (its share of the cores when all
   * processes share one machine). */
  int32_t threads_per_stage;
} pipe_worker_options;

#define PIPE_WORKER_OPTIONS_INIT {(uint32_t)sizeof(pipe_worker_options), 0, 0, NULL, 0, 0}

/* Join the session whose driver hosts the store at options->store, receive this rank's stages,
 * and run them for that session until it is destroyed (then PIPE_OK). PIPE_ERR_COMMUNICATION if
 * the store cannot be reached within comm_timeout_ms (the message names the address), the rank is
 * taken, the driver's libpipe version differs, or the driver goes away; PIPE_ERR_INVALID_ARGUMENT
 * for a rank or world size out of range. Errors in this worker's stages are reported to the
 * driver's calls, not here. Blocks; serves one session. Global. Since 0.4. */
PIPE_API pipe_status pipe_worker_run(const pipe_worker_options *options);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PIPE_PIPE_H */
