/* What run, bench and generate share: the model loaded, its inputs read and lined up with its
 * forward arguments (run and bench), the plan made as SPLIT says, local workers started, and the
 * session created (for generate, the generator that owns one). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

int make_plan(pipe_model *model, const split_args *split, const DLManagedTensor *const *examples, size_t num_examples,
              pipe_plan **plan) {
  pipe_plan_options *options = NULL;
  pipe_status st = pipe_plan_options_create(&options);
  for (int i = 0; i < split->num_points && st == PIPE_OK; ++i)
    st = pipe_plan_options_add_split_point(options, split->points[i]);
  if (st == PIPE_OK && (split->has_stages || split->policy))
    st = pipe_plan_options_set_stages(options, split->stages, split->policy ? split->policy : "uniform");
  if (st == PIPE_OK && examples) st = pipe_plan_options_set_example_inputs(options, examples, num_examples);
  if (st == PIPE_OK) st = pipe_plan_create(model, options, plan);
  pipe_plan_options_destroy(options);
  return st == PIPE_OK ? 0 : fail("cannot split model", st);
}

/* Lists the model's forward argument names, comma-separated, into buf (only for messages: a name
 * libpipe cannot give ends the list). */
static void input_list(const pipe_model *model, char *buf, size_t size) {
  size_t n = 0, used = 0;
  buf[0] = '\0';
  if (pipe_model_num_inputs(model, &n) != PIPE_OK) return;
  for (size_t i = 0; i < n && used < size; ++i) {
    const char *name = NULL;
    if (pipe_model_input_name(model, i, &name) != PIPE_OK) break;
    int w = snprintf(buf + used, size - used, "%s%s", i ? ", " : "", name);
    if (w < 0) break;
    used += (size_t)w;
  }
}

int read_inputs(const pipe_model *model, const char *path, pipe_tensor_list **list, const DLManagedTensor ***args,
                size_t *num_args) {
  pipe_status st = pipe_safetensors_read(path, list);
  if (st != PIPE_OK) return fail("cannot read inputs", st);
  char names[1024];
  size_t num_inputs = 0, num_tensors = 0;
  if ((st = pipe_model_num_inputs(model, &num_inputs)) != PIPE_OK) return fail("cannot list the model's inputs", st);
  if ((st = pipe_tensor_list_size(*list, &num_tensors)) != PIPE_OK) return fail("cannot read inputs", st);
  input_list(model, names, sizeof names);
  for (size_t t = 0; t < num_tensors; ++t) {
    const char *tensor_name = NULL;
    int known = 0;
    if ((st = pipe_tensor_list_name(*list, t, &tensor_name)) != PIPE_OK) return fail("cannot read inputs", st);
    for (size_t i = 0; i < num_inputs && !known; ++i) {
      const char *input_name = NULL;
      if ((st = pipe_model_input_name(model, i, &input_name)) != PIPE_OK)
        return fail("cannot list the model's inputs", st);
      known = strcmp(input_name, tensor_name) == 0;
    }
    if (!known) {
      fprintf(stderr, "pipe: error: '%s' holds tensor '%s', which is not an input of the model (inputs: %s)\n", path,
              tensor_name, names);
      return 1;
    }
  }
  *args = calloc(num_inputs ? num_inputs : 1, sizeof **args);
  if (!*args) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < num_inputs; ++i) {
    const char *input_name = NULL;
    size_t index = 0;
    if ((st = pipe_model_input_name(model, i, &input_name)) != PIPE_OK)
      return fail("cannot list the model's inputs", st);
    if (pipe_tensor_list_find(*list, input_name, &index) != PIPE_OK) {
      fprintf(stderr, "pipe: error: '%s' has no tensor named '%s' (the model's inputs are: %s)\n", path, input_name,
              names);
      return 1;
    }
    if ((st = pipe_tensor_list_get(*list, index, &(*args)[i])) != PIPE_OK) return fail("cannot read inputs", st);
  }
  *num_args = num_inputs;
  return 0;
}

/* Turns --replicate's names (each a comma-separated list) into one chunk spec per forward argument, REPLICATE for
 * those named and DEFAULT for the rest, and points the session options at them. 0, or 1 after reporting a name that
 * is not a forward argument. */
static int replicate_inputs(pipeline *p, session_args *s) {
  size_t num_inputs = 0;
  pipe_status st = pipe_model_num_inputs(p->model, &num_inputs);
  if (st != PIPE_OK) return fail("cannot list the model's inputs", st);
  p->input_specs = calloc(num_inputs ? num_inputs : 1, sizeof *p->input_specs);
  if (!p->input_specs) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < num_inputs; ++i) p->input_specs[i].kind = PIPE_CHUNK_DEFAULT;
  for (int r = 0; r < s->num_replicated; ++r) {
    for (const char *name = s->replicated[r]; *name;) {
      size_t length = strcspn(name, ",");
      size_t i = 0;
      for (; i < num_inputs; ++i) {
        const char *input_name = NULL;
        if ((st = pipe_model_input_name(p->model, i, &input_name)) != PIPE_OK)
          return fail("cannot list the model's inputs", st);
        if (strlen(input_name) == length && strncmp(input_name, name, length) == 0) break;
      }
      if (i == num_inputs) {
        char names[1024];
        input_list(p->model, names, sizeof names);
        fprintf(stderr, "pipe: error: --replicate '%.*s' is not an input of the model (inputs: %s)\n", (int)length,
                name, names);
        return 1;
      }
      p->input_specs[i].kind = PIPE_CHUNK_REPLICATE;
      name += length + (name[length] == ',');
    }
  }
  s->options.input_specs = p->input_specs;
  s->options.num_input_specs = num_inputs;
  return 0;
}

/* While the session is created: libpipe logs "store listening on HOST:PORT" (pipe.h, the store
 * option) as soon as its store listens, before it waits for the workers. Local workers are
 * started then, with the port the store got; for workers started elsewhere the address is
 * printed, which is how a user learns the port of --store HOST:0. */
typedef struct {
  local_workers *workers;
  const session_args *args;
} store_watch;

static void watch_store(void *user_data, int32_t level, const char *message) {
  static const char listening[] = "store listening on ";
  static const char *const names[] = {"debug", "info", "warning", "error"};
  const store_watch *w = user_data;
  if (strncmp(message, listening, sizeof listening - 1) == 0) {
    const char *address = message + sizeof listening - 1;
    if (w->args->processes > 1) {
      start_workers(w->workers, w->args, address);
    } else {
      fprintf(stderr, "pipe: store listening on %s (start workers with --store %s)\n", address, address);
      fflush(stderr);
    }
  } else if (level >= PIPE_LOG_WARNING) { /* what the default logger prints */
    fprintf(stderr, "libpipe %s: %s\n", level <= PIPE_LOG_ERROR ? names[level] : "log", message);
  }
}

void close_pipeline(pipeline *p) {
  free(p->args);
  free(p->input_specs);
  pipe_tensor_list_destroy(p->in);
  /* A session that works tells its workers to finish; a broken one cannot. */
  int broken = p->session && pipe_session_check(p->session) != PIPE_OK;
  if (p->generator) pipe_generator_destroy(p->generator); /* and the session it owns */
  else pipe_session_destroy(p->session);
  reap_workers(&p->workers, broken || !p->session);
  pipe_plan_destroy(p->plan);
  pipe_model_destroy(p->model);
  memset(p, 0, sizeof *p);
}

/* Loads the model, reads `in_path` (NULL: no inputs) and cuts the plan. */
static int open_plan(pipeline *p, const char *model_path, const char *in_path, const split_args *split,
                     session_args *s) {
  memset(p, 0, sizeof *p);
  p->workers.comm_timeout_ms = s->options.comm_timeout_ms;
  pipe_status st = pipe_model_load(model_path, &p->model);
  if (st != PIPE_OK) return fail("cannot load model", st);
  if (in_path && read_inputs(p->model, in_path, &p->in, &p->args, &p->num_args) != 0) return 1;
  if (s->num_replicated && replicate_inputs(p, s) != 0) return 1;
  /* Policy time measures the model on the inputs being run. */
  int timed = in_path && split->policy && strcmp(split->policy, "time") == 0;
  if (make_plan(p->model, split, timed ? p->args : NULL, p->num_args, &p->plan) != 0) return 1;
  if (s->processes > 1) {
    size_t stages = 0;
    if ((st = pipe_plan_num_stages(p->plan, &stages)) != PIPE_OK) return fail("cannot count the plan's stages", st);
    if (stages < (size_t)s->processes) {
      fprintf(stderr,
              "pipe: error: --processes %d: the plan has only %zu stage%s and every process hosts at least "
              "one; use at most %zu processes or cut more stages\n",
              s->processes, stages, stages == 1 ? "" : "s", stages);
      return 1;
    }
    if (!s->options.store) s->options.store = "127.0.0.1:0"; /* the store picks a free port */
  }
  return 0;
}

/* Creates the session, or with `generate` the generator and its session, starting the local
 * workers once the store listens. */
static int start_session(pipeline *p, const split_args *split, session_args *s,
                         const pipe_generator_options *generate) {
  pipe_session_options with_weights = s->options;
  with_weights.stage_options = &split->weights;
  store_watch watch = {&p->workers, s};
  pipe_status st;
  if (s->options.world_size > 1 && (st = pipe_set_log_callback(watch_store, &watch, PIPE_LOG_INFO)) != PIPE_OK)
    return fail("cannot watch libpipe's log for the store's address", st);
  if (generate) {
    st = pipe_generator_create(p->plan, &with_weights, generate, &p->generator);
    if (st == PIPE_OK) st = pipe_generator_session(p->generator, &p->session);
    /* before the next call replaces its message */
    if (st != PIPE_OK) fail(p->generator ? "cannot reach the generator's session" : "cannot create the generator", st);
  } else {
    st = pipe_session_create(p->plan, &with_weights, &p->session);
    if (st != PIPE_OK) fail("cannot create session", st);
  }
  if (s->options.world_size > 1 && pipe_set_log_callback(NULL, NULL, PIPE_LOG_WARNING) != PIPE_OK)
    fprintf(stderr, "pipe: warning: cannot put libpipe's default logger back: %s\n", pipe_last_error());
  return st == PIPE_OK ? 0 : 1;
}

int open_pipeline(pipeline *p, const char *model_path, const char *in_path, const split_args *split, session_args *s) {
  if (open_plan(p, model_path, in_path, split, s) == 0 && start_session(p, split, s, NULL) == 0) return 0;
  close_pipeline(p);
  return 1;
}

int open_generator(pipeline *p, const char *model_path, const split_args *split, session_args *s,
                   const pipe_generator_options *options) {
  if (open_plan(p, model_path, NULL, split, s) == 0 && start_session(p, split, s, options) == 0) return 0;
  close_pipeline(p);
  return 1;
}
