// Bounds on the sizes a user hands in, checked where they enter (the constructors and the
// bindings), each refusal naming the argument and its value.
//
// A world size, a count or a timeout far beyond any real job is a mistake (a byte count or an id
// passed in the wrong place, a timedelta meant as "never"), and left unchecked it costs the user
// a crash or an hour instead of an error: a hub of 10^8 ranks allocates 10^8 mailboxes, a linear
// graph's schedule grows as the square of the world size, and a deadline of now + 10^6 days
// overflows the clock's nanoseconds.
#pragma once

#include <chrono>
#include <cstdint>

#include "common/error.h"

namespace gossip {

// The largest world a graph, a hub or a transport accepts.
constexpr int kMaxWorldSize = 1 << 16;

// The most (rank, phone-book slot) entries a Graph builds: its phone books and its index of
// senders hold one each, and checking the schedule visits each once per round of its period.
// DynamicDirectedLinearGraph at world size 4096 (4095 peers per rank) takes 11 s on one core and
// just fits; every exponential graph fits at kMaxWorldSize.
constexpr int64_t kMaxScheduleEntries = int64_t{1} << 24;

// The longest timeout: 100 years. Waits compute steady_clock::now() + timeout in nanoseconds,
// which overflows past 292 years and then expires at once or never.
constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365 * 100);

// world_size must be at most kMaxWorldSize; `what` names the class or function.
inline void check_world_size_cap(int world_size, const char* what) {
  GOSSIP_CHECK_ARG(world_size <= kMaxWorldSize, what, ": world_size must be <= ", kMaxWorldSize,
                   ", got ", world_size);
}

// A timeout in (0, kMaxTimeout], or in [0, kMaxTimeout] where `may_be_zero` (a wait that only
// polls); `what` names the class or function, `arg` the argument.
inline void check_timeout(std::chrono::milliseconds timeout, const char* what,
                          const char* arg = "timeout", bool may_be_zero = false) {
  GOSSIP_CHECK_ARG(timeout.count() > 0 || (may_be_zero && timeout.count() == 0), what, ": ", arg,
                   may_be_zero ? " must be >= 0" : " must be positive", ", got ", timeout.count(),
                   " ms");
  GOSSIP_CHECK_ARG(timeout <= kMaxTimeout, what, ": ", arg, " must be at most ",
                   kMaxTimeout.count(), " ms (100 years), got ", timeout.count(), " ms");
}

}  // namespace gossip
