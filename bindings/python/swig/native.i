/* SWIG interface for libpipe's C ABI: generates the extension module `libpipe._native`.
 *
 * The functions of pipe/pipe.h are wrapped one to one, with typemaps that make them Pythonic at
 * the edges and nothing more (the friendly API is the pure-Python package around it):
 *   - a pipe_status other than PIPE_OK raises libpipe.errors.Error (the subclass for the code)
 *     carrying the code and pipe_last_error(), read on the same thread right after the call;
 *   - output parameters become return values (handles as opaque SWIG pointers, counts as int,
 *     strings as str; several outputs as a list);
 *   - a pipe_tensor_list result becomes a list of (name, capsule) pairs: every entry is taken out
 *     of the list into a "dltensor" PyCapsule (no copy) and the list is destroyed; whoever
 *     consumes a capsule (torch.from_dlpack, numpy.from_dlpack) owns the tensor, and a capsule
 *     nobody consumed frees it when it is collected;
 *   - tensor arguments are sequences of "dltensor" capsules (or objects with __dlpack__); the
 *     DLManagedTensor inside is borrowed for the call, never consumed, as pipe.h expects;
 *   - option structs are built from dicts / ints (the Python layer fills them in), each started
 *     from libpipe's defaults at run time (pipe_*_init).
 *
 * The GIL: the module is generated with -threads, so every wrapped pipe_* call runs with the GIL
 * released (argument conversion and result conversion hold it). That covers the blocking calls
 * (pipe_model_load, pipe_plan_create, pipe_session_create, pipe_session_run, pipe_session_submit,
 * pipe_request_wait, pipe_generator_create, the destroy functions that join worker threads, file
 * reads and writes, pipe_worker_run, which serves a whole session) and costs nothing measurable on
 * the quick ones. Helpers below that touch Python objects are marked
 * %nothread. Nothing in this module calls back into Python from libpipe's worker threads: that is
 * why pipe_request_on_done and pipe_generation_on_event are not wrapped (their callbacks run on a
 * libpipe thread, where Python would need the GIL); asyncio learns that a call finished from
 * pipe_request_fd, and that a generation has tokens from pipe_generation_fd, instead.
 */
%module(docstring="Low-level SWIG wrapper of libpipe's C ABI (pipe/pipe.h). Use the libpipe package.") native

%{
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <pipe/pipe.h>

/* Generators are 0.8's, traces with operator timing (pipe_session_trace_start_with_operators) 0.9's
 * and pipe_model_format (Model.format) 0.10's: SWIG wraps only what the header declares, so
 * against an older header say so here, rather than leave Python to report a missing attribute. */
#if PIPE_VERSION_MAJOR == 0 && PIPE_VERSION_MINOR < 10
#error "the Python binding needs libpipe >= 0.10 (pipe.h found through pkg-config libpipe is older)"
#endif

/* Raises the libpipe.errors exception for `status`, with the message of the failed call. Must run
 * before any other libpipe call on this thread: the message is per thread and lives until then. */
static void libpipe_raise(pipe_status status) {
  const char *message = pipe_last_error();
  PyObject *text = PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
  PyObject *module = text ? PyImport_ImportModule("libpipe.errors") : NULL;
  PyObject *error = module ? PyObject_CallMethod(module, "from_status", "iO", (int)status, text) : NULL;
  if (error) PyErr_SetObject((PyObject *)Py_TYPE(error), error);
  Py_XDECREF(error);
  Py_XDECREF(module);
  Py_XDECREF(text);
}

static PyObject *libpipe_str(const char *s) {
  if (!s) Py_RETURN_NONE;
  return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace");
}

/* A capsule still named "dltensor" was never consumed, so the tensor is still ours to free. A
 * consumer renames it "used_dltensor" and calls the deleter itself when done (DLPack protocol). */
static void libpipe_capsule_destructor(PyObject *capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  DLManagedTensor *tensor = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
  if (tensor && tensor->deleter) tensor->deleter(tensor);
  PyErr_Restore(type, value, traceback);
}

/* Moves every tensor of `list` into a capsule and destroys the list. Returns [(name, capsule)]. */
static PyObject *libpipe_take_list(pipe_tensor_list *list) {
  size_t count = 0;
  PyObject *result = NULL;
  pipe_status st = pipe_tensor_list_size(list, &count);
  if (st != PIPE_OK) {
    libpipe_raise(st);
    goto done;
  }
  result = PyList_New((Py_ssize_t)count);
  if (!result) goto done;
  for (size_t i = 0; i < count; ++i) {
    const char *name = NULL;
    DLManagedTensor *tensor = NULL;
    st = pipe_tensor_list_name(list, i, &name);
    if (st == PIPE_OK) st = pipe_tensor_list_take(list, i, &tensor);
    if (st != PIPE_OK) {
      libpipe_raise(st);
      Py_CLEAR(result);
      goto done;
    }
    PyObject *capsule = PyCapsule_New(tensor, "dltensor", libpipe_capsule_destructor);
    if (!capsule) {
      if (tensor->deleter) tensor->deleter(tensor);
      Py_CLEAR(result);
      goto done;
    }
    PyObject *entry = Py_BuildValue("(NN)", libpipe_str(name), capsule);
    if (!entry) {
      Py_CLEAR(result);
      goto done;
    }
    PyList_SET_ITEM(result, (Py_ssize_t)i, entry);
  }
done:
  pipe_tensor_list_destroy(list);
  return result;
}

/* The borrowed DLManagedTensor of one argument: a "dltensor" capsule, or an object whose
 * __dlpack__() gives one. Returns a new reference to the capsule (kept alive for the call). */
static PyObject *libpipe_as_capsule(PyObject *item, Py_ssize_t index) {
  if (PyCapsule_CheckExact(item)) {
    if (!PyCapsule_IsValid(item, "dltensor")) {
      PyErr_Format(PyExc_ValueError,
                   "input %zd: the DLPack capsule was already consumed or is not a \"dltensor\" capsule",
                   index);
      return NULL;
    }
    Py_INCREF(item);
    return item;
  }
  if (PyObject_HasAttrString(item, "__dlpack__")) {
    PyObject *capsule = PyObject_CallMethod(item, "__dlpack__", NULL);
    if (!capsule) return NULL;
    if (!PyCapsule_IsValid(capsule, "dltensor")) {
      Py_DECREF(capsule);
      PyErr_Format(PyExc_ValueError, "input %zd: __dlpack__() did not return a \"dltensor\" capsule", index);
      return NULL;
    }
    return capsule;
  }
  PyErr_Format(PyExc_TypeError, "input %zd: expected a DLPack capsule or an object with __dlpack__, got %s",
               index, Py_TYPE(item)->tp_name);
  return NULL;
}

/* Optional int field `key` of dict `d` into *out (left as it is when absent or None). */
static int libpipe_dict_int32(PyObject *d, const char *key, int32_t *out) {
  PyObject *v = PyDict_GetItemString(d, key);
  if (!v || v == Py_None) return 0;
  long x = PyLong_AsLong(v);
  if (x == -1 && PyErr_Occurred()) return -1;
  if (x < INT32_MIN || x > INT32_MAX) {
    PyErr_Format(PyExc_OverflowError, "%s=%ld is out of range", key, x);
    return -1;
  }
  *out = (int32_t)x;
  return 0;
}

/* Optional list of (kind, dim) pairs `key` of dict `d`, as a malloc'ed array. */
static int libpipe_dict_specs(PyObject *d, const char *key, pipe_chunk_spec **out, size_t *count) {
  PyObject *v = PyDict_GetItemString(d, key);
  if (!v || v == Py_None) return 0;
  PyObject *seq = PySequence_Fast(v, "chunk specs must be a sequence of (kind, dim) pairs");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  pipe_chunk_spec *specs = (pipe_chunk_spec *)calloc(n ? (size_t)n : 1, sizeof *specs);
  if (!specs) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    int kind = 0, dim = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ii", &kind, &dim)) {
      free(specs);
      Py_DECREF(seq);
      return -1;
    }
    specs[i].kind = kind;
    specs[i].dim = dim;
  }
  Py_DECREF(seq);
  *out = specs;
  *count = (size_t)n;
  return 0;
}

/* Starts a versioned struct from libpipe's defaults (pipe_<struct>_init); -1 with the exception set
 * if libpipe refuses (it cannot for the sizeof this module was compiled with, unless the loaded
 * library is older than its header). */
#define LIBPIPE_INIT(FN, PTR) libpipe_init_status(FN((PTR), sizeof *(PTR)))
static int libpipe_init_status(pipe_status status) {
  if (status == PIPE_OK) return 0;
  libpipe_raise(status);
  return -1;
}

/* Stage options from a dict {"dtype": int, "weights": str, "quantize": int, "quantize_group": int,
 * "quantize_head": int, "quantize_embedding": int}. `keep` receives a reference
 * that keeps the weights string alive for the call. */
static int libpipe_stage_options(PyObject *d, pipe_stage_options *options, PyObject **keep) {
  if (LIBPIPE_INIT(pipe_stage_options_init, options) < 0) return -1;
  if (libpipe_dict_int32(d, "dtype", &options->dtype) < 0) return -1;
  if (libpipe_dict_int32(d, "quantize", &options->quantize) < 0) return -1;
  int32_t group = 0;
  if (libpipe_dict_int32(d, "quantize_group", &group) < 0) return -1;
  options->quantize_group = group;
  if (libpipe_dict_int32(d, "quantize_head", &options->quantize_head) < 0) return -1;
  int32_t embedding = PIPE_QUANTIZE_EMBEDDING_NONE;
  if (libpipe_dict_int32(d, "quantize_embedding", &embedding) < 0) return -1;
  options->quantize_embedding = embedding;
  PyObject *weights = PyDict_GetItemString(d, "weights");
  if (weights && weights != Py_None) {
    PyObject *bytes = PyUnicode_EncodeFSDefault(weights);
    if (!bytes) return -1;
    options->weights = PyBytes_AS_STRING(bytes);
    *keep = bytes;
  }
  return 0;
}

static int libpipe_check_keys(PyObject *d, const char *const *allowed, const char *what) {
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(d, &pos, &key, &value)) {
    const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
    int known = 0;
    for (const char *const *a = allowed; name && *a; ++a) known |= strcmp(name, *a) == 0;
    if (!known) {
      PyErr_Format(PyExc_TypeError, "unknown %s option %R", what, key);
      return -1;
    }
  }
  return 0;
}

/* Optional str field `key` of dict `d` as UTF-8 into *out (left as it is when absent or None).
 * `keep` receives the bytes object that holds the string; the caller releases it after the call. */
static int libpipe_dict_str(PyObject *d, const char *key, const char **out, PyObject **keep) {
  PyObject *v = PyDict_GetItemString(d, key);
  if (!v || v == Py_None) return 0;
  if (!PyUnicode_Check(v)) {
    PyErr_Format(PyExc_TypeError, "%s must be a str, not %s", key, Py_TYPE(v)->tp_name);
    return -1;
  }
  PyObject *bytes = PyUnicode_AsUTF8String(v);
  if (!bytes) return -1;
  if (strlen(PyBytes_AS_STRING(bytes)) != (size_t)PyBytes_GET_SIZE(bytes)) {
    Py_DECREF(bytes);
    PyErr_Format(PyExc_ValueError, "%s must not contain NUL characters", key);
    return -1;
  }
  *out = PyBytes_AS_STRING(bytes);
  *keep = bytes;
  return 0;
}

/* Optional int64 field `key` of dict `d` into *out (left as it is when absent or None). */
static int libpipe_dict_int64(PyObject *d, const char *key, int64_t *out) {
  PyObject *v = PyDict_GetItemString(d, key);
  if (!v || v == Py_None) return 0;
  long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) return -1;
  *out = (int64_t)x;
  return 0;
}

/* Optional uint64 field `key` of dict `d` into *out (left as it is when absent or None). */
static int libpipe_dict_uint64(PyObject *d, const char *key, uint64_t *out) {
  PyObject *v = PyDict_GetItemString(d, key);
  if (!v || v == Py_None) return 0;
  unsigned long long x = PyLong_AsUnsignedLongLong(v);
  if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *out = (uint64_t)x;
  return 0;
}

/* Optional float field `key` of dict `d` into *out (left as it is when absent or None). */
static int libpipe_dict_double(PyObject *d, const char *key, double *out) {
  PyObject *v = PyDict_GetItemString(d, key);
  if (!v || v == Py_None) return 0;
  double x = PyFloat_AsDouble(v);
  if (x == -1.0 && PyErr_Occurred()) return -1;
  *out = x;
  return 0;
}

/* A sequence of ints as a malloc'ed int64 array (never NULL, so that an empty sequence is told
 * apart from a failure; the count says how many). `what` names the argument in errors. */
static int libpipe_int64_array(PyObject *obj, const char *what, int64_t **out, size_t *count) {
  PyObject *seq = PySequence_Fast(obj, what);
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  int64_t *array = (int64_t *)malloc((n ? (size_t)n : 1) * sizeof *array);
  if (!array) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long x = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (x == -1 && PyErr_Occurred()) {
      free(array);
      Py_DECREF(seq);
      return -1;
    }
    array[i] = (int64_t)x;
  }
  Py_DECREF(seq);
  *out = array;
  *count = (size_t)n;
  return 0;
}

typedef struct {
  pipe_session_options session;
  pipe_stage_options stage;
  pipe_chunk_spec *input_specs;
  pipe_chunk_spec *output_specs;
  PyObject *keep;
  PyObject *keep_store;
  PyObject *keep_devices;
  PyObject *keep_token;
} libpipe_session_options_holder;
%}

/* LP64 (libpipe asserts DLPack's LP64 layout): int64_t is `long`, as in <stdint.h>, so the casts
 * SWIG writes agree with the real prototypes (pipe_generator_submit's const int64_t *). */
#define SWIGWORDSIZE64
%include <stdint.i>

/* ---- status codes become exceptions --------------------------------------------------------- */

%typemap(out) pipe_status {
  if ($1 != PIPE_OK) {
    libpipe_raise($1);
    SWIG_fail;
  }
  $result = SWIG_Py_Void();
}

/* ---- output parameters become return values ------------------------------------------------- */

%define LIBPIPE_HANDLE_OUTPUT(TYPE)
%typemap(in, numinputs=0) TYPE ** (TYPE *tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) TYPE ** {
  $result = SWIG_Python_AppendOutput($result, SWIG_NewPointerObj(SWIG_as_voidptr(*$1), $*1_descriptor, 0));
}
%enddef
LIBPIPE_HANDLE_OUTPUT(pipe_model)
LIBPIPE_HANDLE_OUTPUT(pipe_plan)
LIBPIPE_HANDLE_OUTPUT(pipe_plan_options)
LIBPIPE_HANDLE_OUTPUT(pipe_session)
LIBPIPE_HANDLE_OUTPUT(pipe_request)
LIBPIPE_HANDLE_OUTPUT(pipe_generator)
LIBPIPE_HANDLE_OUTPUT(pipe_generation)
LIBPIPE_HANDLE_OUTPUT(pipe_tokenizer)
LIBPIPE_HANDLE_OUTPUT(pipe_decode_stream)

%define LIBPIPE_VALUE_OUTPUT(TYPE, CONVERT)
%typemap(in, numinputs=0) TYPE * (TYPE tmp = 0) "$1 = ($1_ltype)&tmp;"
%typemap(argout) TYPE * { $result = SWIG_Python_AppendOutput($result, CONVERT(*$1)); }
%enddef
LIBPIPE_VALUE_OUTPUT(size_t, PyLong_FromSize_t)
LIBPIPE_VALUE_OUTPUT(uint64_t, PyLong_FromUnsignedLongLong)
LIBPIPE_VALUE_OUTPUT(int32_t, PyLong_FromLong)
LIBPIPE_VALUE_OUTPUT(double, PyFloat_FromDouble)
/* pipe_tokenizer_vocab_size's and pipe_tokenizer_special_ids' ids (named: an `int64_t *` input elsewhere
 * must not become an output). */
%define LIBPIPE_INT64_OUTPUT(NAME)
%typemap(in, numinputs=0) int64_t *NAME (int64_t tmp = 0) "$1 = ($1_ltype)&tmp;"
%typemap(argout) int64_t *NAME { $result = SWIG_Python_AppendOutput($result, PyLong_FromLongLong((long long)*$1)); }
%enddef
LIBPIPE_INT64_OUTPUT(size)
LIBPIPE_INT64_OUTPUT(bos)
LIBPIPE_INT64_OUTPUT(eos)
LIBPIPE_INT64_OUTPUT(pad)

/* pipe_request_fd's and pipe_generation_fd's descriptor, as an int (named, so that no other int * is
 * taken for an output). */
%typemap(in, numinputs=0) int *fd (int tmp = -1) "$1 = &tmp;"
%typemap(argout) int *fd { $result = SWIG_Python_AppendOutput($result, PyLong_FromLong(*$1)); }

%typemap(in, numinputs=0) const char ** (const char *tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) const char ** { $result = SWIG_Python_AppendOutput($result, libpipe_str(*$1)); }

/* A tensor list result: [(name, capsule), ...]; the list itself never reaches Python. */
%typemap(in, numinputs=0) pipe_tensor_list ** (pipe_tensor_list *tmp = NULL) "$1 = ($1_ltype)&tmp;"
%typemap(argout) pipe_tensor_list ** {
  PyObject *entries = libpipe_take_list(*$1);
  if (!entries) SWIG_fail;
  $result = SWIG_Python_AppendOutput($result, entries);
}

%typemap(in, numinputs=0) pipe_stage_stats * (pipe_stage_stats tmp) {
  if (LIBPIPE_INIT(pipe_stage_stats_init, &tmp) < 0) SWIG_fail;
  $1 = &tmp;
}
%typemap(argout) pipe_stage_stats * {
  $result = SWIG_Python_AppendOutput($result, Py_BuildValue(
      "{s:K,s:K,s:d,s:d,s:K}", "microbatches", (unsigned long long)$1->microbatches,
      "failures", (unsigned long long)$1->failures, "busy_ms", $1->busy_ms, "idle_ms", $1->idle_ms,
      "queue_depth", (unsigned long long)$1->queue_depth));
}

/* ---- generation: the structs libpipe fills in become dicts ----------------------------------- */

%typemap(in, numinputs=0) pipe_generator_info * (pipe_generator_info tmp) {
  if (LIBPIPE_INIT(pipe_generator_info_init, &tmp) < 0) SWIG_fail;
  $1 = &tmp;
}
%typemap(argout) pipe_generator_info * {
  $result = SWIG_Python_AppendOutput($result, Py_BuildValue(
      "{s:L,s:L,s:L,s:K}", "slots", (long long)$1->slots, "max_len", (long long)$1->max_len,
      "vocab", (long long)$1->vocab, "cache_bytes_per_slot", (unsigned long long)$1->cache_bytes_per_slot));
}

%typemap(in, numinputs=0) pipe_generator_stats * (pipe_generator_stats tmp) {
  if (LIBPIPE_INIT(pipe_generator_stats_init, &tmp) < 0) SWIG_fail;
  $1 = &tmp;
}
%typemap(argout) pipe_generator_stats * {
  $result = SWIG_Python_AppendOutput($result, Py_BuildValue(
      "{s:L,s:L,s:K,s:K,s:K,s:K,s:d,s:d,s:d,s:d,s:d,s:L,s:K,s:K,s:K}", "slots_in_use", (long long)$1->slots_in_use,
      "queued", (long long)$1->queued, "sequences_finished", (unsigned long long)$1->sequences_finished,
      "prompt_tokens", (unsigned long long)$1->prompt_tokens,
      "generated_tokens", (unsigned long long)$1->generated_tokens, "steps", (unsigned long long)$1->steps,
      "tokens_per_s", $1->tokens_per_s, "mean_time_to_first_token_ms", $1->mean_time_to_first_token_ms,
      "mean_inter_token_ms", $1->mean_inter_token_ms, "mean_rows_per_step", $1->mean_rows_per_step,
      "sampling_ms", $1->sampling_ms, "steps_in_flight", (long long)$1->steps_in_flight,
      "steps_one_at_a_time", (unsigned long long)$1->steps_one_at_a_time,
      "steps_pipelined", (unsigned long long)$1->steps_pipelined,
      "cached_prompt_tokens", (unsigned long long)$1->cached_prompt_tokens));
}

%typemap(in, numinputs=0) pipe_generation_info * (pipe_generation_info tmp) {
  if (LIBPIPE_INIT(pipe_generation_info_init, &tmp) < 0) SWIG_fail;
  $1 = &tmp;
}
%typemap(argout) pipe_generation_info * {
  $result = SWIG_Python_AppendOutput($result, Py_BuildValue(
      "{s:i,s:L,s:L,s:d,s:d,s:d,s:L}", "finish_reason", (int)$1->finish_reason,
      "prompt_tokens", (long long)$1->prompt_tokens, "generated_tokens", (long long)$1->generated_tokens,
      "queued_ms", $1->queued_ms, "time_to_first_token_ms", $1->time_to_first_token_ms,
      "mean_inter_token_ms", $1->mean_inter_token_ms, "cached_tokens", (long long)$1->cached_tokens));
}

/* pipe_generation_read: the argument is the capacity; the result [tokens, finished], tokens a tuple
 * of the ids read (as many as pipe_generation_read's count says; a tuple, since SWIG would append
 * the next output to a list). */
%typemap(in) (int64_t *tokens, size_t capacity, size_t *count) (int64_t *buffer = NULL, size_t n = 0) {
  size_t capacity = PyLong_AsSize_t($input);
  if (capacity == (size_t)-1 && PyErr_Occurred()) SWIG_fail;
  buffer = (int64_t *)malloc((capacity ? capacity : 1) * sizeof *buffer);
  if (!buffer) {
    PyErr_NoMemory();
    SWIG_fail;
  }
  $1 = buffer;
  $2 = capacity;
  $3 = &n;
}
%typemap(argout) (int64_t *tokens, size_t capacity, size_t *count) {
  PyObject *ids = PyTuple_New((Py_ssize_t)*$3);
  if (!ids) SWIG_fail;
  for (size_t i = 0; i < *$3; ++i) {
    PyObject *id = PyLong_FromLongLong((long long)$1[i]);
    if (!id) {
      Py_DECREF(ids);
      SWIG_fail;
    }
    PyTuple_SET_ITEM(ids, (Py_ssize_t)i, id);
  }
  $result = SWIG_Python_AppendOutput($result, ids);
}
%typemap(freearg) (int64_t *tokens, size_t capacity, size_t *count) { free(buffer$argnum); }

/* pipe_generation_logprobs and pipe_generation_prompt_logprobs: the arguments are the token's index
 * (the prompt position) and how many of the likeliest
 * tokens to give (at most 20); the result [logprob, ((id, logprob), ...)]. */
%typemap(in, numinputs=0) float *logprob (float lp = 0) { $1 = &lp; }
%typemap(argout) float *logprob { $result = SWIG_Python_AppendOutput($result, PyFloat_FromDouble((double)*$1)); }
%typemap(in) (int64_t *top_ids, float *top_logprobs, size_t capacity, size_t *count)
    (int64_t ids[20], float lps[20], size_t n = 0) {
  size_t capacity = PyLong_AsSize_t($input);
  if (capacity == (size_t)-1 && PyErr_Occurred()) SWIG_fail;
  $1 = ids;
  $2 = lps;
  $3 = capacity < 20 ? capacity : 20;
  $4 = &n;
}
%typemap(argout) (int64_t *top_ids, float *top_logprobs, size_t capacity, size_t *count) {
  PyObject *top = PyTuple_New((Py_ssize_t)*$4);
  if (!top) SWIG_fail;
  for (size_t i = 0; i < *$4; ++i) {
    PyObject *pair = Py_BuildValue("(Ld)", (long long)$1[i], (double)$2[i]);
    if (!pair) {
      Py_DECREF(top);
      SWIG_fail;
    }
    PyTuple_SET_ITEM(top, (Py_ssize_t)i, pair);
  }
  $result = SWIG_Python_AppendOutput($result, top);
}

/* ---- text (pipe.h, "Text") -------------------------------------------------------------------- */

/* Text in: bytes (the Python layer encodes str as UTF-8, lone surrogates passed through, so that
 * libpipe itself refuses what is not UTF-8). */
%typemap(in) (const char *text, size_t length) {
  char *data = NULL;
  Py_ssize_t n = 0;
  if (PyBytes_AsStringAndSize($input, &data, &n) < 0) SWIG_fail;
  $1 = data;
  $2 = (size_t)n;
}
/* Ids in: a sequence of ints. */
%typemap(in) (const int64_t *ids, size_t count) (int64_t *array = NULL) {
  if (libpipe_int64_array($input, "the token ids must be a sequence of ints", &array, &$2) < 0) SWIG_fail;
  $1 = array;
}
%typemap(freearg) (const int64_t *ids, size_t count) { free(array$argnum); }
/* Ids out (lent by libpipe until this thread's next call: copied at once, on the calling thread): a
 * tuple of ints. */
%typemap(in, numinputs=0) (const int64_t **ids, size_t *count) (const int64_t *lent = NULL, size_t n = 0) {
  $1 = &lent;
  $2 = &n;
}
%typemap(argout) (const int64_t **ids, size_t *count) {
  PyObject *tuple = PyTuple_New((Py_ssize_t)*$2);
  if (!tuple) SWIG_fail;
  for (size_t i = 0; i < *$2; ++i) {
    PyObject *id = PyLong_FromLongLong((long long)(*$1)[i]);
    if (!id) {
      Py_DECREF(tuple);
      SWIG_fail;
    }
    PyTuple_SET_ITEM(tuple, (Py_ssize_t)i, id);
  }
  $result = SWIG_Python_AppendOutput($result, tuple);
}
/* Text out (lent likewise; its length counts NUL bytes it may hold): a str. */
%typemap(in, numinputs=0) (const char **text, size_t *length) (const char *lent = NULL, size_t n = 0) {
  $1 = &lent;
  $2 = &n;
}
%typemap(argout) (const char **text, size_t *length) {
  PyObject *str = PyUnicode_DecodeUTF8(*$1, (Py_ssize_t)*$2, "strict");
  if (!str) SWIG_fail;
  $result = SWIG_Python_AppendOutput($result, str);
}
/* A conversation: a sequence of (role, content) pairs of str, into two arrays of UTF-8 strings that
 * the str objects keep alive for the call. */
%typemap(in) (const char *const *roles, const char *const *contents, size_t count)
    (PyObject *seq = NULL, const char **r = NULL, const char **c = NULL) {
  seq = PySequence_Fast($input, "the conversation must be a sequence of (role, content) pairs");
  if (!seq) SWIG_fail;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  r = (const char **)calloc(n ? (size_t)n : 1, sizeof *r);
  c = (const char **)calloc(n ? (size_t)n : 1, sizeof *c);
  if (!r || !c) {
    PyErr_NoMemory();
    SWIG_fail;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0)) ||
        !PyUnicode_Check(PyTuple_GET_ITEM(pair, 1))) {
      PyErr_Format(PyExc_TypeError, "message %zd must be a (role, content) tuple of str", i);
      SWIG_fail;
    }
    Py_ssize_t rn = 0, cn = 0;
    r[i] = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(pair, 0), &rn);
    c[i] = r[i] ? PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(pair, 1), &cn) : NULL;
    if (!r[i] || !c[i]) SWIG_fail;
    if ((Py_ssize_t)strlen(r[i]) != rn || (Py_ssize_t)strlen(c[i]) != cn) {
      PyErr_Format(PyExc_ValueError, "message %zd holds a NUL character", i);
      SWIG_fail;
    }
  }
  $1 = r;
  $2 = c;
  $3 = (size_t)n;
}
%typemap(freearg) (const char *const *roles, const char *const *contents, size_t count) {
  free((void *)r$argnum);
  free((void *)c$argnum);
  Py_XDECREF(seq$argnum);
}

/* ---- tensor arguments: borrowed DLManagedTensors --------------------------------------------- */

%typemap(in) (const DLManagedTensor *const *inputs, size_t num_inputs) (PyObject *keep = NULL) {
  PyObject *seq = PySequence_Fast($input, "inputs must be a sequence of DLPack capsules");
  if (!seq) SWIG_fail;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  keep = PyList_New(n);
  const DLManagedTensor **array = keep ? (const DLManagedTensor **)calloc(n ? (size_t)n : 1, sizeof *array) : NULL;
  if (keep && !array) PyErr_NoMemory();
  for (Py_ssize_t i = 0; array && i < n; ++i) {
    PyObject *capsule = libpipe_as_capsule(PySequence_Fast_GET_ITEM(seq, i), i);
    if (!capsule) {
      free((void *)array);
      array = NULL;
      break;
    }
    PyList_SET_ITEM(keep, i, capsule);
    array[i] = (const DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
  }
  Py_DECREF(seq);
  if (!array) SWIG_fail;
  $1 = ($1_ltype)array;
  $2 = (size_t)n;
}
%typemap(freearg) (const DLManagedTensor *const *inputs, size_t num_inputs) {
  free((void *)$1);
  Py_XDECREF(keep$argnum);
}

/* ---- option structs ----------------------------------------------------------------------------- */

/* None: no options; an int: the deadline in milliseconds. */
%typemap(in) const pipe_run_options * (pipe_run_options tmp) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    if (LIBPIPE_INIT(pipe_run_options_init, &tmp) < 0) SWIG_fail;
    tmp.timeout_ms = (int64_t)PyLong_AsLongLong($input);
    if (tmp.timeout_ms == -1 && PyErr_Occurred()) SWIG_fail;
    $1 = &tmp;
  }
}

/* None or {"dtype": int, "weights": str, "quantize": int, "quantize_group": int, "quantize_head": int,
 * "quantize_embedding": int}. */
%typemap(in) const pipe_stage_options * (pipe_stage_options tmp, PyObject *keep = NULL) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    static const char *const allowed[] = {"dtype",         "weights",           "quantize", "quantize_group",
                                          "quantize_head", "quantize_embedding", NULL};
    if (!PyDict_Check($input)) SWIG_exception_fail(SWIG_TypeError, "stage options must be a dict or None");
    if (libpipe_check_keys($input, allowed, "stage") < 0) SWIG_fail;
    if (libpipe_stage_options($input, &tmp, &keep) < 0) SWIG_fail;
    $1 = &tmp;
  }
}
%typemap(freearg) const pipe_stage_options * { Py_XDECREF(keep$argnum); }

/* None or a dict with the fields of pipe_session_options (specs as lists of (kind, dim);
 * "microbatching" as PIPE_MICROBATCHING_ADAPTIVE / _FIXED and "transport" as PIPE_TRANSPORT_*,
 * which libpipe checks; "store" and "devices" strs kept alive for the call; "outputs" as
 * PIPE_OUTPUTS_*), plus "dtype", "weights", "quantize", "quantize_group", "quantize_head" and "quantize_embedding" for
 * the stage options. Absent keys keep libpipe's defaults (pipe_session_options_init). */
%typemap(in) const pipe_session_options * (libpipe_session_options_holder tmp, libpipe_session_options_holder *holder = NULL) {
  memset(&tmp, 0, sizeof tmp);
  holder = &tmp;
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    static const char *const allowed[] = {"num_microbatches", "threads_per_stage", "max_inflight",
                                          "microbatching", "input_specs", "output_specs", "dtype",
                                          "weights", "quantize", "quantize_group", "quantize_head", "quantize_embedding", "transport",
                                          "world_size", "store",
                                          "comm_timeout_ms", "devices", "outputs", "token", NULL};
    if (!PyDict_Check($input)) SWIG_exception_fail(SWIG_TypeError, "session options must be a dict or None");
    if (libpipe_check_keys($input, allowed, "session") < 0) SWIG_fail;
    if (LIBPIPE_INIT(pipe_session_options_init, &tmp.session) < 0) SWIG_fail;
    if (libpipe_dict_int32($input, "num_microbatches", &tmp.session.num_microbatches) < 0 ||
        libpipe_dict_int32($input, "threads_per_stage", &tmp.session.threads_per_stage) < 0 ||
        libpipe_dict_int32($input, "max_inflight", &tmp.session.max_inflight) < 0 ||
        libpipe_dict_int32($input, "microbatching", &tmp.session.microbatching) < 0 ||
        libpipe_dict_int32($input, "transport", &tmp.session.transport) < 0 ||
        libpipe_dict_int32($input, "world_size", &tmp.session.world_size) < 0 ||
        libpipe_dict_int32($input, "comm_timeout_ms", &tmp.session.comm_timeout_ms) < 0 ||
        libpipe_dict_str($input, "store", &tmp.session.store, &tmp.keep_store) < 0 ||
        libpipe_dict_str($input, "devices", &tmp.session.devices, &tmp.keep_devices) < 0 ||
        libpipe_dict_str($input, "token", &tmp.session.token, &tmp.keep_token) < 0 ||
        libpipe_dict_int32($input, "outputs", &tmp.session.outputs) < 0 ||
        libpipe_dict_specs($input, "input_specs", &tmp.input_specs, &tmp.session.num_input_specs) < 0 ||
        libpipe_dict_specs($input, "output_specs", &tmp.output_specs, &tmp.session.num_output_specs) < 0)
      SWIG_fail;
    tmp.session.input_specs = tmp.input_specs;
    tmp.session.output_specs = tmp.output_specs;
    if (PyDict_GetItemString($input, "dtype") || PyDict_GetItemString($input, "weights") ||
        PyDict_GetItemString($input, "quantize")) {
      if (libpipe_stage_options($input, &tmp.stage, &tmp.keep) < 0) SWIG_fail;
      tmp.session.stage_options = &tmp.stage;
    }
    $1 = &tmp.session;
  }
}
%typemap(freearg) const pipe_session_options * {
  if (holder$argnum) {
    free(holder$argnum->input_specs);
    free(holder$argnum->output_specs);
    Py_XDECREF(holder$argnum->keep);
    Py_XDECREF(holder$argnum->keep_store);
    Py_XDECREF(holder$argnum->keep_devices);
    Py_XDECREF(holder$argnum->keep_token);
  }
}

/* None or a dict with the fields of pipe_worker_options: "rank", "world_size", "store" and "token"
 * (strs, kept alive for the call), "comm_timeout_ms", "threads_per_stage". Absent keys keep libpipe's
 * defaults (pipe_worker_options_init: rank and world size 0 take a launcher's; libpipe refuses a
 * missing store). */
%typemap(in) const pipe_worker_options * (pipe_worker_options tmp, PyObject *keep = NULL, PyObject *keep_token = NULL) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    static const char *const allowed[] = {"rank", "world_size", "store", "comm_timeout_ms",
                                          "threads_per_stage", "token", NULL};
    if (!PyDict_Check($input)) SWIG_exception_fail(SWIG_TypeError, "worker options must be a dict or None");
    if (libpipe_check_keys($input, allowed, "worker") < 0) SWIG_fail;
    if (LIBPIPE_INIT(pipe_worker_options_init, &tmp) < 0) SWIG_fail;
    if (libpipe_dict_int32($input, "rank", &tmp.rank) < 0 ||
        libpipe_dict_int32($input, "world_size", &tmp.world_size) < 0 ||
        libpipe_dict_int32($input, "comm_timeout_ms", &tmp.comm_timeout_ms) < 0 ||
        libpipe_dict_int32($input, "threads_per_stage", &tmp.threads_per_stage) < 0 ||
        libpipe_dict_str($input, "store", &tmp.store, &keep) < 0 ||
        libpipe_dict_str($input, "token", &tmp.token, &keep_token) < 0)
      SWIG_fail;
    $1 = &tmp;
  }
}
%typemap(freearg) const pipe_worker_options * {
  Py_XDECREF(keep$argnum);
  Py_XDECREF(keep_token$argnum);
}

/* pipe_generator_submit's prompt: a sequence of ints (the Python layer has made them ints). */
%typemap(in) (const int64_t *prompt, size_t prompt_len) (int64_t *ids = NULL) {
  if (libpipe_int64_array($input, "the prompt must be a sequence of token ids", &ids, &$2) < 0) SWIG_fail;
  $1 = ids;
}
%typemap(freearg) (const int64_t *prompt, size_t prompt_len) { free(ids$argnum); }

/* None or a dict with the fields of pipe_generator_options ("max_queued", "prefill_chunk",
 * "steps_in_flight", "max_rows_per_step"). Absent keys keep libpipe's defaults. */
%typemap(in) const pipe_generator_options * (pipe_generator_options tmp) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    static const char *const allowed[] = {"max_queued", "prefill_chunk", "steps_in_flight", "max_rows_per_step",
                                          NULL};
    if (!PyDict_Check($input)) SWIG_exception_fail(SWIG_TypeError, "generator options must be a dict or None");
    if (libpipe_check_keys($input, allowed, "generator") < 0) SWIG_fail;
    if (LIBPIPE_INIT(pipe_generator_options_init, &tmp) < 0) SWIG_fail;
    if (libpipe_dict_int64($input, "max_queued", &tmp.max_queued) < 0 ||
        libpipe_dict_int64($input, "prefill_chunk", &tmp.prefill_chunk) < 0 ||
        libpipe_dict_int64($input, "steps_in_flight", &tmp.steps_in_flight) < 0 ||
        libpipe_dict_int64($input, "max_rows_per_step", &tmp.max_rows_per_step) < 0)
      SWIG_fail;
    $1 = &tmp;
  }
}

/* None or a dict with the fields of pipe_generation_options ("max_new_tokens", "temperature",
 * "top_k", "top_p", "seed", "timeout_ms", "logprobs", "top_logprobs", "prompt_logprobs", and "stop_ids" as a sequence
 * of ints, copied into an array kept for the call). Absent keys keep libpipe's defaults. */
%typemap(in) const pipe_generation_options * (pipe_generation_options tmp, int64_t *stop = NULL) {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    static const char *const allowed[] = {"max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                          "stop_ids", "timeout_ms", "logprobs", "top_logprobs", "prompt_logprobs",
                                          NULL};
    if (!PyDict_Check($input)) SWIG_exception_fail(SWIG_TypeError, "generation options must be a dict or None");
    if (libpipe_check_keys($input, allowed, "generation") < 0) SWIG_fail;
    if (LIBPIPE_INIT(pipe_generation_options_init, &tmp) < 0) SWIG_fail;
    if (libpipe_dict_int64($input, "max_new_tokens", &tmp.max_new_tokens) < 0 ||
        libpipe_dict_double($input, "temperature", &tmp.temperature) < 0 ||
        libpipe_dict_int64($input, "top_k", &tmp.top_k) < 0 ||
        libpipe_dict_double($input, "top_p", &tmp.top_p) < 0 ||
        libpipe_dict_uint64($input, "seed", &tmp.seed) < 0 ||
        libpipe_dict_int64($input, "timeout_ms", &tmp.timeout_ms) < 0 ||
        libpipe_dict_int32($input, "logprobs", &tmp.logprobs) < 0 ||
        libpipe_dict_int32($input, "top_logprobs", &tmp.top_logprobs) < 0 ||
        libpipe_dict_int32($input, "prompt_logprobs", &tmp.prompt_logprobs) < 0)
      SWIG_fail;
    PyObject *ids = PyDict_GetItemString($input, "stop_ids");
    if (ids && ids != Py_None) {
      size_t n = 0;
      if (libpipe_int64_array(ids, "stop_ids must be a sequence of token ids", &stop, &n) < 0) SWIG_fail;
      tmp.stop_ids = n ? stop : NULL;
      tmp.num_stop_ids = n;
    }
    $1 = &tmp;
  }
}
%typemap(freearg) const pipe_generation_options * { free(stop$argnum); }

/* ---- what is not wrapped ------------------------------------------------------------------------ */

/* Tensor lists never reach Python (see the pipe_tensor_list ** typemap), so their accessors and
 * builders are not needed: Python writes safetensors files with the safetensors package. The
 * structs are built by the typemaps above. */
%ignore pipe_tensor_list_create;
%ignore pipe_tensor_list_append;
%ignore pipe_tensor_list_size;
%ignore pipe_tensor_list_name;
%ignore pipe_tensor_list_find;
%ignore pipe_tensor_list_get;
%ignore pipe_tensor_list_take;
%ignore pipe_tensor_list_destroy;
%ignore pipe_safetensors_write;
%ignore pipe_chunk_spec;
%ignore pipe_stage_options;
%ignore pipe_session_options;
%ignore pipe_run_options;
%ignore pipe_stage_stats;
%ignore pipe_worker_options;
%ignore pipe_generator_options;
%ignore pipe_generator_info;
%ignore pipe_generator_stats;
%ignore pipe_generation_options;
%ignore pipe_generation_info;
/* The typemaps above start every struct with these; Python has no struct to pass them. */
%ignore pipe_stage_options_init;
%ignore pipe_session_options_init;
%ignore pipe_run_options_init;
%ignore pipe_stage_stats_init;
%ignore pipe_worker_options_init;
%ignore pipe_generator_options_init;
%ignore pipe_generator_info_init;
%ignore pipe_generator_stats_init;
%ignore pipe_generation_options_init;
%ignore pipe_generation_info_init;
/* Its callback would run Python on a libpipe thread; Request.fileno() and `await request` use
 * pipe_request_fd, which an event loop watches without any thread. */
%ignore pipe_request_on_done;
/* The same for a generation's events: Generation iterates (and `async for`) by watching
 * pipe_generation_fd. */
%ignore pipe_generation_on_event;

%include <pipe/pipe.h>

/* ---- helpers for the Python layer (they use the Python API, so they keep the GIL) --------------- */

%nothread libpipe_dlpack_info;
%inline %{
/* What a "dltensor" capsule holds, without consuming it: device, data address (byte_offset
 * included), shape, strides (None when compact) and dtype (code, bits, lanes). */
PyObject *libpipe_dlpack_info(PyObject *capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) {
    PyErr_SetString(PyExc_ValueError, "not an unconsumed \"dltensor\" capsule");
    return NULL;
  }
  const DLManagedTensor *m = (const DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
  const DLTensor *t = &m->dl_tensor;
  PyObject *shape = PyTuple_New(t->ndim);
  PyObject *strides = t->strides ? PyTuple_New(t->ndim) : (Py_INCREF(Py_None), Py_None);
  if (!shape || !strides) {
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return NULL;
  }
  for (int i = 0; i < t->ndim; ++i) {
    PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong((long long)t->shape[i]));
    if (t->strides) PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong((long long)t->strides[i]));
  }
  return Py_BuildValue("{s:i,s:i,s:K,s:N,s:N,s:(iii)}", "device_type", (int)t->device.device_type,
                       "device_id", (int)t->device.device_id, "data",
                       (unsigned long long)((uintptr_t)t->data + t->byte_offset), "shape", shape,
                       "strides", strides, "dtype", (int)t->dtype.code, (int)t->dtype.bits,
                       (int)t->dtype.lanes);
}
%}

/* DLPack >= 1.0 consumers (numpy 2 and torch ask for it) prefer a "dltensor_versioned" capsule;
 * numpy marks arrays made from the older "dltensor" kind read-only. pipe.h speaks DLPack 0.x
 * (DLManagedTensor), so an output can be re-wrapped: the versioned struct below is DLPack 1.0's
 * DLManagedTensorVersioned (fixed by the DLPack ABI; the system header, 0.6, lacks it) around
 * the same DLTensor, whose deleter calls libpipe's. */
%{
typedef struct {
  uint32_t major;
  uint32_t minor;
} libpipe_dlpack_version;

typedef struct libpipe_managed_versioned {
  libpipe_dlpack_version version;
  void *manager_ctx;
  void (*deleter)(struct libpipe_managed_versioned *self);
  uint64_t flags; /* bit 0 read-only, bit 1 is-copied: neither, the caller owns a fresh buffer */
  DLTensor dl_tensor;
} libpipe_managed_versioned;

static void libpipe_versioned_deleter(libpipe_managed_versioned *self) {
  DLManagedTensor *inner = (DLManagedTensor *)self->manager_ctx;
  if (inner && inner->deleter) inner->deleter(inner);
  free(self);
}

static void libpipe_versioned_capsule_destructor(PyObject *capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor_versioned")) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  libpipe_managed_versioned *t = (libpipe_managed_versioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
  if (t && t->deleter) t->deleter(t);
  PyErr_Restore(type, value, traceback);
}
%}

%nothread libpipe_dlpack_versioned;
%inline %{
/* Moves the tensor of an unconsumed "dltensor" capsule into a new "dltensor_versioned" capsule
 * (DLPack 1.0, writable); the old capsule is left consumed. */
PyObject *libpipe_dlpack_versioned(PyObject *capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) {
    PyErr_SetString(PyExc_ValueError, "not an unconsumed \"dltensor\" capsule");
    return NULL;
  }
  DLManagedTensor *inner = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
  libpipe_managed_versioned *outer = (libpipe_managed_versioned *)calloc(1, sizeof *outer);
  if (!outer) return PyErr_NoMemory();
  outer->version.major = 1;
  outer->version.minor = 0;
  outer->manager_ctx = inner;
  outer->deleter = libpipe_versioned_deleter;
  outer->flags = 0;
  outer->dl_tensor = inner->dl_tensor;
  PyObject *result = PyCapsule_New(outer, "dltensor_versioned", libpipe_versioned_capsule_destructor);
  if (!result) {
    free(outer);
    return NULL;
  }
  if (PyCapsule_SetName(capsule, "used_dltensor") != 0) {
    outer->manager_ctx = NULL; /* the old capsule still owns the tensor */
    Py_DECREF(result);
    return NULL;
  }
  return result;
}
%}
