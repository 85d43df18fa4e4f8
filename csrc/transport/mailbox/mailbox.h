// The channels that let asynchronous gossip never wait for a peer (docs/design.md section 6): a
// Mailbox per in-peer keeps a receive posted for that peer's next message and queues what
// arrives, and an Outbox per out-peer confirms the sends in order and lets their buffers go. Each
// runs on a thread of its own, over the transport's asynchronous messages (Note [Asynchronous
// messages] in transport/transport.h).
//
// gloo moves a point-to-point message only once its receiver has posted the receive, and it
// completes a send or a receive only inside wait(); a training thread that posts and polls would
// hold every sender up until its next step. These threads post and wait instead, so messages move
// at the network's pace whatever the pace of either worker's steps, and no Python thread (nor the
// interpreter's lock) is involved in moving them.
//
// A peer's messages to this worker are numbered in the order it sent them
// (tags::mailbox_tag), and each carries the sender's round in its header (MessageHeader); the
// Mailbox walks the rounds in which the sender's schedule names this worker, which is the round a
// receiver waits for when a staleness bound says it must. A receive or send that fails (the
// peer's connection closed) is kept as a TimeoutError naming the peer, its round and how it was
// seen, raised to the training thread at its next call; a peer that said it left (Departures)
// ends its channel without an error. A peer that stopped is told by check_silence (Note [Silence
// is measured while this worker trains]).
//
// Note [Silence is measured while this worker trains]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// No asynchronous message is due at any given time: while every worker waits in the user's own
// barrier, evaluates or saves, nobody sends, and that is no failure. So a channel's thread waits
// for its message without a deadline (kMaxTimeout: gloo closes every connection of its context
// when one wait runs out, which broke the user's collectives), and a peer's silence is judged by
// the owner's calls instead: check_silence(), made at each of this worker's steps, raises once the
// channel has waited (a Mailbox for the peer's next message, an Outbox for the peer to take the
// oldest send) for longer than the timeout while this worker kept stepping. A gap between two
// checks longer than the timeout is a pause of this worker's own, and starts the clock again.
//
// Thread-safety: every public member may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "transport/mailbox/departures.h"
#include "transport/transport.h"

namespace gossip {

// The head of every asynchronous message, which gossip_ext/gossip/messages.py writes: the weight
// of the share (float64), the sender's round (int64) and one more float64 of the sender's (an
// outer step's seconds per inner step); the body follows, 8-byte aligned.
struct MessageHeader {
  static constexpr int64_t kWeightOffset = 0;
  static constexpr int64_t kRoundOffset = 8;
  static constexpr int64_t kAuxOffset = 16;
  static constexpr int64_t kBytes = 24;
};

// What a Mailbox and an Outbox share: the peer, the thread, the error that ended it, and the way
// a failure is told from a departure.
class PeerChannel {
 public:
  PeerChannel(const PeerChannel&) = delete;
  PeerChannel& operator=(const PeerChannel&) = delete;
  virtual ~PeerChannel() = default;  // a subclass closes (joins its thread) in its destructor

  int peer() const { return peer_; }
  // The peer said it left: nothing more comes from it or goes to it, and that is no failure.
  bool ended() const;
  // Rethrows the error that ended the channel, if any.
  void raise_if_failed() const;
  // Ends the channel with a TimeoutError saying `why` (this worker gave the peer up), raised to
  // whoever waits on it now or later.
  void fail(const std::string& why, std::optional<int64_t> round);
  // Cancels the operations in flight and joins the thread. Idempotent.
  void close();
  // Called by the owner at each of its steps: raises (and keeps) a TimeoutError naming the peer
  // once the channel has waited for it longer than the timeout while this worker kept stepping
  // (Note [Silence is measured while this worker trains]). Raises the channel's error, if any.
  void check_silence();

 protected:
  PeerChannel(std::shared_ptr<Transport> transport, std::shared_ptr<Departures> departures,
              int peer, int64_t generation, std::chrono::milliseconds timeout);
  // Starts the thread; the last call of a subclass's constructor.
  void start_thread();
  // The thread's loop; returns when closing or when the channel ended.
  virtual void run() = 0;
  // Cancels what the subclass posted, beyond the operation the thread waits in (closing).
  virtual void cancel_posted() {}

  // On the thread: waits for `work`, the message of the peer's (or this worker's) `round`, with
  // no deadline (Note [Silence is measured while this worker trains]). False if the channel is
  // closing or ended; a failure becomes the channel's error.
  bool wait_for_work(const std::shared_ptr<Work>& work, int64_t round, const char* what);
  // After the transport's `failure` to `what` the peer (its connection closed): `ended` if the
  // peer said it was leaving, else throws a TimeoutError naming it and its round (this worker
  // leaves).
  void raise_unless_left(const std::exception& failure, int64_t round, const char* what);
  // Holding `lock`: waits for a change, at most `left` and half a second at a time, to look
  // whether the peer said it left (then `ended`).
  void wait_a_little(std::unique_lock<std::mutex>& lock, std::chrono::nanoseconds left);
  // Holding the lock: rethrows the channel's error, if any.
  void raise_if_failed_locked() const;
  // Holding the lock: since when the channel waits for its peer (none: it waits for nothing),
  // and the peer's round it waits for.
  virtual std::optional<std::chrono::steady_clock::time_point> waiting_since_locked() const = 0;
  virtual int64_t awaited_round_locked() const = 0;
  // What it waits for, in an error: "'s message of its round " (then the round).
  virtual const char* awaited_words() const = 0;
  // This worker gives up waiting for `what_for` of the peer's `round`: it says it leaves (Note [A
  // failure closes more than its pair]) and throws a TimeoutError naming the peer.
  [[noreturn]] void raise_waited(const std::string& what_for, int64_t round) const;

  const std::shared_ptr<Transport> transport_;
  const std::shared_ptr<Departures> departures_;
  const int peer_;
  const int64_t generation_;
  const std::chrono::milliseconds timeout_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool closing_ = false;
  bool ended_ = false;
  std::exception_ptr error_;

 private:
  void run_guarded();

  std::shared_ptr<Work> current_;  // what the thread waits in, for close() to cancel
  // check_silence's clock: its last call, and when this worker's current stretch of steps began.
  std::optional<std::chrono::steady_clock::time_point> last_check_;
  std::chrono::steady_clock::time_point stepping_since_;
  std::mutex join_mutex_;          // close() may come from two threads (a finalizer, the owner)
  std::thread thread_;
};

// Receives one peer's messages of `nbytes` each, from the first round >= `start` in which the
// peer's schedule names this worker. `sends_in_round[r % period]`: whether the peer sends to this
// worker in its round r (the schedule is periodic; at least one entry is true).
// `held_limit`: post the next receive only while fewer arrived messages wait untaken (Note [Flow
// control by absorption] in gossip_ext/gossip/asynchronous.py); a blocking wait lifts it.
class Mailbox final : public PeerChannel {
 public:
  struct Arrived {
    int64_t round;
    at::Tensor message;
  };

  Mailbox(std::shared_ptr<Transport> transport, std::shared_ptr<Departures> departures, int peer,
          int64_t generation, std::chrono::milliseconds timeout, int64_t nbytes,
          std::vector<bool> sends_in_round, int64_t start, std::optional<int64_t> held_limit);
  ~Mailbox() override;

  // The messages that arrived of rounds <= `through` (none: every one), in round order. Raises
  // the channel's error once nothing is left to take.
  std::vector<Arrived> take(std::optional<int64_t> through);
  // When the latest messages (at most kArrivalsKept) arrived, oldest first, in seconds of the
  // steady clock (CLOCK_MONOTONIC: Python's time.monotonic()).
  std::vector<double> arrival_times() const;
  // Blocks until every message of rounds <= `round` has arrived (taken or not), where the sender
  // skips no round (a staleness bound); raises after the timeout.
  void wait_until_past(int64_t round);
  // Blocks until `count` messages in all have arrived (taken or not); raises after the timeout.
  void wait_for(int64_t count);
  // Waits until `count` messages in all have arrived, or the peer left, or `left` passed; whether
  // they arrived. Raises the channel's error.
  bool wait_for_before(int64_t count, std::chrono::nanoseconds left);

  int64_t received() const;
  // The sender's next round that names this worker; none if it never does again.
  std::optional<int64_t> expected() const;

  static constexpr size_t kArrivalsKept = 16;

 private:
  void run() override;
  std::optional<std::chrono::steady_clock::time_point> waiting_since_locked() const override;
  int64_t awaited_round_locked() const override { return expected_.value_or(-1); }
  const char* awaited_words() const override { return "'s message of its round "; }
  bool holds_enough() const;
  std::optional<int64_t> next_round(int64_t start) const;
  // Waits, the held limit lifted, until done() (holding the lock) or the peer left: true; or
  // until `deadline` or closing: false. Raises the channel's error.
  template <typename Done>
  bool wait_lifted(Done done, std::chrono::steady_clock::time_point deadline);
  // wait_lifted to the timeout; raises a TimeoutError naming the peer's awaited round past it.
  template <typename Done>
  void wait_until(Done done);

  const int64_t nbytes_;
  const std::vector<bool> sends_in_round_;
  const std::optional<int64_t> held_limit_;
  bool lifted_ = false;
  int64_t received_ = 0;
  std::optional<int64_t> expected_;
  std::deque<Arrived> arrived_;
  std::deque<double> arrival_times_;
  std::chrono::steady_clock::time_point last_arrival_;  // or the mailbox's opening
};

// Confirms this worker's sends to one peer, in the order they were posted.
class Outbox final : public PeerChannel {
 public:
  Outbox(std::shared_ptr<Transport> transport, std::shared_ptr<Departures> departures, int peer,
         int64_t generation, std::chrono::milliseconds timeout);
  ~Outbox() override;

  // Sends `message` as this worker's round `round`; never blocks. False: the peer has left, and
  // nothing was sent.
  bool post(int64_t round, at::Tensor message);
  // Blocks until every send of rounds <= `round` (none: every send) is confirmed; raises after
  // the timeout.
  void wait_until_past(std::optional<int64_t> round);
  // Sends posted and not yet confirmed.
  int64_t backlog() const;
  int64_t sent() const;

 private:
  struct Posted {
    int64_t round;
    std::shared_ptr<Work> work;
    std::chrono::steady_clock::time_point at;
  };
  void run() override;
  void cancel_posted() override;
  std::optional<std::chrono::steady_clock::time_point> waiting_since_locked() const override;
  int64_t awaited_round_locked() const override;
  const char* awaited_words() const override {
    return " to take this worker's message of round ";
  }

  int64_t sent_ = 0;
  std::deque<Posted> posted_;
};

}  // namespace gossip
