// Liveness over an elastic epoch's own group: whether a member whose heartbeat looks silent in the
// membership store is alive, asked over the group's authenticated connections
// (gossip_ext/gossip/groups.py, prove_pairs), which an outsider at the store cannot answer for.
//
// Note [A silence is confirmed over the group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The store is a bulletin board: an outsider who writes a member's last beat back over it, faster
// than the member beats, makes the member look silent. So before a member is announced gone for
// its silence, a watcher pings it over the epoch's group (kPingTag, a nonce), and a member that
// answers (kPongTag, the same nonce) within the wait is alive: the beats were tampered with, and
// nothing is announced. Every member runs a LivenessResponder while its epoch's group lives: one
// thread with a receive from any rank posted, which answers each ping. Neither side lets a gloo
// wait run out (that closes every connection of the group): the responder waits without a
// deadline and close() aborts it; a ping's wait is aborted at its own deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace gossip {

class LivenessResponder {
 public:
  explicit LivenessResponder(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~LivenessResponder();
  LivenessResponder(const LivenessResponder&) = delete;
  LivenessResponder& operator=(const LivenessResponder&) = delete;

  // Stops answering (aborts the posted receive) and joins the thread. Idempotent.
  void close();

 private:
  void run();

  const c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::mutex mutex_;
  bool closing_ = false;
  c10::intrusive_ptr<c10d::Work> posted_;  // the receive the thread waits in
  std::thread thread_;
};

// Pings `peer` of `group` and waits up to `timeout` for its answer: whether it answered. A
// connection that closed, or a wrong answer, is no answer. Callable from any thread.
bool ping(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int peer,
          std::chrono::milliseconds timeout);

}  // namespace gossip
