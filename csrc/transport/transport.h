// The Transport interface: how one rank exchanges one gossip round's messages with its peers.
//
// A round is posted in one call (exchange), so a transport can batch it: NCCL puts every send and
// receive inside one ncclGroupStart/End, gloo posts all receives before the sends. exchange()
// returns at once with a Work; the receive buffers are valid after the Work completes, and the
// send buffers must stay untouched until then (the Work keeps every tensor alive).
//
// Messages between two ranks with the same tag are delivered in the order they were posted.
//
// Implementations, one per translation unit, chosen by the build:
//   inproc/         N ranks as threads of one process (tests, large simulations)
//   process_group/  a torch c10d ProcessGroup handed in from Python (gloo, CPU tensors)
//   nccl/           an own NCCL communicator on an own CUDA stream (CUDA builds only)
// The first two also carry asynchronous messages (post_send/post_recv), which the mailboxes of
// asynchronous gossip move on threads of their own (mailbox/).
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/error.h"

namespace gossip {

struct PeerMessage {
  int peer;
  at::Tensor buffer;
};

// One posted round. Modelled on c10d::Work: wait() blocks until completion or throws;
// is_completed() never blocks.
class Work {
 public:
  virtual ~Work() = default;
  // True once every message has arrived (or the work failed). Never blocks.
  virtual bool is_completed() = 0;
  // Makes the received buffers safe to read for the caller, or throws the transport's error
  // (gossip::TimeoutError naming the missing peers and the round after `timeout`). CPU transports
  // block until every message has arrived; the NCCL transport instead makes the caller's current
  // CUDA stream wait for the round (Note [Gossip stream ordering]) and enforces the timeout from
  // its watchdog.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // Blocks the host until the round has completed, at most `timeout` (bounded by the transport's
  // own timeout where the wait is on a device), and throws if it failed. Host transports are done
  // once wait() returns; the NCCL transport waits for the round's end event and then checks that
  // the watchdog did not abort it.
  virtual void synchronize(std::chrono::milliseconds timeout) { wait(timeout); }
  // Fails the work and releases whoever waits on it: a mailbox's thread that lets its peer go
  // (transport/mailbox). A round is released by Transport::abandon instead, so a round's work
  // needs nothing here.
  virtual void cancel() {}
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Sends every `sends[i].buffer` to `sends[i].peer` and receives into every `recvs[j].buffer`
  // from `recvs[j].peer`. `round` names the round in tags and error messages.
  virtual std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends,
                                         std::vector<PeerMessage> recvs, int64_t round) = 0;
  // Every rank of the group calls this together, with every peer its rounds may use from now on
  // (the schedule's Graph::peers), before those rounds: when the engine is built and when its
  // schedule changes. A transport whose peers connect on first use needs nothing; NCCL connects
  // them here, since a round that connects can wait for a peer beyond any timeout (Note [NCCL
  // communicator calls] in nccl/nccl_transport.h).
  virtual void connect_peers(const std::vector<int>& peers) { (void)peers; }
  // Fails every round in flight with a gossip::TimeoutError that says `why`, and releases whatever
  // waits on them: the caller learned that a peer is gone (an elastic job's membership saw its
  // heartbeat stop) and will not wait out the timeout for it. Callable from any thread. A
  // transport whose backend cannot cancel single operations (NCCL) fails for good instead: its
  // later rounds raise the same error. One that cannot tell its rounds apart from their peers'
  // does nothing: its rounds then end at the timeout, as before.
  virtual void abandon(const std::string& why) { (void)why; }
  virtual std::string name() const = 0;

  // Note [Asynchronous messages]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // One message to or from one peer outside any round, under a tag
  // the caller takes from tags::mailbox_tag (a sender may skip a round's message to a peer, so
  // messages are numbered per pair, not named by round). The Work is the message's own: it
  // completes independently of every other one, its wait() blocks the calling thread (a mailbox's
  // own, transport/mailbox) until the message has moved or `timeout` passed, throwing a
  // TimeoutError that names the peer, and cancel() releases that wait. The buffer must stay
  // untouched until the Work completes. A transport that cannot carry them throws ValueError.
  // The channels wait with kMaxTimeout: no such message is due at any time, and a deadline that
  // runs out in gloo closes every connection of the group (Note [Silence is measured while this
  // worker trains] in mailbox/mailbox.h). They run on a process group of their own, so that the
  // user's collectives never share a connection with them (gossip_ext/gossip/groups.py).
  virtual std::shared_ptr<Work> post_send(int peer, at::Tensor buffer, int64_t tag) {
    (void)peer, (void)buffer, (void)tag;
    throw ValueError("gossip_ext: the " + name() + " transport carries no asynchronous messages");
  }
  virtual std::shared_ptr<Work> post_recv(int peer, at::Tensor buffer, int64_t tag) {
    (void)peer, (void)buffer, (void)tag;
    throw ValueError("gossip_ext: the " + name() + " transport carries no asynchronous messages");
  }
};

}  // namespace gossip
