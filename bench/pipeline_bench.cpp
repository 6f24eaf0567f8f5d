// Scheduler benchmarks: libpipe (through its C ABI) against a direct LibTorch forward of the same
// TorchScript model, in one process, one measurement after the other.
//
//   pipeline_bench overhead MODEL INPUT       one stage vs direct forward, single caller
//   pipeline_bench hop MODEL INPUT            scheduling cost per micro-batch per stage hop
//   pipeline_bench throughput MODEL INPUT M C [fixed|adaptive]
//                                             2-stage throughput (M micro-batches, C callers,
//                                             micro-batching mode, default adaptive) vs the best
//                                             unsplit forward over thread counts, and vs
//                                             1 / (slowest stage time)
//
// Each prints one markdown table row. Times are medians of repeated rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/serialization/import.h>

#include <pipe/pipe.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

void check(pipe_status st, const char* what) {
  if (st != PIPE_OK) {
    std::fprintf(stderr, "%s: %s (%s)\n", what, pipe_last_error(), pipe_status_string(st));
    std::exit(1);
  }
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A DLPack view of a contiguous CPU float tensor (borrowed; no deleter).
struct DLView {
  std::vector<int64_t> shape;
  DLManagedTensor managed{};
  explicit DLView(const at::Tensor& t) : shape(t.sizes().vec()) {
    managed.dl_tensor.data = t.data_ptr();
    managed.dl_tensor.device = {kDLCPU, 0};
    managed.dl_tensor.ndim = static_cast<int32_t>(shape.size());
    managed.dl_tensor.dtype = {kDLFloat, 32, 1};
    managed.dl_tensor.shape = shape.data();
  }
};

struct Libpipe {
  pipe_model* model = nullptr;
  pipe_plan* plan = nullptr;
  pipe_session* session = nullptr;
  Libpipe(const char* path, int stages_or_markers, int32_t microbatches, int32_t threads = 0,
          int32_t microbatching = PIPE_MICROBATCHING_ADAPTIVE) {
    check(pipe_model_load(path, &model), "load");
    pipe_plan_options* o = nullptr;
    check(pipe_plan_options_create(&o), "options");
    if (stages_or_markers > 0) check(pipe_plan_options_set_stages(o, stages_or_markers, "uniform"), "stages");
    check(pipe_plan_create(model, o, &plan), "plan");
    pipe_plan_options_destroy(o);
    pipe_session_options so = PIPE_SESSION_OPTIONS_INIT;
    so.num_microbatches = microbatches;
    so.threads_per_stage = threads;
    so.microbatching = microbatching;
    check(pipe_session_create(plan, &so, &session), "session");
  }
  ~Libpipe() {
    pipe_session_destroy(session);
    pipe_plan_destroy(plan);
    pipe_model_destroy(model);
  }
  void run(const DLManagedTensor* x) {
    pipe_tensor_list* out = nullptr;
    check(pipe_session_run(session, &x, 1, nullptr, &out), "run");
    pipe_tensor_list_destroy(out);
  }
};

at::Tensor load_input(const char* path) {
  pipe_tensor_list* list = nullptr;
  check(pipe_safetensors_read(path, &list), "read input");
  const DLManagedTensor* t = nullptr;
  check(pipe_tensor_list_get(list, 0, &t), "input");
  std::vector<int64_t> shape(t->dl_tensor.shape, t->dl_tensor.shape + t->dl_tensor.ndim);
  at::Tensor copy = at::from_blob(t->dl_tensor.data, shape, at::kFloat).clone();
  pipe_tensor_list_destroy(list);
  return copy;
}

// Direct LibTorch forward of the whole model, `threads` intra-op threads, on its own thread.
double direct_ms(const char* path, const at::Tensor& x, int threads, int rounds) {
  std::vector<double> times;
  std::thread t([&] {
    at::set_num_threads(threads);
    c10::InferenceMode guard;
    auto m = torch::jit::load(path);
    m.eval();
    for (int i = 0; i < 3; ++i) m.forward({x});
    for (int i = 0; i < rounds; ++i) {
      auto start = Clock::now();
      m.forward({x});
      times.push_back(ms_since(start));
    }
  });
  t.join();
  return median(times);
}

int overhead(const char* model, const char* input) {
  at::Tensor x = load_input(input);
  DLView view(x);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int rounds = 40;
  Libpipe lp(model, 1, 1);  // one stage: its worker gets every core, as the direct forward does
  c10::InferenceMode guard;
  auto direct = torch::jit::load(model);
  direct.eval();
  for (int i = 0; i < 3; ++i) {
    lp.run(&view.managed);
    direct.forward({x});
  }
  // Alternate the two, so drift in the machine's speed hits both alike.
  std::vector<double> pipe_times, direct_times;
  for (int i = 0; i < rounds; ++i) {
    auto start = Clock::now();
    lp.run(&view.managed);
    pipe_times.push_back(ms_since(start));
    start = Clock::now();
    direct.forward({x});
    direct_times.push_back(ms_since(start));
  }
  const double d = median(direct_times), p = median(pipe_times);
  std::printf(
      "| one stage vs direct forward (%d threads, batch %lld, %d alternating rounds) | direct %.3f ms | "
      "libpipe %.3f ms | overhead %+.2f%% |\n",
      cores, static_cast<long long>(x.size(0)), rounds, d, p, 100.0 * (p - d) / d);
  return 0;
}

int hop(const char* model, const char* input) {
  at::Tensor x = load_input(input);
  DLView view(x);
  const int rounds = 2000;
  size_t stages = 0;
  // Latency: one micro-batch, one caller; the stages' own work measured inline for subtraction.
  Libpipe lp(model, 0, 1, 1);
  check(pipe_plan_num_stages(lp.plan, &stages), "stages");
  for (int i = 0; i < 50; ++i) lp.run(&view.managed);
  std::vector<double> call;
  for (int i = 0; i < rounds; ++i) {
    auto start = Clock::now();
    lp.run(&view.managed);
    call.push_back(ms_since(start));
  }
  const double inline_ms = direct_ms(model, x, 1, rounds);
  const double per_hop_us = (median(call) - inline_ms) * 1000.0 / static_cast<double>(stages);
  // Throughput: 64 micro-batches per call, 4 callers; cost per micro-batch per stage, all included.
  Libpipe many(model, 0, 8, 1, PIPE_MICROBATCHING_FIXED);  // counts below assume 8 per call
  at::Tensor big = at::zeros({64, 1});
  DLView bigview(big);
  for (int i = 0; i < 20; ++i) many.run(&bigview.managed);
  const int calls = 300, callers = 4;
  auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c)
    threads.emplace_back([&] {
      for (int i = 0; i < calls / callers; ++i) many.run(&bigview.managed);
    });
  for (auto& t : threads) t.join();
  const double total_ms = ms_since(start);
  const double per_mb_stage_us = total_ms * 1000.0 / (calls * 8.0 * static_cast<double>(stages));
  std::printf(
      "| scheduling cost per micro-batch per stage hop (%zu trivial stages) | latency: %.2f us per hop "
      "(call %.1f us - inline %.1f us, / %zu) | throughput: %.2f us per micro-batch per stage, "
      "work included (%d callers, 8 micro-batches) |\n",
      stages, per_hop_us, median(call) * 1000, inline_ms * 1000, stages, per_mb_stage_us, callers);
  return 0;
}

int throughput(const char* model, const char* input, int32_t microbatches, int callers, bool fixed) {
  at::Tensor x = load_input(input);
  DLView view(x);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const double batch = static_cast<double>(x.size(0));
  // Loaded first: it registers the pipe::split op the direct load below needs too.
  Libpipe lp(model, 0, microbatches, 0, fixed ? PIPE_MICROBATCHING_FIXED : PIPE_MICROBATCHING_ADAPTIVE);
  // Libpipe at the markers, `callers` threads calling run in a loop.
  size_t stages = 0;
  check(pipe_plan_num_stages(lp.plan, &stages), "stages");
  for (int i = 0; i < 4; ++i) lp.run(&view.managed);
  const int calls = 40;
  std::vector<pipe_stage_stats> before(stages);
  for (size_t s = 0; s < stages; ++s) {
    before[s] = PIPE_STAGE_STATS_INIT;
    check(pipe_session_stage_stats(lp.session, s, &before[s]), "stats");
  }
  auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c)
    threads.emplace_back([&] {
      for (int i = 0; i < calls / callers; ++i) lp.run(&view.managed);
    });
  for (auto& t : threads) t.join();
  const double wall = ms_since(start);
  // Best unsplit forward over thread settings, measured after libpipe's run (each measurement
  // sets its own thread count, which must not leak into the stage workers).
  double best_direct = 1e300;
  int best_threads = 1;
  for (int t = 1; t <= cores; ++t) {
    const double ms = direct_ms(model, x, t, 20);
    if (ms < best_direct) {
      best_direct = ms;
      best_threads = t;
    }
  }
  const double piped_sps = calls * batch / (wall / 1000.0);
  const double direct_sps = batch / (best_direct / 1000.0);
  // The bound: every stage ran every sample of the run, so the stage with the most busy time
  // caps throughput at samples / its busy time. (Adaptive micro-batches differ in size, so a
  // per-micro-batch time would not do.)
  double slowest_busy = 0;
  std::string busy;
  for (size_t s = 0; s < stages; ++s) {
    pipe_stage_stats now = PIPE_STAGE_STATS_INIT;
    check(pipe_session_stage_stats(lp.session, s, &now), "stats");
    const double busy_ms = now.busy_ms - before[s].busy_ms;
    const uint64_t mbs = now.microbatches - before[s].microbatches;
    slowest_busy = std::max(slowest_busy, busy_ms);
    char buf[128];
    std::snprintf(buf, sizeof buf, "%sstage %zu %.1f%% busy, %llu micro-batches, %.3f ms each", s ? "; " : "", s,
                  100.0 * busy_ms / wall, static_cast<unsigned long long>(mbs), busy_ms / static_cast<double>(mbs));
    busy += buf;
  }
  const double bound_sps = calls * batch / (slowest_busy / 1000.0);
  std::printf(
      "| %zu stages, %d micro-batches (%s), %d callers, batch %.0f | best unsplit forward %.1f samples/s "
      "(%d threads) | libpipe %.1f samples/s = %.3fx unsplit | 1/(slowest stage) bound %.1f samples/s, "
      "libpipe at %.1f%% | %s |\n",
      stages, microbatches, fixed ? "fixed" : "adaptive", callers, batch, direct_sps, best_threads, piped_sps,
      piped_sps / direct_sps, bound_sps, 100.0 * piped_sps / bound_sps, busy.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[1]) == "overhead") return overhead(argv[2], argv[3]);
  if (argc >= 4 && std::string(argv[1]) == "hop") return hop(argv[2], argv[3]);
  if (argc >= 6 && std::string(argv[1]) == "throughput")
    return throughput(argv[2], argv[3], std::atoi(argv[4]), std::atoi(argv[5]),
                      argc >= 7 && std::string(argv[6]) == "fixed");
  std::fprintf(stderr,
               "usage: pipeline_bench overhead|hop MODEL INPUT | throughput MODEL INPUT M CALLERS [fixed|adaptive]\n");
  return 2;
}
