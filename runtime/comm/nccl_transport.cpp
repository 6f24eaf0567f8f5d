#include "runtime/comm/nccl_transport.h"

#include "runtime/error.h"

#ifdef LIBPIPE_HAVE_NCCL
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <climits>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "runtime/comm/wire.h"
#include "runtime/log.h"
#endif

#ifdef LIBPIPE_HAVE_NCCL
// The real headers, from the pip wheels next to LibTorch: cuda_runtime_api.h (nvidia-cuda-runtime)
// needs crt/ (nvidia-cuda-crt), and nccl.h (nvidia-nccl) includes cuda_fp16.h, which needs CCCL's
// <nv/target> (nvidia-cuda-cccl); cmake/NCCL.cmake finds all of them. libcudart and libnccl are
// loaded at run time; an older libnccl than these headers describe is refused (below).
#include <cuda_runtime_api.h>
#include <nccl.h>

namespace {
// The ncclConfig_t layout this file was compiled with: a libnccl older than that may read it
// differently.
constexpr int kNcclConfigVersion = NCCL_VERSION_CODE;

ncclConfig_t nonblocking_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;  // every field undefined: NCCL's defaults
  c.commName = "libpipe";
  c.blocking = 0;
  return c;
}
}  // namespace
#endif

namespace libpipe::comm {

namespace {
constexpr const char* kWithoutNccl =
    "this libpipe was built without NCCL (nccl.h and the CUDA runtime were not found at build time)";
}  // namespace

#ifndef LIBPIPE_HAVE_NCCL

bool nccl_available(std::string* why) {
  if (why) *why = kWithoutNccl;
  return false;
}

std::unique_ptr<Transport> make_nccl_transport(c10::intrusive_ptr<c10d::Store>, int, int, c10::Device,
                                               std::chrono::milliseconds, std::chrono::milliseconds) {
  throw Error(Status::Unsupported, kWithoutNccl);
}

#else  // LIBPIPE_HAVE_NCCL

// How it works
// ------------
// Channels. Every ordered pair of ranks (a, b) has its own 2-rank communicator (a is its rank 0,
// b its rank 1) and, on each side, its own comm stream and events. A channel is used by one thread
// at a time on each side (the transport's contract: one sender and one receiver per peer), and
// NCCL requires no more: a communicator must not be used by two threads at once. One world
// communicator would not do: NCCL runs the kernels of one communicator one after the other, so a
// large send waiting for its receiver would hold back this rank's own receives, and two ranks
// sending to each other (or a ring) would deadlock. The ids come from the sending rank of each
// channel, through the store; all communicators are created in one ncclGroupStart/End.
//
// Warm-up. NCCL connects a pair of ranks on their first send/recv; make_nccl_transport does a
// 1-byte send/recv on every channel, channel by channel in one global order (every rank walks the
// ordered pairs (a, b) lexicographically), which cannot deadlock: the first unfinished channel
// always has both its ranks waiting on it.
//
// A message is three launches on the channel, the same on both sides (NCCL matches a pair's
// sends and receives in order): the preamble (64 bytes), then meta and bytes as one uint8 buffer
// (when not empty; the receiver knows its size from the preamble), then a group with every tensor
// of at least one byte. Control parts go through a per-channel device buffer; tensors go as they are
// (copied to `device` first when elsewhere).
//
// Streams. Control buffers belong to the comm stream (cudaMallocAsync on it). Tensors to send are made on the caller's
// current stream; the comm stream waits for an event recorded there. Received tensors are allocated on the caller's
// current stream (they are the caller's), the comm stream waits for it before receiving into them, and the caller's
// stream waits for the comm stream after.
//
// Waiting. Communicators are non-blocking (ncclConfig_t::blocking = 0): every NCCL call returns at
// once, possibly with ncclInProgress, and the transport polls ncclCommGetAsyncError (until the
// operation is enqueued) and cudaStreamQuery (until it completed), checking the abort flag and the
// deadline between polls; it never blocks in CUDA or NCCL, so abort() can always interrupt it.
//
// Abort. abort() sets the flag, then calls ncclCommAbort on every channel under the channel's
// mutex (the pollers take that mutex around each NCCL call, so no call races with the abort, and
// the communicator is gone after). The destructor aborts the communicators too (ncclCommDestroy
// could wait for peers).
//
// Liveness. NCCL notices neither a peer that died nor one that hangs (its kernels wait for ever on one
// machine). The transport does not judge that itself: the process's heartbeat does
// (runtime/processes/heartbeat.h, one per process whatever its transport), watching every other rank's
// counter in the store and calling abort() when one stops or marks itself failed, and peer_left() when
// one ends normally (a receive from it that has waited peer_timeout since then fails).

namespace {

constexpr size_t kPreambleBytes = wire::kPreambleWords * sizeof(int64_t);

using Clock = std::chrono::steady_clock;

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

std::string cuda_text(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }

std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  std::string text = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) text += std::string(" (") + last + ")";
  return text;
}

struct Channel {
  int peer = -1;
  bool sending = false;  // this rank is the channel's rank 0
  std::mutex mu;         // held around every NCCL call on `comm`, and by abort
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // recorded on the caller's stream, waited for by `stream`
  cudaEvent_t done = nullptr;   // recorded on `stream`, waited for by the caller's stream
  // Buffers an aborted operation may still touch: kept until the transport is destroyed.
  std::vector<at::Tensor> graveyard;
  // Control parts (preamble, meta, bytes) go through this device buffer, allocated in stream
  // order on `stream` (cudaMallocAsync: no device-wide synchronization, unlike cudaFree).
  void* control = nullptr;
  size_t control_bytes = 0;

  int nccl_peer() const { return sending ? 1 : 0; }
  std::string name() const { return (sending ? "sending to rank " : "receiving from rank ") + std::to_string(peer); }
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, c10::Device device,
                std::chrono::milliseconds timeout, std::chrono::milliseconds peer_timeout)
      : store_(std::move(store)),
        rank_(rank),
        world_size_(world_size),
        device_(device),
        peer_timeout_(peer_timeout),
        left_at_(static_cast<size_t>(world_size)) {
    for (auto& t : left_at_) t.store(0);
    try {
      setup(timeout);
    } catch (...) {
      shutdown(false);
      throw;
    }
  }

  ~NcclTransport() override { shutdown(!aborted_.load()); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  void send(int peer, const Message& message) override {
    check_peer(peer, "send to");
    throw_if_aborted();
    Channel& ch = *send_[static_cast<size_t>(peer)];
    const c10::DeviceGuard device_guard(device_);
    const auto compute = current_stream();

    wire::Frame frame = wire::encode(message);
    std::vector<at::Tensor> payload;  // byte views on `device_`, on the caller's stream
    for (const auto& t : frame.tensors) {
      if (t.numel() == 0 || t.element_size() == 0) continue;
      at::Tensor d = t.device() == device_ ? t : t.to(device_);
      payload.push_back(wire::byte_view(d.contiguous()));
    }
    const size_t rest = frame.meta.size() * sizeof(int64_t) + frame.bytes.size();
    std::vector<uint8_t> host(kPreambleBytes + rest);
    std::memcpy(host.data(), frame.preamble.data(), kPreambleBytes);
    if (!frame.meta.empty())
      std::memcpy(host.data() + kPreambleBytes, frame.meta.data(), frame.meta.size() * sizeof(int64_t));
    if (!frame.bytes.empty())
      std::memcpy(host.data() + kPreambleBytes + frame.meta.size() * sizeof(int64_t), frame.bytes.data(),
                  frame.bytes.size());

    try {
      auto* c = static_cast<uint8_t*>(control_buffer(ch, host.size()));
      // The comm stream is idle here (the previous send completed), so this pageable copy returns at once.
      cuda_check(ch, cudaMemcpyAsync(c, host.data(), host.size(), cudaMemcpyHostToDevice, ch.stream),
                 "copying a message header to the GPU");
      cuda_check(ch, cudaEventRecord(ch.ready, compute), "recording an event");
      cuda_check(ch, cudaStreamWaitEvent(ch.stream, ch.ready, 0), "ordering the comm stream");
      launch(ch, {{c, kPreambleBytes}});
      if (rest > 0) launch(ch, {{c + kPreambleBytes, rest}});
      if (!payload.empty()) launch(ch, spans(payload));
      wait(ch, /*complete=*/true, std::nullopt);
    } catch (...) {
      bury(ch, std::move(payload));
      throw;
    }
  }

  Message recv(int peer, std::chrono::milliseconds timeout) override {
    check_peer(peer, "receive from");
    throw_if_aborted();
    Channel& ch = *recv_[static_cast<size_t>(peer)];
    std::optional<Clock::time_point> deadline;
    if (timeout > std::chrono::milliseconds::zero()) deadline = Clock::now() + timeout;
    const c10::DeviceGuard device_guard(device_);
    const auto compute = current_stream();

    std::vector<at::Tensor> in_use;
    try {
      wire::Preamble preamble{};
      receive_control(ch, kPreambleBytes, reinterpret_cast<uint8_t*>(preamble.data()), deadline, timeout);
      const auto sizes = wire::announced(preamble);  // throws Communication for a foreign peer
      const size_t rest = sizes.meta_words * sizeof(int64_t) + sizes.bytes;
      std::vector<int64_t> meta(sizes.meta_words);
      std::vector<uint8_t> bytes(sizes.bytes);
      if (rest > 0) {
        std::vector<uint8_t> buffer(rest);
        receive_control(ch, rest, buffer.data(), deadline, timeout);
        if (!meta.empty()) std::memcpy(meta.data(), buffer.data(), meta.size() * sizeof(int64_t));
        if (!bytes.empty()) std::memcpy(bytes.data(), buffer.data() + meta.size() * sizeof(int64_t), bytes.size());
      }
      std::vector<at::Tensor> tensors = wire::allocate(meta, at::TensorOptions().device(device_));
      std::vector<at::Tensor> payload;
      for (const auto& t : tensors)
        if (t.numel() > 0 && t.element_size() > 0) payload.push_back(wire::byte_view(t));
      if (!payload.empty()) {
        in_use.insert(in_use.end(), payload.begin(), payload.end());
        cuda_check(ch, cudaEventRecord(ch.ready, compute), "recording an event");
        cuda_check(ch, cudaStreamWaitEvent(ch.stream, ch.ready, 0), "ordering the comm stream");
        launch(ch, spans(payload));
        wait(ch, /*complete=*/true, deadline, timeout);
        cuda_check(ch, cudaEventRecord(ch.done, ch.stream), "recording an event");
        cuda_check(ch, cudaStreamWaitEvent(compute, ch.done, 0), "ordering the caller's stream");
      }
      return wire::decode(preamble, bytes, std::move(tensors));
    } catch (const Error& e) {
      // A foreign or malformed message also leaves the channel out of step: nothing later can be read.
      if (!aborted_.load()) abort(e.what());
      bury(ch, std::move(in_use));
      throw;
    } catch (const std::exception& e) {
      const std::string why = "receiving a message from rank " + std::to_string(peer) + " failed: " + e.what();
      abort(why);
      bury(ch, std::move(in_use));
      throw Error(Status::Communication, why);
    }
  }

  void abort(const std::string& why) override {
    {
      const std::lock_guard<std::mutex> lock(why_mu_);
      if (aborted_.load()) return;
      why_ = why;
      aborted_.store(true);
    }
    log::warning("NCCL transport (rank " + std::to_string(rank_) + ") aborted: " + why);
    abort_comms();
  }

  void peer_left(int peer) override {
    if (peer >= 0 && peer < world_size_ && peer != rank_)
      left_at_[static_cast<size_t>(peer)].store(Clock::now().time_since_epoch().count());
  }

 private:
  struct Span {
    void* data;
    size_t bytes;
  };

  // --- setup ---

  void setup(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    const c10::DeviceGuard device_guard(device_);
    // Each rank counts its NCCL transports on this store, so the n-th of every rank meet under one
    // prefix and a later session on the same store does not read an earlier one's ids.
    prefix_ =
        "libpipe/nccl/" + std::to_string(store_->add("libpipe/nccl/generation/" + std::to_string(rank_), 1)) + "/";
    send_.resize(static_cast<size_t>(world_size_));
    recv_.resize(static_cast<size_t>(world_size_));
    for (int p = 0; p < world_size_; ++p) {
      if (p == rank_) continue;
      for (bool sending : {true, false}) {
        auto ch = std::make_unique<Channel>();
        ch->peer = p;
        ch->sending = sending;
        cuda_check(*ch, cudaStreamCreateWithFlags(&ch->stream, cudaStreamNonBlocking), "creating a stream");
        cuda_check(*ch, cudaEventCreateWithFlags(&ch->ready, cudaEventDisableTiming), "creating an event");
        cuda_check(*ch, cudaEventCreateWithFlags(&ch->done, cudaEventDisableTiming), "creating an event");
        (sending ? send_ : recv_)[static_cast<size_t>(p)] = std::move(ch);
      }
    }
    if (world_size_ == 1) return;

    // The ids: the sending rank of each channel makes it.
    std::vector<ncclUniqueId> mine(static_cast<size_t>(world_size_));
    for (int p = 0; p < world_size_; ++p) {
      if (p == rank_) continue;
      ncclUniqueId& id = mine[static_cast<size_t>(p)];
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) fail("ncclGetUniqueId failed: " + std::string(ncclGetErrorString(r)));
      const auto* b = reinterpret_cast<const uint8_t*>(&id);
      store_->set(id_key(rank_, p), std::vector<uint8_t>(b, b + sizeof(id)));
    }
    std::vector<ncclUniqueId> ids(static_cast<size_t>(world_size_));
    for (int p = 0; p < world_size_; ++p) {
      if (p == rank_) continue;
      const auto key = id_key(p, rank_);
      try {
        store_->wait({key}, remaining(deadline));
      } catch (const std::exception& e) {
        fail("rank " + std::to_string(p) + " did not publish its NCCL id within " + ms_text(timeout) +
             " (is it running, with the same world size?): " + e.what());
      }
      const auto value = store_->get(key);
      if (value.size() != sizeof(ncclUniqueId)) fail("rank " + std::to_string(p) + " published a malformed NCCL id");
      std::memcpy(&ids[static_cast<size_t>(p)], value.data(), sizeof(ncclUniqueId));
    }

    // The communicators, all at once (each is collective over its two ranks).
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) fail("ncclGroupStart failed: " + std::string(ncclGetErrorString(r)));
    for (int p = 0; p < world_size_; ++p) {
      if (p == rank_) continue;
      for (bool sending : {true, false}) {
        Channel& ch = *(sending ? send_ : recv_)[static_cast<size_t>(p)];
        ncclConfig_t config = nonblocking_config();
        const ncclUniqueId& id = (sending ? mine : ids)[static_cast<size_t>(p)];
        r = ncclCommInitRankConfig(&ch.comm, 2, id, sending ? 0 : 1, &config);
        if (r != ncclSuccess && r != ncclInProgress) {
          ncclGroupEnd();
          fail("creating the NCCL communicator " + ch.name() + " failed: " + std::string(ncclGetErrorString(r)));
        }
      }
    }
    r = ncclGroupEnd();
    if (r != ncclSuccess && r != ncclInProgress)
      fail("creating the NCCL communicators failed: " + std::string(ncclGetErrorString(r)));
    for (auto* list : {&send_, &recv_})
      for (auto& ch : *list)
        if (ch) wait(*ch, /*complete=*/false, deadline, timeout, "connecting");

    // Warm-up, channel by channel in one global order (see above).
    for (int a = 0; a < world_size_; ++a) {
      for (int b = 0; b < world_size_; ++b) {
        if (a == b || (a != rank_ && b != rank_)) continue;
        Channel& ch = a == rank_ ? *send_[static_cast<size_t>(b)] : *recv_[static_cast<size_t>(a)];
        void* one = control_buffer(ch, 1);
        cuda_check(ch, cudaMemsetAsync(one, 0, 1, ch.stream), "clearing a buffer");
        launch(ch, {{one, 1}});
        wait(ch, /*complete=*/true, deadline, timeout, "warming up the connection");
      }
    }
  }

  std::string id_key(int from, int to) const {
    return prefix_ + "id/" + std::to_string(from) + "-" + std::to_string(to);
  }

  static std::chrono::milliseconds remaining(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }

  // --- operations ---

  static std::vector<Span> spans(const std::vector<at::Tensor>& bytes) {
    std::vector<Span> out;
    for (const auto& t : bytes) out.push_back({t.data_ptr(), static_cast<size_t>(t.numel())});
    return out;
  }

  // The channel's control buffer, grown to at least `bytes` (only ever used on the comm stream).
  void* control_buffer(Channel& ch, size_t bytes) {
    if (ch.control_bytes < bytes) {
      const size_t grown = std::max({bytes, 2 * ch.control_bytes, size_t{64} << 10});
      if (ch.control) cuda_check(ch, cudaFreeAsync(ch.control, ch.stream), "freeing a buffer");
      ch.control = nullptr;
      ch.control_bytes = 0;
      cuda_check(ch, cudaMallocAsync(&ch.control, grown, ch.stream), "allocating a buffer");
      ch.control_bytes = grown;
    }
    return ch.control;
  }

  // The caller's current stream on `device_` (PyTorch's, through c10's device-generic interface).
  cudaStream_t current_stream() const {
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    return static_cast<cudaStream_t>(impl->getStreamNativeHandle(impl->getStream(device_)));
  }

  // Enqueues the sends (or receives) of `parts` on the channel, as one NCCL group when more than
  // one, and waits until NCCL has enqueued them on the comm stream.
  void launch(Channel& ch, const std::vector<Span>& parts) {
    std::string failure;
    {
      const std::lock_guard<std::mutex> lock(ch.mu);
      if (aborted_.load() || !ch.comm) throw Error(Status::Communication, why());
      ncclResult_t r = ncclSuccess;
      const bool group = parts.size() > 1;
      if (group) r = ncclGroupStart();
      for (const auto& part : parts) {
        if (r != ncclSuccess && r != ncclInProgress) break;
        r = ch.sending ? ncclSend(part.data, part.bytes, ncclUint8, ch.nccl_peer(), ch.comm, ch.stream)
                       : ncclRecv(part.data, part.bytes, ncclUint8, ch.nccl_peer(), ch.comm, ch.stream);
      }
      if (group) {
        const ncclResult_t end = ncclGroupEnd();
        if (r == ncclSuccess || r == ncclInProgress) r = end;
      }
      if (r != ncclSuccess && r != ncclInProgress) failure = "NCCL " + ch.name() + " failed: " + nccl_text(r, ch.comm);
    }
    if (!failure.empty()) fail(failure);  // not under the lock: abort takes it
    wait(ch, /*complete=*/false, std::nullopt);
  }

  // Polls until NCCL has enqueued the channel's last operation (complete=false) or until the comm
  // stream has finished it (complete=true). Throws Error(Communication) after abort(), on an NCCL or
  // CUDA error (aborting the transport), and after `deadline` (aborting it too).
  void wait(Channel& ch, bool complete, std::optional<Clock::time_point> deadline,
            std::chrono::milliseconds timeout = std::chrono::milliseconds::zero(), const char* doing = nullptr) {
    for (int spin = 0;; ++spin) {
      if (aborted_.load()) throw Error(Status::Communication, why());
      std::string failure;
      bool finished = false;
      {
        const std::lock_guard<std::mutex> lock(ch.mu);
        if (!ch.comm) throw Error(Status::Communication, why());
        ncclResult_t state = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(ch.comm, &state);
        if (r != ncclSuccess) {
          failure = "NCCL " + ch.name() + " failed: " + nccl_text(r, ch.comm);
        } else if (state == ncclInProgress) {
          // not enqueued yet
        } else if (state != ncclSuccess) {
          failure = "NCCL " + ch.name() + " failed: " + nccl_text(state, ch.comm);
        } else if (!complete) {
          finished = true;
        } else {
          const cudaError_t q = cudaStreamQuery(ch.stream);
          if (q == cudaSuccess) finished = true;
          else if (q != cudaErrorNotReady) failure = "CUDA failed while " + ch.name() + ": " + cuda_text(q);
        }
      }
      if (!failure.empty()) fail(failure);
      if (finished) return;
      if (deadline && Clock::now() >= *deadline)
        fail(std::string(doing ? doing : (ch.sending ? "sending" : "waiting for a message")) + " (" + ch.name() +
             ") timed out after " + ms_text(timeout) + "; the NCCL transport cannot be used after this");
      if (const int64_t left = left_at_[static_cast<size_t>(ch.peer)].load(); left != 0) {
        const auto since = Clock::now().time_since_epoch() - Clock::duration(left);
        if (since > peer_timeout_)
          fail("rank " + std::to_string(ch.peer) + " closed its NCCL transport while this rank was " + ch.name());
      }
      if (spin < 256) std::this_thread::yield();
      else std::this_thread::sleep_for(spin < 4096 ? std::chrono::microseconds(20) : std::chrono::microseconds(200));
    }
  }

  void receive_control(Channel& ch, size_t bytes, uint8_t* out, std::optional<Clock::time_point> deadline,
                       std::chrono::milliseconds timeout) {
    void* d = control_buffer(ch, bytes);
    launch(ch, {{d, bytes}});
    wait(ch, /*complete=*/true, deadline, timeout);
    // Into pageable memory: returns once copied (the stream is idle, the receive having completed).
    cuda_check(ch, cudaMemcpyAsync(out, d, bytes, cudaMemcpyDeviceToHost, ch.stream),
               "copying a message header from the GPU");
    wait(ch, /*complete=*/true, deadline, timeout);
  }

  void cuda_check(Channel& ch, cudaError_t e, const char* doing) {
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear a non-sticky error
      fail(std::string("CUDA failed ") + doing + " (" + (ch.peer >= 0 ? ch.name() : "setup") + "): " + cuda_text(e));
    }
  }

  void bury(Channel& ch, std::vector<at::Tensor> tensors) {
    if (!aborted_.load()) return;  // the operation finished or never started: nothing touches them
    const std::lock_guard<std::mutex> lock(ch.mu);
    for (auto& t : tensors) ch.graveyard.push_back(std::move(t));
  }

  [[noreturn]] void fail(const std::string& why) {
    abort(why);
    throw Error(Status::Communication, this->why());
  }

  void throw_if_aborted() const {
    if (aborted_.load()) throw Error(Status::Communication, why());
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= world_size_ || peer == rank_)
      throw Error(Status::InvalidArgument, "cannot " + std::string(what) + " rank " + std::to_string(peer) +
                                               ": this is rank " + std::to_string(rank_) + " of " +
                                               std::to_string(world_size_));
  }

  std::string why() const {
    const std::lock_guard<std::mutex> lock(why_mu_);
    return why_.empty() ? "the NCCL transport was aborted" : why_;
  }

  void abort_comms() {
    for (auto* list : {&send_, &recv_}) {
      for (auto& ch : *list) {
        if (!ch) continue;
        const std::lock_guard<std::mutex> lock(ch->mu);
        if (ch->comm) {
          const c10::DeviceGuard device_guard(device_);
          ncclCommAbort(ch->comm);  // never waits for the peer; stops this side's kernels
          ch->comm = nullptr;
        }
      }
    }
  }

  void shutdown(bool normally) {
    if (!aborted_.load()) {
      const std::lock_guard<std::mutex> lock(why_mu_);
      why_ = "the NCCL transport was destroyed";
      aborted_.store(true);
    }
    (void)normally;
    abort_comms();
    for (auto* list : {&send_, &recv_}) {
      for (auto& ch : *list) {
        if (!ch) continue;
        if (ch->ready) cudaEventDestroy(ch->ready);
        if (ch->done) cudaEventDestroy(ch->done);
        // Returns at once; the stream's resources are released when its work (if any) ends.
        if (ch->control) cudaFreeAsync(ch->control, ch->stream);
        if (ch->stream) cudaStreamDestroy(ch->stream);
      }
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int world_size_;
  const c10::Device device_;
  const std::chrono::milliseconds peer_timeout_;
  std::string prefix_;
  std::vector<std::unique_ptr<Channel> > send_, recv_;  // indexed by peer
  std::vector<std::atomic<int64_t> > left_at_;          // steady-clock ticks when a peer left; 0: it has not

  std::atomic<bool> aborted_{false};
  mutable std::mutex why_mu_;
  std::string why_;
};

}  // namespace

bool nccl_available(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = "no usable CUDA device (" + cuda_text(e) + ")";
    return false;
  }
  if (count < 1) {
    if (why) *why = "no CUDA device";
    return false;
  }
  return true;
}

std::unique_ptr<Transport> make_nccl_transport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                               c10::Device device, std::chrono::milliseconds timeout,
                                               std::chrono::milliseconds peer_timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw Error(Status::InvalidArgument,
                "NCCL transport: rank " + std::to_string(rank) + " is not in a world of " + std::to_string(world_size));
  if (!store) throw Error(Status::InvalidArgument, "NCCL transport: no store");
  if (timeout <= std::chrono::milliseconds::zero())
    throw Error(Status::InvalidArgument, "NCCL transport: the timeout must be positive");
  std::string why;
  if (!nccl_available(&why)) throw Error(Status::Unsupported, "NCCL transport: " + why);
  int count = 0;
  cudaGetDeviceCount(&count);
  if (!device.is_cuda() || !device.has_index() || device.index() >= count)
    throw Error(Status::InvalidArgument, "NCCL transport: " + device.str() +
                                             " is not a CUDA device of this machine (it has " + std::to_string(count) +
                                             "; give one as cuda:N)");
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version < kNcclConfigVersion)
    throw Error(Status::Unsupported, "NCCL transport: libnccl " + std::to_string(version) +
                                         " is older than 2.28.9, the version libpipe was written against");
  if (peer_timeout <= std::chrono::milliseconds::zero()) peer_timeout = timeout;
  return std::make_unique<NcclTransport>(std::move(store), rank, world_size, device, timeout, peer_timeout);
}

#endif  // LIBPIPE_HAVE_NCCL

}  // namespace libpipe::comm
