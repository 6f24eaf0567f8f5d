// The NCCL transport between two processes on two GPUs (rank 0: this process, rank 1: a copy of it
// started with fork+exec). Prints "SKIPPED: why" and exits 77 without NCCL or with fewer than two
// CUDA devices.
//
//   1. messages of several shapes and dtypes (float32, bf16, int64, bool, a 0-element tensor,
//      nested tuple/dict values, None, text only, 64 MiB) arrive equal and in order, both ways,
//      then both ranks send a large message to each other at the same time;
//   2. abort() from another thread unblocks rank 0's pending recv with Error(Communication), and
//      rank 1's pending recv fails too (rank 0 marked its failure in its heartbeat's counter);
//   3. a new transport; rank 1 kills itself; rank 0's recv fails with Error(Communication) within
//      a few seconds (the heartbeat in the store stopped).
// Each rank watches the other through a processes::Heartbeat, wired as a worker process wires it.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/nccl_transport.h"
#include "runtime/error.h"
#include "runtime/processes/heartbeat.h"

using libpipe::Error;
using libpipe::Status;
using libpipe::comm::Kind;
using libpipe::comm::Message;
using libpipe::comm::Transport;
using Clock = std::chrono::steady_clock;

namespace {

int g_rank = 0;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "rank %d: FAILED: %s\n", g_rank, what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

void expect(bool ok, const std::string& what) {
  if (!ok) die(what);
}

bool same(const c10::IValue& a, const c10::IValue& b, std::string* why) {
  if (a.tagKind() != b.tagKind()) return *why = "kinds differ: " + a.tagKind() + " vs " + b.tagKind(), false;
  if (a.isTensor()) {
    const auto x = a.toTensor().cpu(), y = b.toTensor().cpu();
    if (x.scalar_type() != y.scalar_type()) return *why = "dtypes differ", false;
    if (x.sizes() != y.sizes()) return *why = "shapes differ", false;
    if (x.numel() > 0 && !at::equal(x, y)) return *why = "values differ", false;
    return true;
  }
  if (a.isTuple() || a.isList()) {
    const auto xs = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const auto ys = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    if (xs.size() != ys.size()) return *why = "lengths differ", false;
    for (size_t i = 0; i < xs.size(); ++i)
      if (!same(xs[i], ys[i], why)) return false;
    return true;
  }
  if (a.isGenericDict()) {
    const auto x = a.toGenericDict(), y = b.toGenericDict();
    if (x.size() != y.size()) return *why = "dict sizes differ", false;
    for (const auto& item : x) {
      if (!y.contains(item.key())) return *why = "a key is missing", false;
      if (!same(item.value(), y.at(item.key()), why)) return false;
    }
    return true;
  }
  if (a == b) return true;
  return *why = "values differ", false;
}

void expect_same(const Message& got, const Message& want, const std::string& what) {
  expect(got.kind == want.kind && got.request == want.request && got.microbatch == want.microbatch &&
             got.status == want.status && got.text == want.text,
         what + ": header differs");
  expect(got.values.size() == want.values.size(), what + ": value count differs");
  for (size_t i = 0; i < got.values.size(); ++i) {
    std::string why;
    if (!same(got.values[i], want.values[i], &why)) die(what + ": value " + std::to_string(i) + ": " + why);
    if (got.values[i].isTensor())
      expect(got.values[i].toTensor().is_cuda(), what + ": a received tensor is not on the GPU");
  }
}

// The same messages on both ranks (deterministic values); tensors partly on `device`, partly on CPU.
std::vector<Message> messages(c10::Device device) {
  at::manual_seed(1234);
  std::vector<Message> out;
  Message data;
  data.kind = Kind::Data;
  data.request = 7;
  data.microbatch = 3;
  data.text = "hello";
  auto dict = c10::impl::GenericDict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("a", at::randn({2, 2}).to(device));
  dict.insert("b", at::arange(5, at::kLong));
  data.values = {at::randn({3, 5}).to(device),
                 c10::IValue(),
                 at::randn({4, 1, 3}).to(at::kBFloat16),  // on CPU: the transport copies it over
                 at::arange(11, at::kLong).to(device),
                 (at::randn({6}) > 0).to(device),
                 at::empty({0, 7}).to(device),
                 c10::ivalue::Tuple::create({at::ones({2}).to(device), c10::IValue(int64_t{3}), c10::IValue("x")}),
                 dict,
                 at::randn({8, 16}).to(device).t()};  // not contiguous
  out.push_back(data);
  Message error;
  error.kind = Kind::Error;
  error.request = 8;
  error.status = static_cast<int32_t>(Status::Execution);
  error.text = "stage 2 failed: something";
  out.push_back(error);
  Message setup;
  setup.kind = Kind::Setup;
  setup.text = std::string(200000, 'j');
  out.push_back(setup);
  Message big;
  big.kind = Kind::Result;
  big.request = 9;
  big.values = {at::randn({16, 1024, 1024}).to(device)};  // 64 MiB
  out.push_back(big);
  Message empty;
  empty.kind = Kind::Shutdown;
  out.push_back(empty);
  return out;
}

void send_all(Transport& t, int peer, const std::vector<Message>& ms) {
  for (const auto& m : ms) t.send(peer, m);
}

void recv_all(Transport& t, int peer, const std::vector<Message>& want, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) expect_same(t.recv(peer), want[i], what + " message " + std::to_string(i));
}

template <typename F>
double expect_communication_error(F&& f, const std::string& contains, const std::string& what) {
  const auto start = Clock::now();
  try {
    f();
  } catch (const Error& e) {
    expect(e.status() == Status::Communication, what + ": wrong status: " + e.what());
    expect(contains.empty() || std::string(e.what()).find(contains) != std::string::npos,
           what + ": unexpected message: " + e.what());
    return std::chrono::duration<double>(Clock::now() - start).count();
  } catch (const std::exception& e) {
    die(what + ": not a libpipe::Error: " + e.what());
  }
  die(what + ": no error");
}

int run(int rank, uint16_t port, pid_t child) {
  g_rank = rank;
  const int peer = 1 - rank;
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(rank));
  c10d::TCPStoreOptions options;
  options.port = port;
  options.isServer = false;  // main() hosts the store in rank 0
  options.timeout = std::chrono::seconds(60);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  const auto timeout = std::chrono::seconds(60);
  const auto peer_timeout = std::chrono::seconds(3);
  // The process's liveness, as serve() wires it: the peer's counter stopping or marked failed aborts the
  // transport. Each phase counts under its own prefix (a failed mark stays in its counter).
  auto watch = [&](libpipe::comm::Transport& t, const std::string& phase) {
    auto beat = std::make_unique<libpipe::processes::Heartbeat>(
        c10::make_intrusive<c10d::PrefixStore>(phase, store), rank, std::chrono::milliseconds(250), peer_timeout,
        [&t](const std::string& why) { t.abort("the store was lost: " + why); });
    beat->watch_peers({peer}, {}, [&t](const std::string& why) { t.abort(why); }, [&t](int p) { t.peer_left(p); });
    return beat;
  };

  // 1. messages, both ways, in order; then both at once.
  {
    auto t = libpipe::comm::make_nccl_transport(store, rank, 2, device, timeout, peer_timeout);
    auto beat = watch(*t, "phase1");
    expect(t->rank() == rank && t->world_size() == 2, "rank/world size");
    const auto ms = messages(device);
    if (rank == 0) {
      send_all(*t, peer, ms);
      recv_all(*t, peer, ms, "1 -> 0");
    } else {
      recv_all(*t, peer, ms, "0 -> 1");
      send_all(*t, peer, ms);
    }
    std::thread sender([&] { send_all(*t, peer, {ms.back(), ms[3], ms[0]}); });
    recv_all(*t, peer, {ms.back(), ms[3], ms[0]}, "concurrent");
    sender.join();
    std::printf("rank %d: messages OK\n", rank);

    // 2. abort() from another thread fails a recv, whether the recv is already waiting or not yet
    //    begun (the outcome is the same either way, so nothing here waits for one or the other);
    //    the peer's recv fails too. A recv that abort() did not end would hang: ctest's timeout.
    if (rank == 0) {
      std::thread aborter([&] {
        beat->mark_failed();
        t->abort("aborted by the test");
      });
      expect_communication_error([&] { t->recv(peer); }, "aborted by the test", "abort");
      aborter.join();
      expect_communication_error([&] { t->send(peer, ms[1]); }, "aborted by the test", "send after abort");
    } else {
      const double s = expect_communication_error([&] { t->recv(peer); }, "rank 0", "peer's abort");
      std::printf("rank 1: the peer's abort arrived after %.1f s\n", s);  // reported, not judged: the clock
    }
    std::printf("rank %d: abort OK\n", rank);
  }

  // 3. a killed peer.
  auto t = libpipe::comm::make_nccl_transport(store, rank, 2, device, timeout, peer_timeout);
  auto beat = watch(*t, "phase3");
  if (rank == 1) {
    // Killed once it has beaten: rank 0 judges it from when it started watching either way.
    while (store->add("phase3/" + libpipe::processes::heartbeat_key(1), 0) < 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    store->set("test/child", std::string("ok"));
    std::fflush(stdout);
    ::kill(::getpid(), SIGKILL);
    for (;;) ::pause();
  }
  const double s = expect_communication_error([&] { t->recv(peer); }, "rank 1", "killed peer");
  std::printf("rank 0: killed peer noticed after %.1f s\n", s);
  beat.reset();
  t.reset();
  int status = 0;
  expect(::waitpid(child, &status, 0) == child, "waitpid");
  expect(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
         "rank 1 did not end as planned (status " + std::to_string(status) + ")");
  const auto v = store->get("test/child");
  expect(std::string(v.begin(), v.end()) == "ok", "rank 1 did not finish its checks");
  std::printf("PASSED\n");
  return 0;
}

int device_count() {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return 0;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--rank1") {
    try {
      return run(1, static_cast<uint16_t>(std::stoi(argv[2])), 0);
    } catch (const std::exception& e) {
      die(std::string("unexpected exception: ") + e.what());
    }
  }
  std::string why;
  if (!libpipe::comm::nccl_available(&why)) {
    std::printf("SKIPPED: %s\n", why.c_str());
    return 77;
  }
  if (const int n = device_count(); n < 2) {
    std::printf("SKIPPED: this test needs 2 CUDA devices; this machine has %d\n", n);
    return 77;
  }
  // The store first (port 0: the system picks a free one), then rank 1 (fork + exec: a fresh
  // process, so this one's CUDA state does not matter).
  c10d::TCPStoreOptions options;
  options.port = 0;
  options.isServer = true;
  options.numWorkers = 2;
  options.waitWorkers = false;
  options.timeout = std::chrono::seconds(60);
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  const uint16_t port = server->getPort();
  const pid_t child = ::fork();
  if (child < 0) die("fork failed");
  if (child == 0) {
    const std::string p = std::to_string(port);
    ::execl("/proc/self/exe", argv[0], "--rank1", p.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  try {
    // Rank 0 talks to the store through a client of its own server.
    g_rank = 0;
    const int rc = run(0, port, child);
    server.reset();
    return rc;
  } catch (const std::exception& e) {
    ::kill(child, SIGKILL);
    die(std::string("unexpected exception: ") + e.what());
  }
}
