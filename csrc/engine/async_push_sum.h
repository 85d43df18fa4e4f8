// AsyncPushSum: one worker's asynchronous push-sum (docs/algorithms.md, "Asynchronous gossip"):
// each worker gossips at its own pace, and a slow worker costs its share, never a wait.
//
// Worker i holds its model z_i (the parameters, flattened into the engine's buffers as
// GossipEngine's are) and a weight w_i. After each optimizer step it runs its round t_i, a
// counter of its own (start_round):
//   1. Send. To each out-peer of round t_i (the graph's schedule, a pure function of the round)
//      it posts the share (w_i z_i / (k+1), w_i / (k+1)) as z_i and the share's weight (Note
//      [Scale-free shares]), and keeps one share: w_i <- w_i / (k+1). A lossy message's
//      rounding stays in the kept numerator (MessageCodec's error feedback).
//   2. Bound. If `staleness` tau is set, wait until every message of rounds <= t_i - tau that
//      this worker is owed has arrived, and every message it owes has been taken.
//   3. Absorb every message that has arrived of sender rounds <= t_i + tau:
//        z_i <- (w_i z_i + sum w_m z_m) / (w_i + sum w_m),  w_i <- w_i + sum w_m.
// tau = 0 with equal speeds is synchronous SGP; no tau never waits. finish_round() (before a
// forward) absorbs what arrived and never waits.
//
// Note [Flow control by absorption]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A share in flight is mass its sender no longer holds, and it carries the model of the round it
// left. A peer that receives but does not absorb (it started late, it paused) would collect a
// sender's weight round after round, halving it each time, until the next message to reach the
// sender, however stale (a late starter's untrained model, weight about 1), replaced its trained
// model: measured on 4 workers of 30 steps, 3 runs in 10 ended with a model no better than a
// constant. So without a staleness bound a peer's mailbox holds at most kHeldLimit arrived
// messages before it receives another, and a sender skips a peer with kMaxBacklog sends not yet
// taken, keeping that share: at most two of a sender's messages wait on one peer, one held there
// and one on the link, which keeps a link busy while its receiver steps.
//
// Note [Scale-free shares]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A message carries the sender's de-biased z (not w z) and the weight of its share, and every
// update mixes models with coefficients that are ratios of weights. A worker that hears from
// nobody for many rounds (its peers finished first) halves its weight each round; its weight may
// get as small as float64 allows, and no float32 value is ever scaled by it.
//
// A message that arrives late is absorbed late, never dropped, so the sums of w z and of w over
// all workers and all messages in flight never change: at quiescence (settle) the weights sum to
// the number of workers and the weighted mean of the models is the mean of what they held. The
// parameters hold the de-biased z whenever a caller can see them: a round refused for a NaN or
// an Inf changes nothing (the messages are checked before they are absorbed).
//
// Messages move on the channels' threads (transport/mailbox), never the caller's. A peer silent
// for the timeout while this worker steps (Note [Silence is measured while this worker trains] in
// mailbox.h: a pause of every worker's, in the user's barrier, is none), or whose connection
// closes, fails the engine with a TimeoutError naming it, its round and how it was seen; every
// later call raises the same error.
//
// Thread-safety: an engine is used by one thread at a time; abandon() may come from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "engine/flat_parameters.h"
#include "engine/message_codec.h"
#include "topology/graph.h"
#include "transport/mailbox/departures.h"
#include "transport/mailbox/mailbox.h"
#include "transport/transport.h"

namespace gossip {

struct AsyncOptions {
  GraphOptions graph;
  // tau: absorb sender rounds <= t + tau and wait for those <= t - tau; none: never wait.
  std::optional<int64_t> staleness;
  bool check_finite = true;
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  std::optional<at::ScalarType> message_dtype;
  std::optional<BlockFormat> message_format;
  // Tells this engine's messages from another's on the same ranks (tags::mailbox_tag).
  int64_t generation = 0;
  // Keep every send and absorb in history() (the tests replay it through a reference).
  bool record = false;
};

// What one worker's asynchronous gossip did: the shares its schedule named, those held back by
// flow control (the peer had not taken the last one), those sent, the messages absorbed, and
// their staleness: this worker's round when it absorbed a message less the sender's round in it.
struct AsyncCounts {
  int64_t scheduled = 0;
  int64_t held_back = 0;
  int64_t sent = 0;
  int64_t messages = 0;
  int64_t staleness_sum = 0;
  std::optional<int64_t> staleness_max;  // none: nothing absorbed yet
};

// One entry of the history: a send (this worker's round and the peers sent to) or an absorb
// (each message's sender and round, in the order absorbed).
struct AsyncEvent {
  bool is_send;
  int64_t round;                                    // sends only
  std::vector<std::pair<int, int64_t>> messages;    // sends: (peer, round); absorbs: (sender, round)
};

class AsyncPushSum {
 public:
  static constexpr int64_t kMaxBacklog = 1;
  static constexpr int64_t kHeldLimit = 1;

  // Flattens `params` (flatten_parameters) and opens a channel to every peer of the schedule.
  AsyncPushSum(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
               std::shared_ptr<Transport> transport, std::shared_ptr<Departures> departures,
               AsyncOptions options);
  // Leaves the gossip (abandon) if nothing did before.
  ~AsyncPushSum();
  AsyncPushSum(const AsyncPushSum&) = delete;
  AsyncPushSum& operator=(const AsyncPushSum&) = delete;

  // Sends this worker's round, waits where the bound says, and absorbs what arrived.
  void start_round();
  // Absorbs every message that has arrived within the bound; never waits.
  void finish_round();
  // Messages this worker has sent each rank so far (0 for itself and non-peers).
  std::vector<int64_t> sent_counts() const;
  // Every worker together, each with what every rank sent it (sent_counts() gathered): waits
  // until those messages have arrived and every send is confirmed, then absorbs them all.
  void settle(const std::vector<int64_t>& sent_to_me);
  // Every worker together: puts this worker at `round` with `weight` (a checkpoint's) and opens
  // new channels (a new generation) at the peers' restored `rounds`. Messages that were in flight
  // are not in any checkpoint; the weights then sum to less than the number of workers, which
  // push-sum's de-biasing absorbs.
  void restore(int64_t round, double weight, const std::vector<int64_t>& rounds);
  // Leaves the gossip: says so to the peers (who then neither wait for this worker nor take its
  // silence for a failure), and fails whatever waits here with a TimeoutError saying `why`.
  // Messages in flight to or from this worker are given up: their mass leaves with it, and every
  // model stays de-biased. Idempotent.
  void abandon(const std::string& why);
  void raise_if_failed() const;

  int64_t round() const { return round_; }
  double weight() const { return weight_; }
  int64_t bytes_sent() const { return bytes_sent_; }
  int64_t message_bytes() const { return codec_.nbytes(); }
  int rank() const { return transport_->rank(); }
  int world_size() const { return transport_->world_size(); }
  const std::vector<FlatParameterGroup>& groups() const { return groups_; }
  const Graph& graph() const { return graph_; }
  const AsyncCounts& counts() const { return counts_; }
  const std::vector<AsyncEvent>& history() const { return history_; }

 private:
  void open_channels(const std::vector<int64_t>& rounds);
  // Raises for a peer silent for the timeout while this worker stepped (PeerChannel).
  void check_silences();
  void send_bound_absorb();
  std::vector<int> send(int64_t round, const std::vector<int>& out_peers);
  // Absorbs what arrived of rounds <= `through` (none: everything).
  void absorb(std::optional<int64_t> through);
  [[noreturn]] void raise_nonfinite(const std::vector<int>& senders) const;
  std::vector<at::Tensor> flats() const;
  template <typename Body>
  void guarded(Body body);

  std::vector<FlatParameterGroup> groups_;
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<Departures> departures_;
  AsyncOptions options_;
  Graph graph_;
  MessageCodec codec_;
  double weight_ = 1.0;
  int64_t round_ = 0;  // rounds sent
  int64_t generation_;
  int64_t bytes_sent_ = 0;
  AsyncCounts counts_;
  std::vector<AsyncEvent> history_;
  std::map<int, std::shared_ptr<Outbox>> outboxes_;    // by peer
  std::map<int, std::shared_ptr<Mailbox>> mailboxes_;  // by in-peer
  std::atomic<bool> left_{false};
  std::exception_ptr failure_;
};

}  // namespace gossip
