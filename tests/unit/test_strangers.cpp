// What a stranger on the network meets (SECURITY.md): the store listens only where it was asked to; a
// connection that does not hold the session's token gets nothing from the store or a rank's transport and is
// closed, while the session's own processes go on; a frame that announces more than the limits is refused
// before anything is allocated.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fixtures.h"
#include "runtime/comm/auth.h"
#include "runtime/comm/rendezvous.h"
#include "runtime/comm/socket.h"
#include "runtime/comm/store_client.h"
#include "runtime/comm/store_server.h"
#include "runtime/comm/tcp_transport.h"
#include "runtime/comm/wire.h"

namespace libpipe {
namespace {

using std::chrono::milliseconds;
using test::status_of;

const comm::Secret& session_secret() {
  static const comm::Secret s = comm::Secret::from("the session's token, 32 bytes ok");
  return s;
}

comm::Address loopback_any_port() {
  return comm::parse_address("127.0.0.1:0", "store", comm::PortZero::PicksAFreePort);
}

// The local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on `port`.
std::vector<std::string> listeners_on(uint16_t port) {
  std::vector<std::string> found;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the heading
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
      if (std::stoul(local.substr(colon + 1), nullptr, 16) == port) found.push_back(local.substr(0, colon));
    }
  }
  return found;
}

// A plain TCP connection to `address`, as a stranger opens one.
comm::Socket stranger_at(const comm::Address& address) {
  return comm::connect_to(address, comm::deadline_in(milliseconds(20000)), "a stranger's target");
}

// Whether the other end closed the connection (within the deadline), after `bytes` were sent.
bool closes_after(const comm::Socket& s, const std::string& bytes) {
  try {
    if (!bytes.empty()) s.write_all(bytes.data(), bytes.size(), comm::deadline_in(milliseconds(20000)), "the server");
    char c;
    for (;;) s.read_exact(&c, 1, comm::deadline_in(milliseconds(20000)), "the server");
  } catch (const Error& e) {
    return std::string(e.what()).find("closed") != std::string::npos ||
           std::string(e.what()).find("failed") != std::string::npos;
  }
}

TEST(Strangers, TheStoreListensOnlyOnTheAddressItWasGiven) {
  const auto hosted = comm::host_store(loopback_any_port(), session_secret(), 2, milliseconds(20000));
  const auto listening = listeners_on(hosted.address.port);
  ASSERT_FALSE(listening.empty()) << "nothing listens on the store's port " << hosted.address.port;
  for (const auto& local : listening) EXPECT_EQ(local, "0100007F") << "a listener on " << local << ", not 127.0.0.1";
}

TEST(Strangers, ATransportListensOnItsRankAddressOnlyAndOnlyDuringSetup) {
  const auto timeout = milliseconds(20000);
  const auto hosted = comm::host_store(loopback_any_port(), session_secret(), 2, timeout);
  auto rank0 = std::async(std::launch::async, [&] {
    return comm::make_tcp_transport(*hosted.store, session_secret(), 0, 2, "127.0.0.1", timeout);
  });
  // Rank 0 publishes where it listens; read it as rank 1 would.
  const auto published = hosted.store->get("libpipe/tcp/0");
  const auto address = comm::parse_address(std::string(published.begin(), published.end()), "rank 0");
  for (const auto& local : listeners_on(address.port)) EXPECT_EQ(local, "0100007F");
  auto store1 = comm::connect_store(hosted.address, session_secret(), timeout, nullptr);
  auto rank1 = comm::make_tcp_transport(*store1, session_secret(), 1, 2, "127.0.0.1", timeout);
  auto t0 = rank0.get();
  // Set up: the port is closed; nothing listens there any more.
  EXPECT_TRUE(listeners_on(address.port).empty()) << "rank 0 still listens after setup";
}

TEST(Strangers, TheStoreAnswersNothingToAConnectionWithoutTheToken) {
  const auto hosted = comm::host_store(loopback_any_port(), session_secret(), 2, milliseconds(20000));
  hosted.store->set("libpipe/secret-key", std::vector<uint8_t>{42});
  auto& server = *hosted.server;
  // Bytes that are not libpipe's: closed.
  EXPECT_TRUE(closes_after(stranger_at(hosted.address), "GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
  // c10d TCPStore's own request for a key: closed, the key not sent.
  EXPECT_TRUE(closes_after(stranger_at(hosted.address), std::string("\x01\x00\x00\x00libpipe/secret-key", 22)));
  // libpipe's greeting with a guessed answer to the challenge: closed after the store's challenge.
  {
    comm::Socket s = stranger_at(hosted.address);
    std::string hello = "LPAUTH01" + std::string(32, 'n');
    s.write_all(hello.data(), hello.size(), comm::deadline_in(milliseconds(20000)), "the store");
    std::vector<uint8_t> challenge(8 + 32 + 32);
    s.read_exact(challenge.data(), challenge.size(), comm::deadline_in(milliseconds(20000)), "the store");
    EXPECT_TRUE(closes_after(s, std::string(32, 'a')));
  }
  // A client of libpipe with another token: refused, saying why.
  std::string message;
  EXPECT_EQ(status_of(
                [&] {
                  comm::StoreClient(hosted.address, comm::Secret::from("another token, also 32 bytes ok!"),
                                    milliseconds(20000));
                },
                &message),
            Status::Communication);
  EXPECT_NE(message.find("does not hold this session's token"), std::string::npos) << message;
  // The session's own connection goes on as if nothing had happened.
  EXPECT_EQ(hosted.store->get("libpipe/secret-key"), std::vector<uint8_t>{42});
  auto client = comm::connect_store(hosted.address, session_secret(), milliseconds(20000), nullptr);
  EXPECT_EQ(client->add("libpipe/heartbeat/1", 1), 1);
  // Each refusal is counted by the store's connection thread after the stranger may already have seen its
  // connection end (the wrong token is told why first): wait for the four counts, as long as a loaded machine
  // may need; a missing one fails only after that.
  const auto patience = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (server.refused() < 4u && std::chrono::steady_clock::now() < patience)
    std::this_thread::sleep_for(milliseconds(5));
  EXPECT_GE(server.refused(), 4u);
}

TEST(Strangers, AFakeHeartbeatNeedsTheToken) {
  // A stranger cannot make a dead worker look alive: its bump never reaches the count.
  const auto hosted = comm::host_store(loopback_any_port(), session_secret(), 2, milliseconds(20000));
  EXPECT_EQ(hosted.store->add("libpipe/heartbeat/1", 0), 0);
  EXPECT_EQ(status_of([&] {
              comm::StoreClient fake(hosted.address, comm::Secret::from("a forged token of at least 16 B"),
                                     milliseconds(20000));
              fake.add("libpipe/heartbeat/1", 1);
            }),
            Status::Communication);
  EXPECT_EQ(hosted.store->add("libpipe/heartbeat/1", 0), 0);
}

TEST(Strangers, AStrangerAtARanksListenerDuringSetupIsRefusedAndSetupGoesOn) {
  const auto timeout = milliseconds(20000);
  const auto hosted = comm::host_store(loopback_any_port(), session_secret(), 2, timeout);
  auto rank0 = std::async(std::launch::async, [&] {
    return comm::make_tcp_transport(*hosted.store, session_secret(), 0, 2, "127.0.0.1", timeout);
  });
  const auto published = hosted.store->get("libpipe/tcp/0");
  const auto address = comm::parse_address(std::string(published.begin(), published.end()), "rank 0");
  // Claims rank 1 and answers the challenge without the token: closed.
  {
    comm::Socket s = stranger_at(address);
    const uint8_t rank1[4] = {1, 0, 0, 0};
    s.write_all(rank1, 4, comm::deadline_in(timeout), "rank 0");
    std::string hello = "LPAUTH01" + std::string(32, 'n');
    s.write_all(hello.data(), hello.size(), comm::deadline_in(timeout), "rank 0");
    std::vector<uint8_t> challenge(8 + 32 + 32);
    s.read_exact(challenge.data(), challenge.size(), comm::deadline_in(timeout), "rank 0");
    EXPECT_TRUE(closes_after(s, std::string(32, 'a')));
  }
  // Claims a rank that does not exist: closed.
  EXPECT_TRUE(closes_after(stranger_at(address), std::string("\x07\x00\x00\x00", 4)));
  // The real rank 1 still connects, and the two exchange a message.
  auto store1 = comm::connect_store(hosted.address, session_secret(), timeout, nullptr);
  auto t1 = comm::make_tcp_transport(*store1, session_secret(), 1, 2, "127.0.0.1", timeout);
  auto t0 = rank0.get();
  comm::Message m;
  m.values = {at::arange(6).view({2, 3})};
  t0->send(1, m);
  const comm::Message got = t1->recv(0);
  EXPECT_TRUE(at::equal(got.values.at(0).toTensor(), at::arange(6).view({2, 3})));
}

TEST(Strangers, AFrameIsBoundedBeforeAnythingIsAllocated) {
  comm::wire::Limits limits;
  limits.max_meta_words = 64;
  limits.max_small_bytes = 1024;
  limits.max_tensor_bytes = 1 << 20;
  comm::Message m;
  m.values = {at::ones({4})};
  comm::wire::Frame f = comm::wire::encode(m);
  std::string message;
  // Announced sizes beyond the limits, or whose sum would overflow.
  auto preamble = f.preamble;
  preamble[7] = 65;  // meta words
  EXPECT_EQ(status_of([&] { comm::wire::announced(preamble, limits); }, &message), Status::Communication);
  EXPECT_NE(message.find("more than the 64 allowed"), std::string::npos) << message;
  preamble = f.preamble;
  preamble[5] = INT64_MAX;  // text bytes
  preamble[6] = INT64_MAX;  // pickle bytes
  EXPECT_EQ(status_of([&] { comm::wire::announced(preamble, limits); }), Status::Communication);
  preamble[5] = -1;
  EXPECT_EQ(status_of([&] { comm::wire::announced(preamble, limits); }), Status::Communication);
  // Tensor headers: a size product that overflows 64 bits, a tensor over the limit, tensors that together are,
  // a rank beyond the limit, a dtype that does not travel.
  const int64_t f32 = static_cast<int64_t>(at::kFloat);
  for (const std::vector<int64_t>& meta :
       {std::vector<int64_t>{f32, 3, int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40},
        std::vector<int64_t>{f32, 1, (1 << 20) / 4 + 1}, std::vector<int64_t>{f32, 1, 200000, f32, 1, 200000},
        std::vector<int64_t>{f32, 65}, std::vector<int64_t>{static_cast<int64_t>(c10::ScalarType::QInt8), 1, 4},
        // An empty tensor whose other size would overflow its strides (a fuzzer's finding).
        std::vector<int64_t>{f32, 3, 0, int64_t{1} << 62, 8}, std::vector<int64_t>{f32, 2, 3}}) {
    EXPECT_EQ(status_of([&] { comm::wire::allocate(meta, at::TensorOptions(), limits); }, &message),
              Status::Communication)
        << message;
  }
  // Within the limits: allocated as announced.
  const auto tensors = comm::wire::allocate({f32, 2, 3, 4}, at::TensorOptions(), limits);
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors[0].sizes(), at::IntArrayRef({3, 4}));
}

TEST(Strangers, ATokenIsRequiredAndLongEnough) {
  std::string message;
  EXPECT_EQ(status_of([] { comm::Secret::from("short"); }, &message), Status::InvalidArgument);
  EXPECT_NE(message.find("at least 16"), std::string::npos) << message;
  if (!std::getenv("LIBPIPE_TOKEN")) {
    EXPECT_EQ(status_of([] { comm::Secret::from(""); }, &message), Status::InvalidArgument);
    EXPECT_NE(message.find("LIBPIPE_TOKEN"), std::string::npos) << message;
  }
  const std::string fresh = comm::new_token();
  EXPECT_EQ(fresh.size(), 64u);
  EXPECT_NE(fresh, comm::new_token());
}

}  // namespace
}  // namespace libpipe
