// Transports move messages between the ranks of one session: the driver (rank 0) and its workers
// (ranks 1..N-1). A message is one micro-batch's crossing values (or a call's result, an error,
// or a control message); its tensors travel through the engine (Gloo, NCCL, or an in-process
// hand-over), each announced by a small header with its dtype and shape (runtime/comm/wire.h),
// so shapes may change from message to message.
//
// Every implementation is point to point and ordered: messages from rank a to rank b arrive in
// the order a sent them. send() and recv() may run at the same time from different threads
// (one sender and one receiver per peer at most).
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace libpipe::comm {

enum class Kind : int64_t {
  Data = 1,      // a micro-batch on its way: `values` is the environment of crossing values
  Result = 2,    // a micro-batch's output, back to the driver: `values` holds it alone
  Error = 3,     // a micro-batch whose stage failed: `text` says why, `status` how
  Shutdown = 4,  // the session ends; forwarded around the ring, then the worker returns
  Setup = 5,     // setup traffic: `text` (JSON) and `values` (e.g. serialized stage modules)
  Ready = 6,     // a worker loaded its stages (or, with `status` set, failed to: `text` says why)
  Warmup = 7,    // goes once around the ring when the session starts
};

struct Message {
  Kind kind = Kind::Data;
  uint64_t request = 0;
  uint64_t microbatch = 0;
  int32_t status = 0;               // a libpipe::Status, for Error and Ready
  std::vector<c10::IValue> values;  // None where a value was dropped
  std::string text;
};

// A message without values: Shutdown, Warmup, Ready.
inline Message control(Kind kind) {
  Message m;
  m.kind = kind;
  return m;
}

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Blocks until the peer has the message (or the engine took it); throws
  // Error(Status::Communication) naming the peer when the connection fails or after abort().
  virtual void send(int peer, const Message& message) = 0;
  // Blocks until a message from `peer` arrives; throws as send() does. `timeout` bounds the wait
  // only where a timed-out transport may be thrown away (setup); after it the transport must not
  // be used again. zero: wait as long as it takes.
  virtual Message recv(int peer, std::chrono::milliseconds timeout = std::chrono::milliseconds::zero()) = 0;
  // Makes every blocked and later send()/recv() throw Error(Communication) with `why`. Thread-safe;
  // the transport can then only be destroyed. Destroying it never waits for a peer.
  virtual void abort(const std::string& why) = 0;
  // `peer` ended normally (its process's heartbeat said so: runtime/processes/heartbeat.h): a transport that
  // cannot see that by itself (NCCL) stops waiting for it once a receive from it has waited its peer timeout.
  virtual void peer_left(int peer) { (void)peer; }
};

}  // namespace libpipe::comm
