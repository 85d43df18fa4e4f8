// Ranks of one world as threads of one process, for the suites that run them over the in-process
// transport: one std::thread per rank, the first rank's error rethrown on the caller's thread.
#pragma once

#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace gossip {

// Runs body(rank) for ranks 0..n-1, each on its own thread, and rethrows the lowest failing
// rank's error once every thread has ended. on_failure(rank, what) runs on the failing rank's
// thread as it fails: a suite aborts its hub there, so that no other rank waits for the failed
// one until a timeout.
template <typename Body, typename OnFailure>
void run_ranks(int n, Body body, OnFailure on_failure) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        on_failure(r, std::string("rank ") + std::to_string(r) + " failed: " + e.what());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

template <typename Body>
void run_ranks(int n, Body body) {
  run_ranks(n, body, [](int, const std::string&) {});
}

}  // namespace gossip
