// NCCL transport: point-to-point gossip messages over an own NCCL communicator on an own
// high-priority CUDA stream (CUDA builds only).
//
// Note [Gossip stream ordering]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// 1. exchange() records an event on the caller's current (compute) stream and makes the gossip
//    stream wait on it, so the messages are sent only after the kernels that wrote them (the
//    optimizer step, scale_into) have run. No host synchronisation.
// 2. Every send and receive of the round goes inside one ncclGroupStart/End on the gossip stream,
//    followed by an end event recorded on the gossip stream.
// 3. Work::wait() makes the caller's current stream wait on the end event, so the absorb kernel
//    that reads the received buffers is ordered after the receives. No host synchronisation.
// 4. Every tensor of the round is recorded on the gossip stream with the caching allocator and
//    held by the Work until the end event has completed, so no buffer is reused while NCCL
//    still reads or writes it.
// 5. A watchdog thread owned by the transport checks the end events of rounds in flight (NCCL has
//    no completion callback); a round older than the timeout aborts the communicator, and the
//    next call raises gossip::TimeoutError naming the peers and the round.
//
// Usage:
//   auto transport = std::make_shared<gossip::NcclTransport>(store, rank, world_size, device,
//                                                            std::chrono::minutes(5));
//   auto work = transport->exchange(sends, recvs, round);
//   work->wait(timeout);   // the current stream now waits for the round
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "transport/transport.h"

namespace gossip {

class NcclWork;

// Owns an NCCL communicator: destroyed normally, or aborted after a failure.
class NcclComm {
 public:
  NcclComm(ncclUniqueId id, int rank, int world_size);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  // Aborts outstanding operations, releasing a stream blocked on an absent peer.
  void abort();
  // The communicator's asynchronous error, if any, as a message; empty when healthy.
  std::string async_error() const;

 private:
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborted_{false};
};

class NcclTransport final : public Transport {
 public:
  // Every rank of the gossip group calls this collectively: rank 0 creates the NCCL unique id
  // and publishes it through `store` (use a PrefixStore so that two transports do not collide).
  NcclTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                c10::Device device, std::chrono::milliseconds timeout);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override;
  std::string name() const override { return "nccl"; }

 private:
  void watchdog_loop();
  void throw_if_failed() const;

  const int rank_;
  const int world_size_;
  const c10::Device device_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<NcclComm> comm_;
  c10::cuda::CUDAStream stream_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<NcclWork>> in_flight_;
  std::exception_ptr failure_;  // set once by the watchdog; guarded by mutex_
  bool stopping_ = false;
  std::thread watchdog_;  // last member: started after everything it uses exists
};

}  // namespace gossip
