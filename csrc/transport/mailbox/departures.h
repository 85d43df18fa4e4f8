// Departures: where the workers of one asynchronous gossip say they are leaving, as keys of a
// c10d store ("left/<rank>", under a prefix of the group's). A worker says so before it lets its
// connections go, and when a peer's failure ends its part, so that a peer that sees a connection
// close can tell a worker that finished, or that gave up on a third, from one that died.
//
// Note [A failure closes more than its pair]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A worker that gives up on a stopped peer raises, and its process usually ends, so its other
// peers see their connections to it close, not the stopped one's silence. (gloo also closes every
// connection of a context when one of its waits runs out; the channels' threads never wait with a
// deadline for that reason: Note [Silence is measured while this worker trains] in mailbox.h.) The
// worker that gave up says here that it leaves, and a peer that sees a connection close looks for
// that word for a moment (kLeaveGrace) before it names the peer as failed: each names the one that
// stopped.
#pragma once

#include <chrono>
#include <optional>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace gossip {

class Departures {
 public:
  static constexpr std::chrono::milliseconds kLeaveGrace{1000};

  // `rank`: this worker's, where it may leave (none: a reader only).
  Departures(c10::intrusive_ptr<c10d::Store> store, std::optional<int> rank,
             std::chrono::milliseconds leave_grace = kLeaveGrace);

  // Says that `rank` leaves. Best effort: a store gone with its host leaves the peers to see a
  // failure instead.
  void announce(int rank) noexcept;
  // This worker leaves (a peer's failure ended its part).
  void leaving() noexcept;
  // Whether `rank` said it left; false where the store cannot be asked.
  bool has_left(int rank) const noexcept;
  // Whether `rank` says it left within the grace (Note [A failure closes more than its pair]).
  bool has_left_soon(int rank) const noexcept;
  std::optional<int> rank() const { return rank_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::optional<int> rank_;
  std::chrono::milliseconds leave_grace_;
};

}  // namespace gossip
