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
// 3. Work::wait() blocks the host until the end event has completed, then checks that the round
//    did not fail, and only then makes the caller's current stream wait on the event. A round
//    the watchdog aborts also completes its event, with partial buffers: an absorb queued behind
//    it unchecked would fold them into the parameters (Note [The parameters are the model] in
//    engine/gossip_engine.h). The host wait is one per round, at the absorb, and costs the
//    launch latency of the kernels that follow, not the round's time: the round itself still
//    runs on the gossip stream beside the compute stream. is_completed() never blocks.
// 4. Every tensor of the round is recorded on the gossip stream with the caching allocator and
//    held by the Work, which lives at least until the end event has completed (the watchdog holds
//    it until then), so no buffer is reused while NCCL still reads or writes it. The watchdog's
//    thread never drops the last reference (RoundWatchdog::release_done()).
// 5. Failure, timeout and teardown are the RoundWatchdog's (transport/round_watchdog.h): a round
//    past its deadline or an asynchronous NCCL error fails every round in flight, then aborts the
//    communicator; the next call raises gossip::TimeoutError naming the peers and the round.
//
// Note [NCCL communicator calls]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// NCCL allows one thread at a time per communicator. NcclComm serialises every call on it (the
// posting of a round, the watchdog's error query and abort, teardown) with one mutex. The
// communicator is non-blocking (config.blocking = 0): NCCL connects a peer lazily inside
// ncclGroupEnd, so a blocking communicator would hang the host, mutex held, on a peer that is
// alive but never answers, beyond any timeout. Non-blocking calls return ncclInProgress at once;
// the caller then polls ncclCommGetAsyncError (the only way NCCL offers) with a short sleep, up
// to a deadline, and aborts the communicator if it passes. So the mutex is never held longer
// than the timeout, and initialisation, posting and finalisation all time out.
//
// Note [Beside the user's NCCL communicators]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A gossip round in flight on the gossip stream can run beside the user's own NCCL collectives
// (an exact average, a node-local all-reduce under nprocs_per_node). NCCL warns that kernels of
// two communicators can deadlock when each waits for a peer whose kernel cannot start; every rank
// here issues the two in the same program order (the schedule and the wrapper's collectives are
// deterministic), and NCCL_LAUNCH_ORDER_IMPLICIT=1 (NCCL 2.26+) makes NCCL keep that host order on
// the device as well. A point-to-point kernel occupies one block per channel, far from a whole
// GPU, so both are normally resident at once.
//
// Usage:
//   auto transport = std::make_shared<gossip::NcclTransport>(store, key, rank, world_size,
//                                                            device, std::chrono::minutes(5));
//   auto work = transport->exchange(sends, recvs, round);
//   work->wait(timeout);   // the round has completed; the current stream is ordered after it
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "transport/round_watchdog.h"
#include "transport/transport.h"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "gossip_ext needs NCCL 2.14 or newer (non-blocking communicators, ncclCommFinalize)"
#endif

namespace gossip {

// Owns a non-blocking NCCL communicator (Note [NCCL communicator calls]).
class NcclComm {
 public:
  using Clock = std::chrono::steady_clock;

  // Initialises the communicator, polled until `timeout`; throws TimeoutError after it.
  NcclComm(ncclUniqueId id, int rank, int world_size, std::chrono::milliseconds timeout);
  // Aborts if still alive (finalize() was not called or failed). Never throws.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Held by whoever calls into the communicator.
  std::mutex& mutex() { return mutex_; }
  ncclComm_t get() const { return comm_; }
  // With mutex() held: false once aborted or finalized, when get() must not be used.
  bool alive_locked() const { return alive_; }
  // With mutex() held: polls the last non-blocking call until it settles. Returns false if
  // `deadline` passed first; throws on an NCCL error.
  bool wait_ready(Clock::time_point deadline);
  // Aborts outstanding operations, releasing a stream blocked on an absent peer. Takes mutex().
  void abort();
  // Flushes and destroys the communicator, polled until `deadline`; aborts instead if it passes.
  // Takes mutex().
  void finalize(Clock::time_point deadline);
  // The communicator's asynchronous error as a message, "" when healthy or busy (another thread
  // holds the communicator: that thread sees the error itself). Takes mutex() if free.
  std::string async_error();

 private:
  void abort_locked();

  std::mutex mutex_;
  ncclComm_t comm_ = nullptr;
  bool alive_ = false;  // guarded by mutex_
};

class NcclTransport final : public Transport {
 public:
  // Every rank of the gossip group calls this collectively: rank 0 creates the NCCL unique id
  // and publishes it in `store` under `key`, which must be unique to this group and this
  // transport (see gossip_ext/_transport.py); the others read it there.
  NcclTransport(c10::intrusive_ptr<c10d::Store> store, const std::string& key, int rank,
                int world_size, c10::Device device, std::chrono::milliseconds timeout);
  // Waits for the rounds in flight (at most the timeout), then finalizes the communicator, or
  // aborts it if a round failed or did not finish.
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override;
  std::string name() const override { return "nccl"; }

 private:
  const int rank_;
  const int world_size_;
  const c10::Device device_;
  const std::chrono::milliseconds timeout_;
  c10::cuda::CUDAStream stream_;
  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<RoundWatchdog> watchdog_;  // last: its thread uses comm_
};

}  // namespace gossip
