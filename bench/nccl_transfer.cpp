// libpipe's NCCL transport vs raw ncclSend/ncclRecv between two processes on two GPUs: one float32
// tensor per message, 4 KiB .. 256 MiB, round trips (0 -> 1 -> 0), median of N, GB/s counted as
// 2 * size / round-trip time. Prints SKIPPED and exits 77 with fewer than two CUDA devices.
//   nccl_transfer [round_trips=20]
// The raw side uses the transport's own library (a 2-rank communicator made here from an id in the
// store, default blocking config, ncclSend/ncclRecv + cudaStreamSynchronize on one stream).
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/comm/nccl_transport.h"

#ifdef LIBPIPE_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

using Clock = std::chrono::steady_clock;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static int run(int rank, uint16_t port, int trips) {
#ifdef LIBPIPE_HAVE_NCCL
  const int peer = 1 - rank;
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(rank));
  c10d::TCPStoreOptions o;
  o.port = port;
  o.timeout = std::chrono::seconds(120);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  auto t = libpipe::comm::make_nccl_transport(store, rank, 2, device, std::chrono::seconds(120));

  // raw NCCL
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  impl->setDevice(device);
  ncclUniqueId id;
  if (rank == 0) {
    ncclGetUniqueId(&id);
    const auto* b = reinterpret_cast<const uint8_t*>(&id);
    store->set("bench/raw_id", std::vector<uint8_t>(b, b + sizeof(id)));
  }
  const auto v = store->get("bench/raw_id");
  std::memcpy(&id, v.data(), sizeof(id));
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, 2, id, rank) != ncclSuccess) {
    std::fprintf(stderr, "ncclCommInitRank failed\n");
    return 1;
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);

  if (rank == 0) std::printf("%12s %14s %14s %12s %12s\n", "bytes", "libpipe us", "raw us", "libpipe GB/s", "raw GB/s");
  for (size_t bytes = 4096; bytes <= (size_t{256} << 20); bytes *= 4) {
    at::Tensor x = at::ones({static_cast<int64_t>(bytes / 4)}, at::TensorOptions().device(device));
    at::Tensor y = at::empty_like(x);
    libpipe::comm::Message m;
    m.values = {x};
    std::vector<double> lib, raw;
    for (int i = 0; i < trips + 2; ++i) {  // 2 warm-up trips
      const auto s = Clock::now();
      if (rank == 0) {
        t->send(peer, m);
        (void)t->recv(peer);
      } else {
        auto r = t->recv(peer);
        t->send(peer, r);
      }
      if (i >= 2) lib.push_back(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
    }
    for (int i = 0; i < trips + 2; ++i) {
      const auto s = Clock::now();
      if (rank == 0) {
        ncclSend(x.data_ptr(), bytes, ncclUint8, peer, comm, stream);
        cudaStreamSynchronize(stream);
        ncclRecv(y.data_ptr(), bytes, ncclUint8, peer, comm, stream);
        cudaStreamSynchronize(stream);
      } else {
        ncclRecv(y.data_ptr(), bytes, ncclUint8, peer, comm, stream);
        cudaStreamSynchronize(stream);
        ncclSend(y.data_ptr(), bytes, ncclUint8, peer, comm, stream);
        cudaStreamSynchronize(stream);
      }
      if (i >= 2) raw.push_back(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
    }
    if (rank == 0) {
      const double l = median(lib), r = median(raw);
      std::printf("%12zu %14.1f %14.1f %12.2f %12.2f\n", bytes, l, r, 2e-3 * bytes / l, 2e-3 * bytes / r);
      std::fflush(stdout);
    }
  }
  ncclCommDestroy(comm);
  return 0;
#else
  (void)rank;
  (void)port;
  (void)trips;
  return 77;
#endif
}

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--rank1")
    return run(1, static_cast<uint16_t>(std::stoi(argv[2])), std::stoi(argv[3]));
  const int trips = argc > 1 ? std::max(1, std::stoi(argv[1])) : 20;
  std::string why;
  if (!libpipe::comm::nccl_available(&why)) {
    std::printf("SKIPPED: %s\n", why.c_str());
    return 77;
  }
  const int n = c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)
                    ? c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount()
                    : 0;
  if (n < 2) {
    std::printf("SKIPPED: needs 2 CUDA devices; this machine has %d\n", n);
    return 77;
  }
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  const std::string port = std::to_string(server->getPort()), t = std::to_string(trips);
  const pid_t child = ::fork();
  if (child == 0) {
    ::execl("/proc/self/exe", argv[0], "--rank1", port.c_str(), t.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  const int rc = run(0, server->getPort(), trips);
  int status = 0;
  ::waitpid(child, &status, 0);
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
