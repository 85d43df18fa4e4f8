#include "transport/nccl/nccl_transport.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/cuda_check.h"

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

NcclComm::NcclComm(ncclUniqueId id, int rank, int world_size, std::chrono::milliseconds timeout) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::lock_guard<std::mutex> lock(mutex_);
  GOSSIP_NCCL_CHECK(ncclCommInitRankConfig(&comm_, world_size, id, rank, &config));
  alive_ = true;
  bool ready = false;
  try {
    ready = wait_ready(Clock::now() + timeout);
  } catch (...) {
    abort_locked();
    throw;
  }
  if (!ready) {
    abort_locked();
    throw TimeoutError(detail::str_cat(
        "gossip_ext: rank ", rank, " timed out after ", timeout.count(),
        " ms initialising its NCCL communicator of ", world_size,
        " ranks: a rank did not join (every rank of the group must construct the wrapper)"));
  }
}

NcclComm::~NcclComm() {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_locked();
}

bool NcclComm::wait_ready(Clock::time_point deadline) {
  // Note [NCCL communicator calls]: polling is NCCL's interface for non-blocking calls; sleep
  // between polls, starting short since posting a round usually settles within microseconds.
  auto pause = std::chrono::microseconds(5);
  while (true) {
    ncclResult_t state = ncclSuccess;
    GOSSIP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state == ncclSuccess) return true;
    if (state != ncclInProgress) {
      throw std::runtime_error(detail::str_cat("gossip_ext: NCCL failed: ",
                                               ncclGetErrorString(state), ": ",
                                               ncclGetLastError(comm_)));
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
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

void NcclComm::finalize(Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!alive_) return;
  try {
    GOSSIP_NCCL_CHECK(ncclCommFinalize(comm_));
    if (wait_ready(deadline)) {
      alive_ = false;
      ncclCommDestroy(comm_);
      return;
    }
  } catch (const std::exception&) {
    // Finalizing failed: abort below instead.
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
      stream_(gossip_stream(device)) {
  GOSSIP_CHECK_ARG(store, "NcclTransport: store must not be None");
  GOSSIP_CHECK_ARG(!key.empty(), "NcclTransport: key must not be empty");
  GOSSIP_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size,
                   "NcclTransport: rank must be in [0, world_size), got rank ", rank,
                   " and world_size ", world_size);
  GOSSIP_CHECK_ARG(timeout.count() > 0, "NcclTransport: timeout must be positive, got ",
                   timeout.count(), " ms");

  ncclUniqueId id;
  if (rank == 0) {
    GOSSIP_NCCL_CHECK(ncclGetUniqueId(&id));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store->set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
  } else {
    const std::vector<uint8_t> bytes = store->get(key);  // waits up to the store timeout
    TORCH_CHECK(bytes.size() == sizeof(id), "gossip_ext: the NCCL unique id under ", key,
                " has ", bytes.size(), " bytes, expected ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  const c10::cuda::CUDAGuard guard(device_);
  comm_ = std::make_shared<NcclComm>(id, rank, world_size, timeout);
  watchdog_ = std::make_shared<RoundWatchdog>(
      RoundWatchdog::Options{rank, "nccl", timeout, std::chrono::milliseconds(100),
                             watchdog_thread_setup(device_)},
      [comm = comm_] { return comm->async_error(); },
      [comm = comm_] { comm->abort(); });
}

NcclTransport::~NcclTransport() {
  // Rounds still in flight may be what a peer is receiving: wait for them (bounded by the
  // timeout) before tearing down, so that a rank that finishes first does not abort under its
  // peers. A failed or unfinished round leaves nothing to flush: abort.
  const bool settled = watchdog_->drain();
  watchdog_.reset();  // joins its thread: no hook runs after this
  if (settled) {
    comm_->finalize(NcclComm::Clock::now() + timeout_);
  } else {
    comm_->abort();
  }
}

std::shared_ptr<Work> NcclTransport::exchange(std::vector<PeerMessage> sends,
                                              std::vector<PeerMessage> recvs, int64_t round) {
  watchdog_->release_done();
  watchdog_->throw_if_failed();
  const c10::cuda::CUDAGuard guard(device_);
  std::vector<at::Tensor> tensors;
  std::vector<int> recv_peers, send_peers;
  for (const auto* list : {&recvs, &sends}) {
    for (const PeerMessage& m : *list) {
      TORCH_CHECK(m.buffer.device() == device_, "gossip_ext: the NCCL transport on ", device_,
                  " got a buffer on ", m.buffer.device());
      TORCH_CHECK(m.buffer.is_contiguous(), "gossip_ext: NCCL messages must be contiguous");
      tensors.push_back(m.buffer);
    }
  }
  for (const PeerMessage& m : recvs) recv_peers.push_back(m.peer);
  for (const PeerMessage& m : sends) send_peers.push_back(m.peer);

  // Note [Gossip stream ordering], rule 1: the gossip stream waits for the compute stream.
  {
    const CudaEvent ready;
    GOSSIP_CUDA_CHECK(
        cudaEventRecord(ready.get(), c10::cuda::getCurrentCUDAStream(device_.index())));
    GOSSIP_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), ready.get(), 0));
  }
  auto work = std::make_shared<NcclWork>(device_, round, recv_peers, tensors, watchdog_);
  // Rule 2: the whole round in one group, then the end event. Posting holds the communicator
  // (Note [NCCL communicator calls]) at most until the deadline.
  bool posted = false;
  std::exception_ptr error;
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
    posted = comm_->wait_ready(NcclComm::Clock::now() + timeout_);
    if (posted) GOSSIP_CUDA_CHECK(cudaEventRecord(work->end_event(), stream_.stream()));
  } catch (...) {
    error = std::current_exception();
  }
  if (!posted && !error) {
    error = std::make_exception_ptr(TimeoutError(detail::str_cat(
        "gossip_ext: rank ", rank_, " timed out after ", timeout_.count(), " ms in gossip round ",
        round, " posting its messages: peers ", recv_peers, " (receives) and ", send_peers,
        " (sends) did not connect (nccl transport); the nccl communicator was aborted")));
  }
  if (error) {
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
