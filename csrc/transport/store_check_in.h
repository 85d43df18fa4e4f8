// A check-in through a c10d Store: every rank of a group sets its key under a common prefix and
// waits, at most a timeout, for the others' keys. The NCCL transport checks in before each of its
// blocking calls that need every rank at once (initialising the communicator, connecting peers:
// Note [NCCL communicator calls] in nccl/nccl_transport.h), so that a rank that never comes is a
// TimeoutError naming it rather than a hang inside NCCL. Needs no GPU: tested over a HashStore
// (tests/cpp/store_check_in_test.cpp).
//
// Cross-rank contract: every rank of the group calls it with the same `key`, once per key.
#pragma once

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace gossip {

// Sets `key`/`rank` in `store`, then waits for `key`/r of every r in [0, world_size). Throws
// gossip::TimeoutError naming `what`, the ranks missing and the key after `timeout`.
void store_check_in(c10d::Store& store, const std::string& key, int rank, int world_size,
                    std::chrono::milliseconds timeout, const std::string& what);

}  // namespace gossip
