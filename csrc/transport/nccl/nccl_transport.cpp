#include "transport/nccl/nccl_transport.h"

#include <cstring>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/cuda_check.h"

namespace gossip {
namespace {

constexpr char kUniqueIdKey[] = "gossip_ext/nccl_unique_id";
// How often the watchdog looks at rounds in flight: NCCL offers no completion callback, so, as
// c10d's ProcessGroupNCCL watchdog does, a background thread queries events.
constexpr auto kWatchdogPeriod = std::chrono::milliseconds(100);

// A CUDA event without timing, destroyed with its owner.
class CudaEvent {
 public:
  CudaEvent() { GOSSIP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
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

}  // namespace

// One posted round on the gossip stream (Note [Gossip stream ordering]).
class NcclWork final : public Work {
 public:
  NcclWork(c10::Device device, int64_t round, std::vector<int> recv_peers,
           std::vector<at::Tensor> tensors)
      : device_(device),
        round_(round),
        recv_peers_(std::move(recv_peers)),
        tensors_(std::move(tensors)),
        posted_(std::chrono::steady_clock::now()) {}

  cudaEvent_t end_event() const { return end_.get(); }
  std::chrono::steady_clock::time_point posted() const { return posted_; }
  int64_t round() const { return round_; }
  const std::vector<int>& recv_peers() const { return recv_peers_; }

  bool is_completed() override {
    throw_if_failed();
    return event_done();
  }

  // The current stream waits for the round; the host does not. `timeout` is enforced by the
  // transport's watchdog, which fails the round and aborts the communicator.
  void wait(std::chrono::milliseconds /*timeout*/) override {
    throw_if_failed();
    const c10::cuda::CUDAGuard guard(device_);
    GOSSIP_CUDA_CHECK(
        cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()), end_.get(), 0));
  }

  // The host waits for the end event. It completes when the round did, or when the watchdog
  // aborted the communicator (at most the transport's timeout after posting), and the watchdog
  // fails the round before it aborts: an error seen after the event is the round's.
  void synchronize(std::chrono::milliseconds /*timeout*/) override {
    throw_if_failed();
    GOSSIP_CUDA_CHECK(cudaEventSynchronize(end_.get()));
    throw_if_failed();
  }

  // Watchdog side.
  bool event_done() const {
    const cudaError_t status = cudaEventQuery(end_.get());
    if (status == cudaErrorNotReady) return false;
    GOSSIP_CUDA_CHECK(status);
    return true;
  }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    tensors_.clear();
  }
  void fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
  }

 private:
  void throw_if_failed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
  }

  const c10::Device device_;
  const int64_t round_;
  const std::vector<int> recv_peers_;
  CudaEvent end_;
  mutable std::mutex mutex_;
  std::vector<at::Tensor> tensors_;  // every buffer of the round, until its end event completes
  std::exception_ptr error_;
  const std::chrono::steady_clock::time_point posted_;
};

NcclComm::NcclComm(ncclUniqueId id, int rank, int world_size) {
  GOSSIP_NCCL_CHECK(ncclCommInitRank(&comm_, world_size, id, rank));
}

NcclComm::~NcclComm() {
  // Never throws. An aborted communicator is already freed.
  if (!aborted_.load()) ncclCommDestroy(comm_);
}

void NcclComm::abort() {
  if (!aborted_.exchange(true)) ncclCommAbort(comm_);
}

std::string NcclComm::async_error() const {
  if (aborted_.load()) return "";
  ncclResult_t result = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) return "ncclCommGetAsyncError failed";
  if (result == ncclSuccess || result == ncclInProgress) return "";
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  return detail::str_cat(ncclGetErrorString(result), ": ", ncclGetLastError(comm_));
#else
  return ncclGetErrorString(result);
#endif
}

NcclTransport::NcclTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                             c10::Device device, std::chrono::milliseconds timeout)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_(timeout),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {
  GOSSIP_CHECK_ARG(store, "NcclTransport: store must not be None");
  GOSSIP_CHECK_ARG(device.is_cuda() && device.has_index(),
                   "NcclTransport: device must be a CUDA device with an index, got ", device.str());
  GOSSIP_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size,
                   "NcclTransport: rank must be in [0, world_size), got rank ", rank,
                   " and world_size ", world_size);
  GOSSIP_CHECK_ARG(timeout.count() > 0, "NcclTransport: timeout must be positive, got ",
                   timeout.count(), " ms");

  ncclUniqueId id;
  if (rank == 0) {
    GOSSIP_NCCL_CHECK(ncclGetUniqueId(&id));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store->set(kUniqueIdKey, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
  } else {
    const std::vector<uint8_t> bytes = store->get(kUniqueIdKey);  // waits up to the store timeout
    TORCH_CHECK(bytes.size() == sizeof(id), "gossip_ext: the NCCL unique id in the store has ",
                bytes.size(), " bytes, expected ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  const c10::cuda::CUDAGuard guard(device_);
  comm_ = std::make_shared<NcclComm>(id, rank, world_size);
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

NcclTransport::~NcclTransport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  watchdog_.join();
}

void NcclTransport::throw_if_failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
}

std::shared_ptr<Work> NcclTransport::exchange(std::vector<PeerMessage> sends,
                                              std::vector<PeerMessage> recvs, int64_t round) {
  throw_if_failed();
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
  auto work = std::make_shared<NcclWork>(device_, round, std::move(recv_peers), tensors);
  // Rule 2: the whole round in one group, then the end event.
  {
    NcclGroupGuard group;
    for (const PeerMessage& m : recvs) {
      GOSSIP_NCCL_CHECK(ncclRecv(m.buffer.data_ptr(), m.buffer.nbytes(), ncclUint8, m.peer,
                                 comm_->get(), stream_.stream()));
    }
    for (const PeerMessage& m : sends) {
      GOSSIP_NCCL_CHECK(ncclSend(m.buffer.const_data_ptr(), m.buffer.nbytes(), ncclUint8, m.peer,
                                 comm_->get(), stream_.stream()));
    }
    group.end();
  }
  GOSSIP_CUDA_CHECK(cudaEventRecord(work->end_event(), stream_.stream()));
  // Rule 4: the caching allocator must not hand these blocks out before the gossip stream is done.
  for (const at::Tensor& t : tensors) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.push_back(work);
  }
  changed_.notify_all();
  return work;
}

void NcclTransport::watchdog_loop() {
  const c10::cuda::CUDAGuard guard(device_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait_for(lock, kWatchdogPeriod, [&] { return stopping_; });
    std::exception_ptr error;
    try {
      while (!in_flight_.empty() && in_flight_.front()->event_done()) {
        in_flight_.front()->release();
        in_flight_.pop_front();
      }
      if (stopping_) {
        // Rounds still in flight at teardown wait for peers that will not come: abort rather
        // than hang in ncclCommDestroy.
        if (!in_flight_.empty()) comm_->abort();
        return;
      }
      const std::string nccl_error = comm_->async_error();
      if (!nccl_error.empty()) {
        error = std::make_exception_ptr(std::runtime_error(detail::str_cat(
            "gossip_ext: rank ", rank_, ": NCCL failed asynchronously: ", nccl_error)));
      } else if (!in_flight_.empty() &&
                 std::chrono::steady_clock::now() - in_flight_.front()->posted() > timeout_) {
        const auto& oldest = in_flight_.front();
        error = std::make_exception_ptr(TimeoutError(detail::str_cat(
            "gossip_ext: rank ", rank_, " timed out after ", timeout_.count(),
            " ms in gossip round ", oldest->round(), " waiting for messages from peers ",
            oldest->recv_peers(), " (nccl transport); the communicator was aborted")));
      }
    } catch (...) {
      error = std::current_exception();  // a CUDA error while querying events
    }
    if (error && !failure_) {
      failure_ = error;
      // Fail the rounds before aborting: the abort completes their end events, and a
      // synchronize() that wakes on one must already find the error.
      for (const auto& work : in_flight_) work->fail(error);
      comm_->abort();
      in_flight_.clear();
    }
    if (stopping_) return;
  }
}

}  // namespace gossip
