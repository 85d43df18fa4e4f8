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
// posting of a round, the watchdog's error query and abort, teardown) with one mutex.
// The communicator is blocking, NCCL's default: a non-blocking one runs every ncclGroupEnd on a
// thread that NCCL creates for it (NCCL 2.23 and later) and leaves its caller to poll for the
// result, a thread and a polling loop per round. A blocking ncclGroupEnd returns once the round is
// enqueued on the gossip stream, without waiting for any peer, unless it must first connect a peer
// (NCCL connects point-to-point peers lazily), which waits for that peer to post too: a peer alive
// but silent would then hold the host, and the mutex, beyond any timeout. So no round connects a
// peer. connect_peers() connects, with a one-byte round, every peer the rank's rounds will use
// (Graph::peers: its in- and out-peers over the whole schedule), called by the engine on every
// rank at the same point: when it is built and when its schedule changes. There the ranks first
// check in through the store, which times out naming the ranks that did not come, and only then
// connect; the constructor initialises the communicator the same way. A round to a peer not
// connected is refused. Posting then holds the mutex only while it enqueues, so the watchdog can
// always take it to abort. (What remains unbounded: a rank that stops between its check-in and
// its connection round, a window of one call.)
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
//   transport->connect_peers(graph.peers(rank));   // on every rank
//   auto work = transport->exchange(sends, recvs, round);
//   work->wait(timeout);   // the round has completed; the current stream is ordered after it
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "transport/round_watchdog.h"
#include "transport/transport.h"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "gossip_ext needs NCCL 2.14 or newer (ncclCommInitRankConfig, ncclCommFinalize)"
#endif

namespace gossip {

// Owns a blocking NCCL communicator (Note [NCCL communicator calls]).
class NcclComm {
 public:
  // Initialises the communicator; every rank of the group must be here (after the check-in).
  NcclComm(ncclUniqueId id, int rank, int world_size);
  // Aborts if still alive (finalize() was not called or failed). Never throws.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Held by whoever calls into the communicator.
  std::mutex& mutex() { return mutex_; }
  ncclComm_t get() const { return comm_; }
  // With mutex() held: false once aborted or finalized, when get() must not be used.
  bool alive_locked() const { return alive_; }
  // Aborts outstanding operations, releasing a stream blocked on an absent peer. Takes mutex().
  void abort();
  // Flushes and destroys the communicator once its rounds have completed (a local wait); aborts
  // instead if that fails. Takes mutex().
  void finalize();
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
  // transport (see gossip_ext/_transport.py); every rank checks in under `key` and waits for the
  // others, at most `timeout` (TimeoutError naming the missing ranks); then each initialises the
  // communicator. No peer is connected yet: see connect_peers().
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
  // Collective: every rank checks in (TimeoutError naming the ranks that did not), then connects
  // the peers in `peers` it has not connected yet with a one-byte round each way. `peers` must be
  // symmetric across the group (q lists r exactly when r lists q), as Graph::peers is. A round may
  // only exchange with connected peers (Note [NCCL communicator calls]).
  void connect_peers(const std::vector<int>& peers) override;
  // NCCL cannot cancel one operation and keep its communicator: the rounds in flight fail and the
  // communicator is aborted, so the transport stays failed and every later call raises the same
  // TimeoutError. The caller (an elastic job whose member went silent) builds a new transport for
  // its next epoch anyway.
  void abandon(const std::string& why) override;

 private:
  // Posts one round on the gossip stream (Note [Gossip stream ordering], rules 1, 2 and 4).
  std::shared_ptr<Work> post(const std::vector<PeerMessage>& sends,
                             const std::vector<PeerMessage>& recvs, int64_t round);

  const int rank_;
  const int world_size_;
  const c10::Device device_;
  const std::chrono::milliseconds timeout_;
  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string key_;
  int connections_ = 0;          // connect_peers() calls so far: names each check-in
  std::vector<bool> connected_;  // connected_[p]: p was connected by connect_peers()
  c10::cuda::CUDAStream stream_;
  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<RoundWatchdog> watchdog_;  // last: its thread uses comm_
};

}  // namespace gossip
