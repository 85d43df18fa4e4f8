// RoundWatchdog: the failure, timeout and teardown state machine of a transport whose rounds
// complete on a device, where no call blocks until a round is done (NCCL). It needs no GPU, so it
// is tested in C++ over the in-process transport (tests/cpp/round_watchdog_test.cpp).
//
// A transport hands every posted round to watch(). A thread owned by the watchdog then, every
// `period`:
//   - retires rounds that completed (WatchedRound::poll_done(), in posting order: one stream);
//   - asks the backend for an asynchronous error (the `async_error` hook);
//   - fails the transport when a round passed its deadline (posting time + timeout, or sooner if
//     a caller's wait() asked for less) or the backend reported an error.
// Failing is sticky and ordered: every round in flight is failed first, then the backend is
// aborted (the `abort` hook), with no lock of the watchdog held, so that whoever wakes up because
// the abort completed a round's device work already finds the round's error. Later calls raise
// the same error (throw_if_failed()).
// The thread never destroys a round: completed rounds wait for release_done() on a caller's thread.
// Teardown: drain() waits for the rounds in flight, at most the timeout, so that a rank that
// finishes first does not abort while its peers still receive from it; the transport then
// finalizes its backend normally, or aborts it if drain() gave up.
//
// Usage (see NcclTransport):
//   RoundWatchdog watchdog({rank, "nccl", timeout}, [&] { return comm.async_error(); },
//                          [&] { comm.abort(); });
//   watchdog.watch(round);          // after posting
//   ...
//   if (!watchdog.drain()) comm.abort(); else comm.finalize();
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace gossip {

class RoundWatchdog;

// One posted round, as a RoundWatchdog sees it. A transport's Work derives from it.
class WatchedRound {
 public:
  using Clock = std::chrono::steady_clock;

  WatchedRound(int64_t round, std::vector<int> recv_peers);
  virtual ~WatchedRound() = default;
  WatchedRound(const WatchedRound&) = delete;
  WatchedRound& operator=(const WatchedRound&) = delete;

  // Whether the round's work has completed. Never blocks; called on the watchdog's thread.
  virtual bool poll_done() = 0;
  // Called on the watchdog's thread once poll_done() returned true: release the round's buffers.
  virtual void on_done() {}

  // Rethrows the round's failure, if it failed.
  void throw_if_failed() const;
  int64_t round() const { return round_; }
  // The peers the round receives from, each once (however many messages it sends).
  const std::vector<int>& recv_peers() const { return recv_peers_; }

 private:
  friend class RoundWatchdog;
  void fail(std::exception_ptr error);

  const int64_t round_;
  const std::vector<int> recv_peers_;
  mutable std::mutex mutex_;
  std::exception_ptr failure_;
  Clock::time_point deadline_;  // guarded by the watchdog's mutex
};

class RoundWatchdog {
 public:
  struct Options {
    int rank = 0;
    std::string transport;  // named in error messages
    std::chrono::milliseconds timeout{std::chrono::minutes(5)};
    // How often the thread looks at the rounds: the backend offers no completion callback (as
    // for c10d's ProcessGroupNCCL watchdog, a thread queries events).
    std::chrono::milliseconds period{100};
    // Runs first on the watchdog's thread, before any hook. A CUDA backend makes its device
    // current there (the runtime would otherwise create a context on device 0, for every rank of
    // a node) and relaxes the thread's stream-capture mode (so that its event queries never
    // invalidate a CUDA graph the user captures meanwhile). Throwing fails the watchdog.
    std::function<void()> prepare_thread;
  };

  // `async_error` returns the backend's asynchronous error, or "" while healthy. `abort` aborts
  // the backend, releasing whatever waits on it; it is called at most once, never under a lock
  // of the watchdog. Both may be empty.
  RoundWatchdog(Options options, std::function<std::string()> async_error,
                std::function<void()> abort);
  // Stops the thread. Neither drains nor aborts: the transport calls drain() first.
  ~RoundWatchdog();
  RoundWatchdog(const RoundWatchdog&) = delete;
  RoundWatchdog& operator=(const RoundWatchdog&) = delete;

  // Watches a posted round; its deadline is now + timeout. Throws the failure if failed.
  void watch(std::shared_ptr<WatchedRound> round);
  // Moves `round`'s deadline earlier to `deadline` (a caller's wait(timeout)); never later.
  void tighten_deadline(WatchedRound& round, WatchedRound::Clock::time_point deadline);
  // Fails every round in flight with `error` and aborts the backend (a failure the transport saw
  // itself, e.g. posting timed out). The first failure wins.
  void fail(std::exception_ptr error);
  void throw_if_failed() const;
  bool failed() const;
  // Waits until every watched round has completed, at most the timeout. Returns true if they
  // all did; false if a round failed or the timeout passed (the backend must then be aborted).
  bool drain();
  // Destroys, on the calling thread, the rounds the watchdog's thread found done. That thread
  // never drops the last reference to a round: releasing a round's buffers may need what the
  // caller holds (the GIL, for a tensor that has a Python object), so the transport calls this
  // from its own calls (exchange) and the rest goes with the watchdog's destructor.
  void release_done();
  std::chrono::milliseconds timeout() const { return options_.timeout; }

 private:
  void loop();
  // One look at the rounds, with `lock` held on entry and on return.
  void check(std::unique_lock<std::mutex>& lock);
  void fail_locked(std::exception_ptr error, std::unique_lock<std::mutex>& lock);

  const Options options_;
  const std::function<std::string()> async_error_;
  const std::function<void()> abort_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<WatchedRound>> rounds_;  // in posting order
  std::vector<std::shared_ptr<WatchedRound>> done_;   // completed, for release_done()
  std::exception_ptr failure_;
  bool aborting_ = false;  // between failing and the abort hook's return
  bool stopping_ = false;
  std::thread thread_;  // last member: started after everything it uses exists
};

}  // namespace gossip
