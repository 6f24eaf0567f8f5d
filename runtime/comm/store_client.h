// A connection to the driver's rendezvous store (store_server.h), authenticated with the session's secret, as
// a c10d::Store: what the rendezvous, the heartbeats and the NCCL transport use. Requests go one at a time
// (a mutex), a waiting get() or wait() in short slices so that other threads' requests pass between them;
// clone() opens another connection.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <mutex>
#include <string>

#include "runtime/comm/auth.h"
#include "runtime/comm/rendezvous.h"
#include "runtime/comm/socket.h"

namespace libpipe::comm {

class StoreClient final : public c10d::Store {
 public:
  // Connects to `address`, retrying until `timeout`, and authenticates. Throws Error(Communication) naming
  // the address: nothing answered, it is not libpipe's store, or it does not hold the same token.
  // `local_host` receives this end's address (the interface on the route to the store).
  StoreClient(const Address& address, Secret secret, std::chrono::milliseconds timeout,
              std::string* local_host = nullptr);

  c10::intrusive_ptr<c10d::Store> clone() override;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  // Waits up to the store's timeout for the key; throws Error(Timeout) after it.
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;

 private:
  // Sends `request` and reads the answer with `read` under one lock, within `patience` (beyond a request's
  // own waiting time).
  template <typename Read>
  auto exchange(const std::vector<uint8_t>& request, std::chrono::milliseconds patience, Read&& read);

  Address address_;
  Secret secret_;
  std::string name_;  // for messages
  std::mutex mutex_;
  Socket socket_;
  std::string broken_;  // why the connection is unusable, once it is (under mutex_)
};

}  // namespace libpipe::comm
