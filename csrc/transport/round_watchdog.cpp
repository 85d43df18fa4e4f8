#include "transport/round_watchdog.h"

#include <algorithm>
#include <stdexcept>

#include "common/error.h"

namespace gossip {

// Each peer once: a transport posts a receive per message, and a peer that sends several must
// not be named several times in an error.
WatchedRound::WatchedRound(int64_t round, std::vector<int> recv_peers)
    : round_(round), recv_peers_(detail::each_once(recv_peers)) {}

void WatchedRound::throw_if_failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
}

void WatchedRound::fail(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_) failure_ = std::move(error);
}

RoundWatchdog::RoundWatchdog(Options options, std::function<std::string()> async_error,
                             std::function<void()> abort)
    : options_(std::move(options)),
      async_error_(std::move(async_error)),
      abort_(std::move(abort)) {
  GOSSIP_CHECK_ARG(options_.timeout.count() > 0, "gossip_ext: timeout must be positive, got ",
                   options_.timeout.count(), " ms");
  GOSSIP_CHECK_ARG(options_.period.count() > 0, "gossip_ext: watchdog period must be positive, got ",
                   options_.period.count(), " ms");
  thread_ = std::thread([this] { loop(); });
}

RoundWatchdog::~RoundWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void RoundWatchdog::watch(std::shared_ptr<WatchedRound> round) {
  GOSSIP_INTERNAL_ASSERT(round != nullptr);
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
  round->deadline_ = WatchedRound::Clock::now() + options_.timeout;
  rounds_.push_back(std::move(round));
}

void RoundWatchdog::tighten_deadline(WatchedRound& round,
                                     WatchedRound::Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  round.deadline_ = std::min(round.deadline_, deadline);
}

void RoundWatchdog::fail(std::exception_ptr error) {
  std::unique_lock<std::mutex> lock(mutex_);
  fail_locked(std::move(error), lock);
}

void RoundWatchdog::throw_if_failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
}

bool RoundWatchdog::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_ != nullptr;
}

bool RoundWatchdog::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  // Settled: every round done, or the transport failed and its abort has returned.
  const bool settled = changed_.wait_for(lock, options_.timeout, [&] {
    return failure_ != nullptr ? !aborting_ : rounds_.empty();
  });
  return settled && failure_ == nullptr;
}

void RoundWatchdog::release_done() {
  std::vector<std::shared_ptr<WatchedRound>> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done.swap(done_);
  }
  // The rounds die here, on the caller's thread, with no lock of the watchdog held.
}

void RoundWatchdog::loop() {
  if (options_.prepare_thread) {
    try {
      options_.prepare_thread();
    } catch (...) {
      std::unique_lock<std::mutex> lock(mutex_);
      fail_locked(std::current_exception(), lock);
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    changed_.wait_for(lock, options_.period, [&] { return stopping_; });
    if (stopping_) return;
    check(lock);
  }
}

void RoundWatchdog::check(std::unique_lock<std::mutex>& lock) {
  if (failure_) return;
  std::exception_ptr error;
  std::vector<std::shared_ptr<WatchedRound>> done;
  try {
    // Rounds complete in posting order (one stream), so the first unfinished one ends the scan.
    while (!rounds_.empty() && rounds_.front()->poll_done()) {
      done.push_back(std::move(rounds_.front()));
      rounds_.pop_front();
    }
  } catch (...) {
    error = std::current_exception();  // e.g. a CUDA error while querying an event
  }
  if (!done.empty()) {
    lock.unlock();
    for (const auto& round : done) round->on_done();
    lock.lock();
    for (auto& round : done) done_.push_back(std::move(round));  // see release_done()
    changed_.notify_all();  // drain() may be waiting
  }
  if (!error && async_error_) {
    lock.unlock();
    const std::string message = async_error_();
    lock.lock();
    if (!message.empty()) {
      error = std::make_exception_ptr(std::runtime_error(detail::str_cat(
          "gossip_ext: rank ", options_.rank, ": ", options_.transport,
          " failed asynchronously: ", message)));
    }
  }
  if (!error) {
    const auto now = WatchedRound::Clock::now();
    for (const auto& round : rounds_) {
      if (now < round->deadline_) continue;
      error = std::make_exception_ptr(TimeoutError(
          detail::str_cat("gossip_ext: rank ", options_.rank, " timed out after ",
                          options_.timeout.count(), " ms in gossip round ", round->round(),
                          " waiting for messages from peers ", round->recv_peers(), " (",
                          options_.transport, " transport); the ", options_.transport,
                          " communicator was aborted"),
          {round->recv_peers(), round->round(), options_.transport, options_.timeout}));
      break;
    }
  }
  if (error) fail_locked(error, lock);
}

void RoundWatchdog::fail_locked(std::exception_ptr error, std::unique_lock<std::mutex>& lock) {
  if (failure_) return;
  failure_ = error;
  aborting_ = true;
  std::deque<std::shared_ptr<WatchedRound>> failed;
  failed.swap(rounds_);
  lock.unlock();
  // Fail first, abort second: the abort completes the rounds' device work, and whoever wakes on
  // it must find the error already set.
  for (const auto& round : failed) round->fail(error);
  if (abort_) abort_();
  lock.lock();
  for (auto& round : failed) done_.push_back(std::move(round));  // see release_done()
  aborting_ = false;
  changed_.notify_all();
}

}  // namespace gossip
