// libpipe_test::gate(Tensor x, Tensor key, str stage) -> Tensor: a TorchScript operator that
// lets a test hold a stage for as long as it wants, so that no test has to guess how long some
// amount of work takes on a loaded machine. The test model tests/models/seed_models.py:Gated
// calls it once per stage; each test picks its own `key` (a 0-d int64 input, replicated to every
// micro-batch).
//
// key == 0: the operator returns at once (the model is then an ordinary 2-stage model).
// key  > 0: in $LIBPIPE_TEST_GATE_DIR it creates
//             gate-<key>.<stage>.arrived.<pid>.<n>   (observable: "a micro-batch is in <stage>";
//                                                     it holds "<intra-op threads the stage ran with>\n")
//           then waits until gate-<key>.open or gate-<key>.<stage>.open exists, creates
//             gate-<key>.<stage>.left.<pid>.<n>      (observable: "it has passed the gate")
//           and returns. Files work across threads, processes and languages alike; the helpers
//           tests/gate/gate.h (C, C++) and tests/gate/gate.py (Python) speak this protocol.
//
// A gate never opened fails the micro-batch after LIBPIPE_TEST_GATE_LIMIT_S seconds (default
// 600): a broken test ends with an error instead of hanging its process.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

std::atomic<uint64_t> g_sequence{0};

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

void touch(const std::string& path, const std::string& content = "") {
  // Written under another name (one no test counts) and renamed, so that a test that sees the
  // file sees its content.
  const size_t slash = path.rfind('/') + 1;
  const std::string partial = path.substr(0, slash) + "partial-" + path.substr(slash);
  const int fd = ::open(partial.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "libpipe_test::gate: cannot create ", partial);
  const bool written = ::write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size());
  ::close(fd);
  TORCH_CHECK(written && ::rename(partial.c_str(), path.c_str()) == 0, "libpipe_test::gate: cannot write ", path);
}

at::Tensor gate(const at::Tensor& x, const at::Tensor& key, const std::string& stage) {
  TORCH_CHECK(key.numel() == 1, "libpipe_test::gate: key must be a single integer, got shape ", key.sizes());
  const int64_t k = key.item<int64_t>();
  if (k == 0) return x.clone();
  const char* dir = std::getenv("LIBPIPE_TEST_GATE_DIR");
  TORCH_CHECK(dir && *dir, "libpipe_test::gate: key ", k, " asks for a gate but LIBPIPE_TEST_GATE_DIR is not set");
  const std::string prefix = std::string(dir) + "/gate-" + std::to_string(k);
  const std::string suffix = "." + std::to_string(::getpid()) + "." + std::to_string(g_sequence++);
  touch(prefix + "." + stage + ".arrived" + suffix, std::to_string(at::get_num_threads()) + "\n");

  const char* limit_env = std::getenv("LIBPIPE_TEST_GATE_LIMIT_S");
  const auto limit = std::chrono::seconds(limit_env ? std::atoll(limit_env) : 600);
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!exists(prefix + ".open") && !exists(prefix + "." + stage + ".open")) {
    TORCH_CHECK(std::chrono::steady_clock::now() < give_up, "libpipe_test::gate: gate ", k, " (", stage,
                ") was never opened");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  touch(prefix + "." + stage + ".left" + suffix);
  return x.clone();
}

}  // namespace

TORCH_LIBRARY(libpipe_test, m) {
  m.def("gate(Tensor x, Tensor key, str stage) -> Tensor");
  m.impl("gate", c10::DispatchKey::CompositeExplicitAutograd, gate);
}
