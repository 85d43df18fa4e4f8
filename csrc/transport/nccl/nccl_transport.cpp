#include "transport/nccl/nccl_transport.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/cuda_check.h"
#include "common/error.h"
#include "common/limits.h"
#include "transport/store_check_in.h"

namespace gossip {
namespace {

// A CUDA event without timing, destroyed with its owner. `blocking`: cudaEventSynchronize sleeps
// instead of spinning a core while it waits.
class CudaEvent {
 public:
  explicit CudaEvent(bool blocking = false) {
    const unsigned flags = cudaEventDisableTiming | (blocking ? cudaEventBlockingSync : 0u);
    GOSSIP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags));
  }
  ~CudaEvent() { cudaEventDestroy(event_); }  // never throws; failure leaks one event
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// ncclGroupStart on construction; end() closes the group and checks it. If an exception leaves
// the scope first, the destructor still closes the group so that NCCL's state stays consistent.
class NcclGroupGuard {
 public:
  NcclGroupGuard() { GOSSIP_NCCL_CHECK(ncclGroupStart()); }
  ~NcclGroupGuard() {
    if (open_) ncclGroupEnd();
  }
  void end() {
    open_ = false;
    GOSSIP_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

// Run first on the watchdog's thread (RoundWatchdog::Options::prepare_thread): the transport's
// device is made current, so that the event queries do not create a context on device 0, and the
// thread's stream-capture mode is relaxed, so that they never invalidate a CUDA graph that the user
// captures meanwhile (under the default global mode, a call of another thread can).
std::function<void()> watchdog_thread_setup(c10::Device device) {
  return [device] {
    GOSSIP_CUDA_CHECK(cudaSetDevice(device.index()));
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    GOSSIP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  };
}

// The transport's gossip stream, after checking the device it is taken on.
c10::cuda::CUDAStream gossip_stream(c10::Device device) {
  GOSSIP_CHECK_ARG(device.is_cuda() && device.has_index(),
                   "NcclTransport: device must be a CUDA device with an index, got ", device.str());
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index());
}

}  // namespace

// One posted round on the gossip stream (Note [Gossip stream ordering]).
class NcclWork final : public Work, public WatchedRound {
 public:
  NcclWork(c10::Device device, int64_t round, std::vector<int> recv_peers,
           std::vector<at::Tensor> tensors, std::weak_ptr<RoundWatchdog> watchdog)
      : WatchedRound(round, std::move(recv_peers)),
        device_(device),
        tensors_(std::move(tensors)),
        watchdog_(std::move(watchdog)) {}

  cudaEvent_t end_event() const { return end_.get(); }

  bool is_completed() override {
    throw_if_failed();
    return poll_done();
  }

  // Rule 3: the host waits for the end event, which completes when the round did or when the
  // watchdog aborted it (at most `timeout` from now: the deadline is tightened to it); the
  // watchdog fails the round before aborting, so an error seen after the event is the round's.
  void wait(std::chrono::milliseconds timeout) override {
    if (const auto watchdog = watchdog_.lock()) {
      watchdog->tighten_deadline(*this, Clock::now() + timeout);
    }
    throw_if_failed();
    GOSSIP_CUDA_CHECK(cudaEventSynchronize(end_.get()));
    throw_if_failed();
    const c10::cuda::CUDAGuard guard(device_);
    GOSSIP_CUDA_CHECK(
        cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()), end_.get(), 0));
  }

  // The watchdog's side (its thread has the device current: watchdog_thread_setup()).
  bool poll_done() override {
    const cudaError_t status = cudaEventQuery(end_.get());
    if (status == cudaErrorNotReady) return false;
    GOSSIP_CUDA_CHECK(status);
    return true;
  }

 private:
  const c10::Device device_;
  const CudaEvent end_{/*blocking=*/true};
  // Every buffer of the round (rule 4), released with the Work: by the engine, or by
  // RoundWatchdog::release_done() on a caller's thread, never on the watchdog's.
  const std::vector<at::Tensor> tensors_;
  const std::weak_ptr<RoundWatchdog> watchdog_;
};

NcclComm::NcclComm(ncclUniqueId id, int rank, int world_size) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;  // Note [NCCL communicator calls]
  std::lock_guard<std::mutex> lock(mutex_);
  const ncclResult_t result = ncclCommInitRankConfig(&comm_, world_size, id, rank, &config);
  if (result == ncclInProgress) {  // NCCL_COMM_BLOCKING=0 overrides the config
    alive_ = true;
    abort_locked();
    throw std::runtime_error(
        "gossip_ext: NCCL made the gossip communicator non-blocking (NCCL_COMM_BLOCKING=0 in the "
        "environment?); the NCCL transport needs a blocking one: unset NCCL_COMM_BLOCKING");
  }
  GOSSIP_NCCL_CHECK(result);
  alive_ = true;
}

NcclComm::~NcclComm() {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_locked();
}

void NcclComm::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_locked();
}

void NcclComm::abort_locked() {
  if (!alive_) return;
  alive_ = false;
  ncclCommAbort(comm_);  // best effort: nothing more can be done with a failing communicator
}

void NcclComm::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!alive_) return;
  // Finalizing waits for this rank's own operations (its streams and its proxy), which have
  // completed when the transport calls it: no peer is waited for.
  if (ncclCommFinalize(comm_) == ncclSuccess) {
    alive_ = false;
    ncclCommDestroy(comm_);
    return;
  }
  abort_locked();
}

std::string NcclComm::async_error() {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || !alive_) return "";
  ncclResult_t result = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) return "ncclCommGetAsyncError failed";
  if (result == ncclSuccess || result == ncclInProgress) return "";
  return detail::str_cat(ncclGetErrorString(result), ": ", ncclGetLastError(comm_));
}

NcclTransport::NcclTransport(c10::intrusive_ptr<c10d::Store> store, const std::string& key,
                             int rank, int world_size, c10::Device device,
                             std::chrono::milliseconds timeout)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_(timeout),
      store_(std::move(store)),
      key_(key),
      connected_(std::max(world_size, 0), false),
      stream_(gossip_stream(device)) {
  GOSSIP_CHECK_ARG(store_, "NcclTransport: store must not be None");
  GOSSIP_CHECK_ARG(!key.empty(), "NcclTransport: key must not be empty");
  GOSSIP_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size,
                   "NcclTransport: rank must be in [0, world_size), got rank ", rank,
                   " and world_size ", world_size);
  check_world_size_cap(world_size, "NcclTransport");
  GOSSIP_CHECK_ARG(timeout.count() > 0, "NcclTransport: timeout must be positive, got ",
                   timeout.count(), " ms");

  // Rank 0 publishes the unique id before it checks in, so it is there once the check-in is done.
  ncclUniqueId id;
  const std::string id_key = key_ + "/unique_id";
  if (rank == 0) {
    GOSSIP_NCCL_CHECK(ncclGetUniqueId(&id));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store_->set(id_key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
  }
  store_check_in(*store_, key_ + "/init", rank_, world_size_, timeout_,
                 "initialise the NCCL communicator (every rank of the group builds its gossip "
                 "engine at the same point)");
  if (rank != 0) {
    const std::vector<uint8_t> bytes = store_->get(id_key);
    TORCH_CHECK(bytes.size() == sizeof(id), "gossip_ext: the NCCL unique id under ", id_key,
                " has ", bytes.size(), " bytes, expected ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  const c10::cuda::CUDAGuard guard(device_);
  comm_ = std::make_shared<NcclComm>(id, rank, world_size);
  watchdog_ = std::make_shared<RoundWatchdog>(
      RoundWatchdog::Options{rank, "nccl", timeout, std::chrono::milliseconds(100),
                             watchdog_thread_setup(device_)},
      [comm = comm_] { return comm->async_error(); },
      [comm = comm_] { comm->abort(); });
}

void NcclTransport::connect_peers(const std::vector<int>& peers) {
  for (const int peer : peers) {
    GOSSIP_CHECK_ARG(peer >= 0 && peer < world_size_ && (peer != rank_ || world_size_ == 1),
                     "NcclTransport: peers must be other ranks in [0, ", world_size_,
                     ") (or rank 0 itself in a world of one), got ", peers, " on rank ", rank_);
  }
  store_check_in(*store_, detail::str_cat(key_, "/connect/", connections_++), rank_,
                 world_size_, timeout_,
                 "connect their NCCL peers (every rank of the group builds its gossip engine, and "
                 "changes its schedule, at the same point)");
  std::vector<int> fresh;
  for (const int peer : peers) {
    if (!connected_[peer]) fresh.push_back(peer);
    connected_[peer] = true;
  }
  if (fresh.empty()) return;
  // One byte each way with every new peer, in one group: NCCL connects them while every rank is
  // here (Note [NCCL communicator calls]). The round is -1 in error messages.
  const at::Tensor bytes = at::zeros({2 * static_cast<int64_t>(fresh.size())},
                                     at::TensorOptions().dtype(at::kByte).device(device_));
  std::vector<PeerMessage> sends, recvs;
  for (size_t i = 0; i < fresh.size(); ++i) {
    sends.push_back({fresh[i], bytes.narrow(0, 2 * i, 1)});
    recvs.push_back({fresh[i], bytes.narrow(0, 2 * i + 1, 1)});
  }
  post(sends, recvs, /*round=*/-1)->synchronize(timeout_);
}

NcclTransport::~NcclTransport() {
  // Rounds still in flight may be what a peer is receiving: wait for them (bounded by the
  // timeout) before tearing down, so that a rank that finishes first does not abort under its
  // peers. A failed or unfinished round leaves nothing to flush: abort.
  const bool settled = watchdog_->drain();
  watchdog_.reset();  // joins its thread: no hook runs after this
  if (settled) {
    comm_->finalize();
  } else {
    comm_->abort();
  }
}

void NcclTransport::abandon(const std::string& why) {
  watchdog_->fail(std::make_exception_ptr(TimeoutError(
      detail::str_cat("gossip_ext: rank ", rank_, " gave up its nccl gossip rounds: ", why),
      {{}, std::nullopt, "nccl", std::nullopt})));
}

std::shared_ptr<Work> NcclTransport::exchange(std::vector<PeerMessage> sends,
                                              std::vector<PeerMessage> recvs, int64_t round) {
  for (const auto* list : {&recvs, &sends}) {
    for (const PeerMessage& m : *list) {
      TORCH_CHECK(m.peer >= 0 && m.peer < world_size_ && connected_[m.peer],
                  "gossip_ext: round ", round, " of rank ", rank_, " exchanges with rank ",
                  m.peer, ", which its NCCL transport has not connected (Note [NCCL communicator "
                  "calls]): connect_peers() must name every peer of the schedule first");
    }
  }
  return post(sends, recvs, round);
}

std::shared_ptr<Work> NcclTransport::post(const std::vector<PeerMessage>& sends,
                                          const std::vector<PeerMessage>& recvs, int64_t round) {
  watchdog_->release_done();
  watchdog_->throw_if_failed();
  const c10::cuda::CUDAGuard guard(device_);
  std::vector<at::Tensor> tensors;
  std::vector<int> recv_peers;
  for (const auto* list : {&recvs, &sends}) {
    for (const PeerMessage& m : *list) {
      TORCH_CHECK(m.buffer.device() == device_, "gossip_ext: the NCCL transport on ", device_,
                  " got a buffer on ", m.buffer.device());
      TORCH_CHECK(m.buffer.is_contiguous(), "gossip_ext: NCCL messages must be contiguous");
      tensors.push_back(m.buffer);
    }
  }
  for (const PeerMessage& m : recvs) recv_peers.push_back(m.peer);

  // Note [Gossip stream ordering], rule 1: the gossip stream waits for the compute stream.
  {
    const CudaEvent ready;
    GOSSIP_CUDA_CHECK(
        cudaEventRecord(ready.get(), c10::cuda::getCurrentCUDAStream(device_.index())));
    GOSSIP_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), ready.get(), 0));
  }
  auto work = std::make_shared<NcclWork>(device_, round, recv_peers, tensors, watchdog_);
  // Rule 2: the whole round in one group, then the end event. Every peer is connected, so the
  // group only enqueues (Note [NCCL communicator calls]).
  try {
    std::lock_guard<std::mutex> lock(comm_->mutex());
    // The watchdog may have aborted the communicator since the check above: never post on it.
    if (!comm_->alive_locked()) {
      watchdog_->throw_if_failed();
      throw std::runtime_error("gossip_ext: the nccl communicator was aborted");
    }
    {
      NcclGroupGuard group;
      for (const PeerMessage& m : recvs) {
        GOSSIP_NCCL_CHECK(ncclRecv(m.buffer.data_ptr(), m.buffer.nbytes(), ncclUint8, m.peer,
                                   comm_->get(), stream_.stream()));
      }
      for (const PeerMessage& m : sends) {
        GOSSIP_NCCL_CHECK(ncclSend(m.buffer.const_data_ptr(), m.buffer.nbytes(), ncclUint8,
                                   m.peer, comm_->get(), stream_.stream()));
      }
      group.end();
    }
    GOSSIP_CUDA_CHECK(cudaEventRecord(work->end_event(), stream_.stream()));
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    watchdog_->fail(error);  // the communicator is released above: the abort may take it
    std::rethrow_exception(error);
  }
  // Rule 4: the caching allocator must not hand these blocks out before the gossip stream is done.
  for (const at::Tensor& t : tensors) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
  }
  watchdog_->watch(work);
  return work;
}

}  // namespace gossip
