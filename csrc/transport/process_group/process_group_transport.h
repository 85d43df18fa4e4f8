// Process-group transport: point-to-point messages through a torch c10d ProcessGroup handed in
// from Python (gloo: CPU tensors only).
//
// exchange() posts every receive before any send (gloo matches by (peer, tag) and a send may wait
// for its receive), then returns. c10d's gloo send/recv Work objects report completion only
// through a blocking wait(), so one progress thread, owned by the transport and joined by its
// destructor, waits on them in posting order and marks the round complete; is_completed() then
// never blocks and wait() sleeps on a condition variable. A wait that passes its timeout aborts
// the round's pending c10d Work (which releases the progress thread) and raises
// gossip::TimeoutError naming the peers whose messages are missing and the round.
//
// Tags: message k (in posting order) between two ranks in round t has tag t * 64 + k (mod 2^30),
// so both sides agree without communicating.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "transport/transport.h"

namespace gossip {

class ProcessGroupWork;

class ProcessGroupTransport final : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~ProcessGroupTransport() override;
  ProcessGroupTransport(const ProcessGroupTransport&) = delete;
  ProcessGroupTransport& operator=(const ProcessGroupTransport&) = delete;

  int rank() const override { return group_->getRank(); }
  int world_size() const override { return group_->getSize(); }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override;
  void abandon(const std::string& why) override;
  std::string name() const override;
  // One c10d send or receive each, waited on by the caller's thread, not the progress thread: a
  // mailbox waits for its peer's next message as long as that peer takes (Note [Asynchronous
  // messages] in transport.h).
  std::shared_ptr<Work> post_send(int peer, at::Tensor buffer, int64_t tag) override;
  std::shared_ptr<Work> post_recv(int peer, at::Tensor buffer, int64_t tag) override;

 private:
  void progress_loop();
  std::shared_ptr<Work> post_one(int peer, at::Tensor buffer, int64_t tag, bool is_recv);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::shared_ptr<ProcessGroupWork>> queue_;
  bool stopping_ = false;
  std::thread progress_;  // last member: started after everything it uses exists
};

}  // namespace gossip
