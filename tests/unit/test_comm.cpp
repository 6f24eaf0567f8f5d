// The transports and the ring through worker processes, inside one process: the wire format,
// the local transport, the TCP transport between two threads over loopback, and a session whose stages are
// partly served by a worker running in a thread (serve() on the local transport). Stores listen
// on port 0 and the tests use the port they got (no guessing a free one); the session tests hold
// a stage with the test gate (tests/gate) to know what the worker holds when it goes away.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>

#include "eager_reference.h"
#include "fixtures.h"
#include "runtime/comm/auth.h"
#include "runtime/comm/local_transport.h"
#include "runtime/comm/rendezvous.h"
#include "runtime/comm/store_server.h"
#include "runtime/comm/tcp_transport.h"
#include "runtime/comm/wire.h"
#include "runtime/device/cuda_library.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/graph/plan.h"
#include "runtime/log.h"
#include "runtime/processes/assignment.h"
#include "runtime/processes/heartbeat.h"
#include "runtime/processes/rank_device.h"
#include "runtime/schedule/session.h"
#include "runtime/processes/worker_host.h"
#include "tests/gate/gate.h"

namespace libpipe {
namespace {

using comm::Kind;
using comm::Message;
using std::chrono::milliseconds;
using test::status_of;

// The secret every test session here shares.
const comm::Secret& secret() {
  static const comm::Secret s = comm::Secret::from("a test token of 32 bytes, no more");
  return s;
}

// What a receiver rebuilds from a frame: the tensors allocated from the meta, filled with the
// sent bytes (what a transport does through its engine).
Message through_the_wire(const Message& sent) {
  comm::wire::Frame f = comm::wire::encode(sent);
  auto tensors = comm::wire::allocate(f.meta, at::TensorOptions());
  EXPECT_EQ(tensors.size(), f.tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].nbytes() > 0) comm::wire::byte_view(tensors[i]).copy_(comm::wire::byte_view(f.tensors[i]));
  return comm::wire::decode(f.preamble, f.bytes, std::move(tensors));
}

TEST(Wire, EveryKindOfValueArrivesAsItWasSent) {
  Message m;
  m.kind = Kind::Data;
  m.request = 41;
  m.microbatch = 3;
  m.text = "some text";
  const at::Tensor strided = at::arange(24, at::kFloat).reshape({4, 6}).t();  // not contiguous
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("k", at::ones({2}, at::kBFloat16));
  m.values = {at::randn({3, 5}),
              strided,
              at::tensor({1, 0}).to(at::kBool),
              at::empty({0, 7}, at::kLong),
              at::scalar_tensor(2.5),
              c10::IValue(),
              c10::IValue(int64_t{7}),
              c10::ivalue::Tuple::create({at::ones({1}), c10::IValue(std::string("s"))}),
              dict};
  const Message got = through_the_wire(m);
  EXPECT_EQ(got.kind, Kind::Data);
  EXPECT_EQ(got.request, 41u);
  EXPECT_EQ(got.microbatch, 3u);
  EXPECT_EQ(got.text, "some text");
  ASSERT_EQ(got.values.size(), m.values.size());
  for (size_t i : {0, 1, 2, 3, 4}) {
    const auto a = m.values[i].toTensor(), b = got.values[i].toTensor();
    EXPECT_EQ(a.sizes(), b.sizes()) << i;
    EXPECT_EQ(a.scalar_type(), b.scalar_type()) << i;
    EXPECT_TRUE(at::equal(a, b)) << i;
  }
  EXPECT_TRUE(got.values[5].isNone());
  EXPECT_EQ(got.values[6].toInt(), 7);
  const auto& tuple = got.values[7].toTupleRef().elements();
  EXPECT_TRUE(at::equal(tuple[0].toTensor(), at::ones({1})));
  EXPECT_EQ(tuple[1].toStringRef(), "s");
  EXPECT_TRUE(at::equal(got.values[8].toGenericDict().at("k").toTensor(), at::ones({2}, at::kBFloat16)));
}

TEST(Wire, APreambleFromAnotherProgramIsRefused) {
  comm::wire::Preamble p{};
  p[0] = 12345;
  EXPECT_EQ(status_of([&] { comm::wire::announced(p); }), Status::Communication);
  EXPECT_EQ(status_of([&] { comm::wire::allocate({1, 5, 2}, at::TensorOptions()); }), Status::Communication);
}

// The scheduler state of thread `tid` of this process ('R' running, 'S' asleep, ...).
char thread_state(pid_t tid) {
  std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

// Waits until thread `tid` sleeps: once it has entered a blocking call that nothing else can hold
// up, that is the call waiting. The bound only ends a broken test.
void wait_until_asleep(pid_t tid) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(GATE_WAIT_LIMIT_S);
  while (thread_state(tid) != 'S') {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "thread " << tid << " never blocked";
    std::this_thread::yield();
  }
}

TEST(LocalTransport, MessagesArriveInOrderAndAbortWakesAWaitingReceiver) {
  auto ends = comm::make_local_transports(2);
  for (int i = 0; i < 5; ++i) {
    Message m;
    m.request = static_cast<uint64_t>(i);
    ends[0]->send(1, m);
  }
  for (int i = 0; i < 5; ++i) EXPECT_EQ(ends[1]->recv(0).request, static_cast<uint64_t>(i));
  std::atomic<pid_t> receiver{0};
  auto waiting = std::async(std::launch::async, [&] {
    receiver = static_cast<pid_t>(syscall(SYS_gettid));
    return status_of([&] { ends[1]->recv(0); });
  });
  while (receiver == 0) std::this_thread::yield();
  wait_until_asleep(receiver);  // in recv, waiting for a message that never comes
  ends[0]->abort("peer gone");
  EXPECT_EQ(waiting.get(), Status::Communication);
  EXPECT_EQ(status_of([&] { ends[0]->send(1, Message{}); }), Status::Communication);
}

// A loopback port where nothing listens, for as long as this object lives: the socket is bound
// but never listens, so connections are refused and no other process can take the port.
struct RefusedPort {
  RefusedPort() {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port = ntohs(a.sin_port);
  }
  ~RefusedPort() { close(fd); }
  int fd = -1;
  uint16_t port = 0;
};

TEST(TcpTransport, TwoRanksExchangeMessagesOfChangingShapesBothWays) {
  const auto timeout = milliseconds(20000);
  const auto hosted = comm::host_store(comm::parse_address("127.0.0.1:0", "store", comm::PortZero::PicksAFreePort),
                                       secret(), 2, timeout);
  const std::string address = comm::format_address(hosted.address);
  auto rank1 = std::async(std::launch::async, [&] {
    std::string local;
    auto store = comm::connect_store(comm::parse_address(address, "store"), secret(), timeout, &local);
    EXPECT_EQ(local, "127.0.0.1");
    auto t = comm::make_tcp_transport(*store, secret(), 1, 2, local, timeout);
    for (int i = 0; i < 3; ++i) {
      Message m = t->recv(0);
      m.values[0] = m.values[0].toTensor() * 2;
      t->send(0, m);
    }
    t->send(0, t->recv(0));  // the big one, echoed
  });
  auto t = comm::make_tcp_transport(*hosted.store, secret(), 0, 2, "127.0.0.1", timeout);
  for (int i = 0; i < 3; ++i) {
    Message m;
    m.request = static_cast<uint64_t>(i);
    const at::Tensor x = at::randn({i + 1, 3 + i});
    m.values = {x, c10::IValue()};
    t->send(1, m);
    const Message back = t->recv(1);
    EXPECT_EQ(back.request, static_cast<uint64_t>(i));
    EXPECT_TRUE(at::equal(back.values[0].toTensor(), x * 2));
    EXPECT_TRUE(back.values[1].isNone());
  }
  // Many tensors and a long text in one message.
  std::vector<c10::IValue> many;
  for (int i = 0; i < 600; ++i) many.emplace_back(at::full({1, 2, 3}, static_cast<double>(i)));
  Message big;
  big.values = {c10::ivalue::Tuple::create(many)};
  big.text = std::string(5000, 'x');
  t->send(1, big);
  const Message got = t->recv(1);
  EXPECT_EQ(got.text, big.text);
  const std::vector<c10::IValue> items = got.values.at(0).toTupleRef().elements().vec();
  ASSERT_EQ(items.size(), 600u);
  EXPECT_TRUE(at::equal(items[599].toTensor(), at::full({1, 2, 3}, 599.0)));
  rank1.get();
}

TEST(Rendezvous, AddressesAreCheckedBeforeAnythingWaits) {
  EXPECT_EQ(status_of([] { comm::parse_address("no-port", "store"); }), Status::InvalidArgument);
  EXPECT_EQ(status_of([] { comm::parse_address("host:99999", "store"); }), Status::InvalidArgument);
  EXPECT_EQ(comm::parse_address("[::1]:80", "store").host, "::1");
  EXPECT_EQ(comm::format_address(comm::parse_address("[::1]:80", "store")), "[::1]:80");
  std::string message;
  // Port 0 asks the store to pick one: only the driver may; a worker needs the port it got.
  EXPECT_EQ(status_of([] { comm::parse_address("127.0.0.1:0", "the store address"); }, &message),
            Status::InvalidArgument);
  EXPECT_NE(message.find("port 0, which only the driver may give"), std::string::npos) << message;
  EXPECT_EQ(comm::parse_address("127.0.0.1:0", "store", comm::PortZero::PicksAFreePort).port, 0);
  // 192.0.2.1 (TEST-NET-1) is never an address of this machine.
  EXPECT_EQ(
      status_of(
          [] { comm::host_store(comm::parse_address("192.0.2.1:29400", "store"), secret(), 2, milliseconds(1000)); },
          &message),
      Status::Communication);
  EXPECT_NE(message.find("not an address of this machine"), std::string::npos) << message;
  const RefusedPort nobody;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(status_of(
                [&] {
                  std::string local;
                  comm::connect_store(comm::parse_address("127.0.0.1:" + std::to_string(nobody.port), "store"),
                                      secret(), milliseconds(300), &local);
                },
                &message),
            Status::Communication);
  EXPECT_NE(message.find("nothing answered for the rendezvous store at 127.0.0.1:" + std::to_string(nobody.port)),
            std::string::npos)
      << message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));  // bounded, not a hang
}

// What the log sink received, for the test below.
struct Logged {
  std::mutex mutex;
  std::vector<std::pair<int32_t, std::string>> messages;
  static void sink(void* user_data, int32_t level, const char* message) {
    auto* self = static_cast<Logged*>(user_data);
    std::lock_guard lock(self->mutex);
    self->messages.emplace_back(level, message);
  }
};

TEST(Rendezvous, AStoreOnPortZeroListensOnAFreePortAndSaysWhichBeforeAnyoneJoins) {
  Logged logged;
  log::set_sink(&Logged::sink, &logged, log::Info);
  const auto hosted = comm::host_store(comm::parse_address("127.0.0.1:0", "store", comm::PortZero::PicksAFreePort),
                                       secret(), 2, milliseconds(20000));
  log::set_sink(nullptr, nullptr, log::Warning);
  const uint16_t port = hosted.server->address().port;
  EXPECT_NE(port, 0);
  EXPECT_EQ(hosted.address.port, port);
  EXPECT_EQ(hosted.address.host, "127.0.0.1");
  const std::string said = "store listening on 127.0.0.1:" + std::to_string(port);
  EXPECT_EQ(std::count(logged.messages.begin(), logged.messages.end(), std::make_pair(int32_t{log::Info}, said)), 1);
  // A worker given that address reaches this store.
  hosted.store->set("key", std::vector<uint8_t>{7});
  std::string local;
  auto client = comm::connect_store(hosted.address, secret(), milliseconds(20000), &local);
  EXPECT_EQ(client->get("key"), std::vector<uint8_t>{7});
}

// A worker tells the driver, when it joins, the device it would run its stages on (NCCL, devices "auto"); the
// driver reads only "cpu" and "cuda:N" back, whatever else a peer writes there.
TEST(Rendezvous, AJoiningWorkerTellsItsOwnDeviceAndTheDriverReadsOnlyDevices) {
  c10d::HashStore store;
  comm::announce_session(store, 3, "tcp");
  EXPECT_EQ(comm::join_session(store, 1, 3, "cuda:3"), "tcp");
  EXPECT_EQ(comm::join_session(store, 2, 3, "cpu"), "tcp");
  EXPECT_EQ(comm::joined_device(store, 1), c10::Device(c10::kCUDA, 3));
  EXPECT_EQ(comm::joined_device(store, 2), c10::Device(c10::kCPU));
  for (const std::string told : {"cuda:128", "cuda:", "cuda:1x", "mps", "cuda:-1", "", "cuda:0:0"}) {
    store.set("libpipe/device/2", std::vector<uint8_t>(told.begin(), told.end()));
    std::string message;
    EXPECT_EQ(status_of([&] { comm::joined_device(store, 2); }, &message), Status::Communication) << told;
    EXPECT_NE(message.find("rank 2 told device"), std::string::npos) << message;
  }
}

// The GPU a process takes for its own stages: LOCAL_RANK under a launcher, else its rank, over the GPUs it sees.
TEST(RankDevice, TheLocalIndexPicksAGpuRoundRobin) {
  EXPECT_EQ(processes::gpu_for(0, 8), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(processes::gpu_for(5, 8), c10::Device(c10::kCUDA, 5));
  EXPECT_EQ(processes::gpu_for(9, 8), c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(processes::gpu_for(3, 1), c10::Device(c10::kCUDA, 0));
}

TEST(RankDevice, AProcessThatSeesNoGpuTakesNoneAndNcclSaysWhy) {
  std::string why;
  if (device::cuda_device_count(&why) > 0) GTEST_SKIP() << "this machine has a GPU; the CPU-only case is not seen";
  EXPECT_FALSE(processes::own_gpu(1).has_value());
  std::string message;
  EXPECT_EQ(status_of([] { processes::nccl_device(1); }, &message), Status::Unsupported);
  EXPECT_NE(message.find("needs a CUDA device"), std::string::npos) << message;
}

TEST(Placement, StagesSpreadInContiguousGroupsLargerFirst) {
  using Ranges = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(processes::place_stages(5, 2), (Ranges{{0, 3}, {3, 5}}));
  EXPECT_EQ(processes::place_stages(4, 3), (Ranges{{0, 2}, {2, 3}, {3, 4}}));
  EXPECT_EQ(status_of([] { processes::place_stages(2, 3); }), Status::InvalidArgument);
}

using test::eager;

// A session with world size 2 on the local transport: rank 1 is serve() in a thread; the
// heartbeats go through an in-process store.
struct TwoRanks {
  // The worker's own comm timeout may differ from the driver's (0: the same).
  explicit TwoRanks(const std::string& model_file, milliseconds timeout = milliseconds(20000),
                    milliseconds worker_timeout = milliseconds(0)) {
    model = graph::Model::load(test::fixture(model_file));
    auto ends = comm::make_local_transports(2);
    worker_end = std::move(ends[1]);
    if (worker_timeout.count() == 0) worker_timeout = timeout;
    worker = std::async(std::launch::async, [this, worker_timeout] {
      return status_of([&] { processes::serve(*worker_end, c10::Device(c10::kCPU), worker_timeout, 1, store); },
                       &worker_message);
    });
    schedule::SessionOptions o;
    o.num_microbatches = 2;
    o.distributed.world_size = 2;
    o.distributed.comm_timeout = timeout;
    o.distributed.connected = std::shared_ptr<comm::Transport>(std::move(ends[0]));
    o.distributed.connected_store = store;
    session = std::make_unique<schedule::Session>(graph::Plan::from_markers(model), o);
  }
  std::shared_ptr<const graph::Model> model;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::unique_ptr<comm::Transport> worker_end;
  std::future<Status> worker;
  std::string worker_message;
  std::unique_ptr<schedule::Session> session;
};

TEST(DistributedSession, AWorkerRankRunsTheLaterStagesAndBatchSizesMayChange) {
  TwoRanks ranks("multi_mlp.traced.pt");
  EXPECT_EQ(ranks.session->num_stages(), 4u);
  for (int64_t batch : {6, 1, 9}) {
    const at::Tensor x = at::randn({batch, 512}), y = at::randn({batch, 512});
    auto out = ranks.session->run({x, y});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_TRUE(at::allclose(out[0].tensor, eager(*ranks.model, {x, y}), 1e-5, 1e-5)) << batch;
  }
  EXPECT_EQ(ranks.session->stats(3).microbatches, 0u);  // stage 3 runs in the worker
  EXPECT_GT(ranks.session->stats(0).microbatches, 0u);
  ranks.session.reset();  // ends the worker cleanly
  EXPECT_EQ(ranks.worker.get(), Status::Ok) << ranks.worker_message;
}

TEST(DistributedSession, AFailedCallLeavesTheSessionWorking) {
  TwoRanks ranks("multi_mlp.traced.pt");
  std::string message;
  // Wrong width: stage 0 (here) rejects it before anything is sent.
  EXPECT_EQ(status_of([&] { ranks.session->run({at::randn({2, 5}), at::randn({2, 5})}); }, &message),
            Status::Execution);
  const at::Tensor x = at::randn({2, 512}), y = at::randn({2, 512});
  EXPECT_TRUE(at::allclose(ranks.session->run({x, y})[0].tensor, eager(*ranks.model, {x, y}), 1e-5, 1e-5));
  EXPECT_TRUE(ranks.session->broken().empty());
}

TEST(DistributedSession, AWorkerThatGoesAwayBreaksTheSessionAndItsCalls) {
  ASSERT_EQ(gate_init(), 0);
  TwoRanks ranks("gated.scripted.pt");  // stage 0 here, stage 1 in the worker
  const int64_t key = gate_new_key();
  // The inputs outlive the call: dropped here while stage 0 still holds views of them, the last
  // reference would go in a stage thread inside (uninstrumented) LibTorch, which ThreadSanitizer
  // cannot see synchronise with this thread.
  const std::vector<c10::IValue> inputs{at::randn({4, 64}), at::scalar_tensor(key, at::kLong)};
  auto request = ranks.session->submit(inputs);
  gate_open(key, "stage0");
  ASSERT_TRUE(gate_wait(key, "stage1", "arrived", 1));  // the worker holds the call
  ranks.worker_end->abort("the worker process died");   // what a closed connection looks like
  std::string message;
  EXPECT_EQ(status_of([&] { request->result({}); }, &message), Status::Communication);
  gate_open(key, nullptr);  // the worker's stage finishes, so that its thread can end
  EXPECT_NE(ranks.session->broken().find("died"), std::string::npos) << ranks.session->broken();
  EXPECT_EQ(status_of([&] { ranks.session->run({at::randn({4, 64}), at::scalar_tensor(0, at::kLong)}); }, &message),
            Status::Communication);
  EXPECT_NE(message.find("destroy it"), std::string::npos) << message;
  ranks.session.reset();
  EXPECT_EQ(ranks.worker.get(), Status::Communication);
}

// Rank 1 takes its stages and warms up, then swallows every micro-batch without answering and
// sends no heartbeat: what a stopped worker process looks like.
struct SilentRank {
  SilentRank() {
    auto ends = comm::make_local_transports(2);
    std::shared_ptr<comm::Transport> worker_end(std::move(ends[1]));
    driver_end = std::move(ends[0]);
    done = std::async(std::launch::async, [worker_end] {
      return status_of([&] {
        worker_end->recv(0);  // the assignment
        worker_end->send(0, comm::control(Kind::Ready));
        worker_end->send(0, worker_end->recv(0));  // the warm-up
        for (;;) worker_end->recv(0);
      });
    });
  }
  // A test that fails before its session aborts the transport (a fixture that does not load) must fail, not wait
  // forever in `done`'s destructor for the silent rank, which never returns by itself.
  ~SilentRank() { driver_end->abort("the test ended"); }
  schedule::SessionOptions options(milliseconds timeout) {
    schedule::SessionOptions o;
    o.distributed.world_size = 2;
    o.distributed.comm_timeout = timeout;
    o.distributed.connected = driver_end;
    o.distributed.connected_store = c10::make_intrusive<c10d::HashStore>();
    return o;
  }
  std::shared_ptr<comm::Transport> driver_end;
  std::future<Status> done;
};

TEST(DistributedSession, AWorkerThatStopsItsHeartbeatFailsTheCallsItHoldsNamingItsRank) {
  SilentRank silent;
  schedule::Session session(graph::Plan::from_markers(graph::Model::load(test::fixture("multi_mlp.traced.pt"))),
                            silent.options(milliseconds(500)));
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  EXPECT_EQ(status_of([&] { session.run({at::randn({2, 512}), at::randn({2, 512})}); }, &message),
            Status::Communication);
  EXPECT_NE(message.find("worker rank 1 sent no heartbeat for 500 ms"), std::string::npos) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));  // not a hang
  EXPECT_EQ(silent.done.get(), Status::Communication);  // the broken session aborted the transport
}

TEST(DistributedSession, AnIdleSessionWhoseWorkerStopsItsHeartbeatReportsItselfBroken) {
  SilentRank silent;
  schedule::Session session(graph::Plan::from_markers(graph::Model::load(test::fixture("multi_mlp.traced.pt"))),
                            silent.options(milliseconds(300)));
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);  // only fails a hung test
  while (session.broken().empty() && std::chrono::steady_clock::now() < limit)
    std::this_thread::sleep_for(milliseconds(20));
  EXPECT_NE(session.broken().find("worker rank 1 sent no heartbeat"), std::string::npos) << session.broken();
  std::string message;
  EXPECT_EQ(status_of([&] { session.run({at::randn({2, 512}), at::randn({2, 512})}); }, &message),
            Status::Communication);
  EXPECT_NE(message.find("worker rank 1"), std::string::npos) << message;
  EXPECT_EQ(silent.done.get(), Status::Communication);
}

TEST(DistributedSession, AWorkerThatHoldsACallForSeveralCommTimeoutsIsAliveAndFinishesIt) {
  ASSERT_EQ(gate_init(), 0);
  const milliseconds timeout(300);
  // Stage 0 here, stage 1 in the worker. The worker's own timeout is the default minute: it beats
  // at the pace the driver's timeout asks for, not at one its own would give.
  TwoRanks ranks("gated.scripted.pt", timeout, milliseconds(60000));
  const int64_t key = gate_new_key();
  const at::Tensor x = at::randn({4, 64});
  const std::vector<c10::IValue> inputs{x, at::scalar_tensor(key, at::kLong)};
  auto request = ranks.session->submit(inputs);
  gate_open(key, "stage0");
  ASSERT_TRUE(gate_wait(key, "stage1", "arrived", 1));  // the worker holds the call
  // Held well past the comm timeout: the worker's stage answers nothing, its heartbeat goes on.
  const auto until = std::chrono::steady_clock::now() + 4 * timeout;
  while (std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(ranks.session->broken(), "");
  gate_open(key, nullptr);
  const auto out = request->result({});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(at::allclose(out[0].tensor, eager(*ranks.model, {x, at::scalar_tensor(0, at::kLong)}), 1e-5, 1e-5));
  EXPECT_EQ(ranks.session->broken(), "");
  const at::Tensor y = at::randn({3, 64});
  EXPECT_TRUE(at::allclose(ranks.session->run({y, at::scalar_tensor(0, at::kLong)})[0].tensor,
                           eager(*ranks.model, {y, at::scalar_tensor(0, at::kLong)}), 1e-5, 1e-5));
  ranks.session.reset();
  EXPECT_EQ(ranks.worker.get(), Status::Ok) << ranks.worker_message;
}

// A store whose add fails, or blocks until released, once `broken` is set: a driver that died or hangs.
class FailingStore : public c10d::HashStore {
 public:
  enum class Mode { Works, Throws, Hangs };
  int64_t add(const std::string& key, int64_t value) override {
    std::unique_lock lock(mutex_);
    ++calls_;
    cv_.notify_all();
    if (mode_ == Mode::Throws) throw std::runtime_error("Connection reset by peer");
    cv_.wait(lock, [&] { return mode_ != Mode::Hangs; });
    lock.unlock();
    return c10d::HashStore::add(key, value);
  }
  void set_mode(Mode mode) {
    std::lock_guard lock(mutex_);
    mode_ = mode;
    cv_.notify_all();
  }
  // Waits (bounded) until `count` bumps were asked for.
  bool wait_calls(int count) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return calls_ >= count; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  Mode mode_ = Mode::Works;
  int calls_ = 0;
};

struct Lost {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::string> why;
  std::function<void(const std::string&)> callback() {
    return [this](const std::string& w) {
      std::lock_guard lock(mutex);
      why.push_back(w);
      cv.notify_all();
    };
  }
  bool wait() {
    std::unique_lock lock(mutex);
    return cv.wait_for(lock, std::chrono::seconds(60), [&] { return !why.empty(); });
  }
  std::vector<std::string> told() {
    std::lock_guard lock(mutex);
    return why;
  }
};

TEST(Heartbeat, BeatsAtItsOwnPaceAndTheMonitorSeesTheCountMove) {
  auto store = c10::make_intrusive<FailingStore>();
  Lost lost;
  const milliseconds timeout(200);
  processes::HeartbeatMonitor monitor(*store, 3, timeout);
  // Rank 3 never beats: a second monitor, of 4 ranks, names it once the timeout has passed.
  processes::HeartbeatMonitor with_a_silent_rank(*store, 4, timeout);
  {
    processes::Heartbeat first(store, 1, processes::heartbeat_interval(timeout), timeout, lost.callback());
    processes::Heartbeat second(store, 2, processes::heartbeat_interval(timeout), timeout, lost.callback());
    const auto count = [&](int rank) { return store->add(processes::heartbeat_key(rank), 0); };
    const int64_t one = count(1), two = count(2);
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);  // only fails a hung test
    while ((count(1) < one + 3 || count(2) < two + 3) && std::chrono::steady_clock::now() < limit)
      std::this_thread::sleep_for(milliseconds(10));
    EXPECT_GE(count(1), one + 3);  // several beats of each
    EXPECT_GE(count(2), two + 3);
    EXPECT_EQ(monitor.check(), "");
  }
  EXPECT_TRUE(lost.why.empty());  // stopped by its owner: nothing was lost
  // Both ended normally (their counters say so): however long the monitor then looks, it blames neither.
  std::this_thread::sleep_for(timeout * 2);
  EXPECT_EQ(monitor.check(), "");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::string why;
  while ((why = with_a_silent_rank.check()).empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(why.rfind("worker rank 3 sent no heartbeat for 200 ms (the comm timeout)", 0), 0u) << why;
}

// A transport that cannot see its peers die (NCCL) has the process's heartbeat watch them.
TEST(Heartbeat, AWatchedPeerThatFailsIsReportedAtOnce) {
  auto store = c10::make_intrusive<FailingStore>();
  Lost lost, peer_failed;
  const milliseconds timeout(60000);  // a verdict here never waits for it
  processes::Heartbeat first(store, 1, milliseconds(10), timeout, lost.callback());
  processes::Heartbeat second(store, 2, milliseconds(10), timeout, lost.callback());
  second.watch_peers({1}, {}, peer_failed.callback(), [](int) { ADD_FAILURE() << "no peer left"; });
  first.mark_failed();
  ASSERT_TRUE(peer_failed.wait());
  EXPECT_EQ(peer_failed.told()[0].rfind("rank 1 failed", 0), 0u) << peer_failed.told()[0];
  EXPECT_TRUE(lost.told().empty());
}

TEST(Heartbeat, AWatchedPeerWhoseCounterStopsIsReportedAfterTheTimeout) {
  auto store = c10::make_intrusive<FailingStore>();
  Lost lost, peer_failed;
  const milliseconds timeout(200);
  processes::Heartbeat watcher(store, 2, milliseconds(10), timeout, lost.callback());
  // Rank 1 beats twice (by hand), then stops as a killed process would, with no mark.
  store->add(processes::heartbeat_key(1), 1);
  watcher.watch_peers({1}, {}, peer_failed.callback(), [](int) { ADD_FAILURE() << "no peer left"; });
  std::this_thread::sleep_for(milliseconds(50));
  store->add(processes::heartbeat_key(1), 1);
  ASSERT_TRUE(peer_failed.wait());
  EXPECT_NE(peer_failed.told()[0].find("rank 1 stopped responding: no heartbeat for 200 ms"), std::string::npos)
      << peer_failed.told()[0];
}

TEST(Heartbeat, TheDriverIsJudgedByItsMarksAlone) {
  // The driver does not beat (its store is its liveness): silence from it is no failure, its failed mark is.
  auto store = c10::make_intrusive<FailingStore>();
  Lost lost, peer_failed;
  const milliseconds timeout(100);
  processes::Heartbeat watcher(store, 1, milliseconds(10), timeout, lost.callback());
  watcher.watch_peers({}, {0}, peer_failed.callback(), [](int) { ADD_FAILURE() << "no peer left"; });
  std::this_thread::sleep_for(timeout * 4);
  EXPECT_TRUE(peer_failed.told().empty());
  processes::mark_failed_in_store(*store, 0);
  ASSERT_TRUE(peer_failed.wait());
  EXPECT_EQ(peer_failed.told()[0].rfind("rank 0 failed", 0), 0u) << peer_failed.told()[0];
}

TEST(Heartbeat, AWatchedPeerThatEndsNormallyIsToldAsLeftAndNeverAsFailed) {
  auto store = c10::make_intrusive<FailingStore>();
  Lost lost, peer_failed;
  const milliseconds timeout(2000);  // a peer's beats are never this late, even on a loaded machine
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<int> left;
  processes::Heartbeat watcher(store, 2, milliseconds(10), timeout, lost.callback());
  watcher.watch_peers({1}, {}, peer_failed.callback(), [&](int peer) {
    std::lock_guard lock(mutex);
    left.push_back(peer);
    cv.notify_all();
  });
  { processes::Heartbeat peer(store, 1, milliseconds(10), timeout, lost.callback()); }
  {
    std::unique_lock lock(mutex);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return !left.empty(); }));
    EXPECT_EQ(left, std::vector<int>{1});
  }
  std::this_thread::sleep_for(timeout + milliseconds(500));  // past its timeout: still not reported
  EXPECT_TRUE(peer_failed.told().empty());
  EXPECT_TRUE(lost.told().empty());
}

TEST(HeartbeatMonitor, AFailedMarkIsFatalOnlyWhereTheTransportCannotTell) {
  auto store = c10::make_intrusive<FailingStore>();
  const milliseconds timeout(60000);
  processes::HeartbeatMonitor over_tcp(*store, 2, timeout);
  processes::HeartbeatMonitor over_nccl(*store, 2, timeout, /*failed_marks_are_fatal=*/true);
  processes::mark_failed_in_store(*store, 1);
  EXPECT_EQ(over_tcp.check(), "");  // the count moved; the TCP connection tells why
  EXPECT_EQ(over_nccl.check().rfind("worker rank 1 failed", 0), 0u);
}

TEST(Heartbeat, AStoreThatFailsTellsTheWorkerItsDriverIsGone) {
  auto store = c10::make_intrusive<FailingStore>();
  Lost lost;
  processes::Heartbeat beat(store, 1, milliseconds(25), milliseconds(200), lost.callback());
  ASSERT_TRUE(store->wait_calls(1));
  store->set_mode(FailingStore::Mode::Throws);
  ASSERT_TRUE(lost.wait());
  EXPECT_NE(lost.why[0].find("Connection reset by peer"), std::string::npos) << lost.why[0];
  EXPECT_NE(lost.why[0].find("the driver is gone"), std::string::npos) << lost.why[0];
}

TEST(Heartbeat, AStoreThatStopsAnsweringTellsTheWorkerAfterTheTimeout) {
  auto store = c10::make_intrusive<FailingStore>();
  Lost lost;
  {
    processes::Heartbeat beat(store, 1, milliseconds(25), milliseconds(200), lost.callback());
    ASSERT_TRUE(store->wait_calls(1));
    store->set_mode(FailingStore::Mode::Hangs);
    ASSERT_TRUE(lost.wait());
    EXPECT_NE(lost.why[0].find("did not answer a heartbeat for 200 ms"), std::string::npos) << lost.why[0];
  }  // destroyed while a bump is stuck: returns, leaving that bump to the store
  store->set_mode(FailingStore::Mode::Works);  // the stuck bump ends, and its thread with it
  EXPECT_EQ(lost.why.size(), 1u);
}

}  // namespace
}  // namespace libpipe
