#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/limits.h"
#include "transport/mailbox/mailbox.h"

namespace gossip {
namespace {

constexpr std::chrono::milliseconds kLookForDeparture{500};

std::string duration_words(std::chrono::milliseconds timeout) {
  return detail::str_cat(timeout.count() / 1000.0, " s");
}

}  // namespace

PeerChannel::PeerChannel(std::shared_ptr<Transport> transport,
                         std::shared_ptr<Departures> departures, int peer, int64_t generation,
                         std::chrono::milliseconds timeout)
    : transport_(std::move(transport)),
      departures_(std::move(departures)),
      peer_(peer),
      generation_(generation),
      timeout_(timeout) {
  GOSSIP_CHECK_ARG(transport_, "gossip_ext: a mailbox's transport must not be None");
  GOSSIP_CHECK_ARG(departures_, "gossip_ext: a mailbox's departures must not be None");
  GOSSIP_CHECK_ARG(peer >= 0 && peer < transport_->world_size() && peer != transport_->rank(),
                   "gossip_ext: a mailbox's peer must be another rank in [0, ",
                   transport_->world_size(), "), got ", peer, " on rank ", transport_->rank());
  check_timeout(timeout, "gossip_ext: a mailbox");
}

void PeerChannel::start_thread() {
  thread_ = std::thread([this] { run_guarded(); });
}

bool PeerChannel::ended() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ended_;
}

void PeerChannel::raise_if_failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  raise_if_failed_locked();
}

void PeerChannel::raise_if_failed_locked() const {
  if (error_) std::rethrow_exception(error_);
}

void PeerChannel::fail(const std::string& why, std::optional<int64_t> round) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) {
      error_ = std::make_exception_ptr(TimeoutError(
          detail::str_cat("gossip_ext: rank ", transport_->rank(),
                          " gave up its asynchronous gossip: ", why),
          {{}, round, transport_->name(), std::nullopt}));
    }
  }
  close();
}

void PeerChannel::close() {
  std::shared_ptr<Work> current;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
    current = current_;
  }
  changed_.notify_all();
  if (current) current->cancel();
  cancel_posted();
  std::lock_guard<std::mutex> joining(join_mutex_);
  if (thread_.joinable()) thread_.join();  // a second close finds it joined
}

void PeerChannel::run_guarded() {
  try {
    run();
  } catch (const TimeoutError&) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::current_exception();
  } catch (const std::exception& e) {
    // Anything else (a receive of the wrong size) ends the channel as loudly.
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) {
      error_ = std::make_exception_ptr(TimeoutError(
          detail::str_cat("gossip_ext: asynchronous gossip with peer ", peer_, " failed: ",
                          e.what()),
          {{peer_}, std::nullopt, transport_->name(), std::nullopt}));
    }
  }
  changed_.notify_all();
}

bool PeerChannel::wait_for_work(const std::shared_ptr<Work>& work, int64_t round,
                                const char* what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) {
      work->cancel();
      return false;
    }
    current_ = work;
  }
  try {
    // No deadline: the message is not due at any time (Note [Silence is measured while this
    // worker trains] in mailbox.h); a failure or close() ends the wait.
    work->wait(kMaxTimeout);
  } catch (const TimeoutError& failure) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      current_ = nullptr;
      if (closing_) return false;
    }
    raise_unless_left(failure, round, what);
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = nullptr;
  return !closing_;
}

void PeerChannel::raise_unless_left(const std::exception& failure, int64_t round,
                                    const char* what) {
  if (departures_->has_left_soon(peer_)) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ended_ = true;
    }
    changed_.notify_all();
    return;
  }
  departures_->leaving();
  throw TimeoutError(
      detail::str_cat("gossip_ext: asynchronous gossip failed to ", what, " peer ", peer_,
                      " (its round ", round,
                      "): it saw its connection close, without waiting out a timeout; the peer "
                      "may have died or left the training loop: ",
                      failure.what()),
      {{peer_}, round, transport_->name(), std::nullopt});
}

void PeerChannel::check_silence() {
  const auto now = std::chrono::steady_clock::now();
  int64_t round = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    raise_if_failed_locked();
    // A gap between two checks longer than the timeout is this worker's own pause (the user's
    // barrier, an evaluation): its peers paused with it, so the clock starts again.
    if (!last_check_ || now - *last_check_ > timeout_) stepping_since_ = now;
    last_check_ = now;
    const auto since = waiting_since_locked();
    if (ended_ || !since || now - std::max(*since, stepping_since_) <= timeout_) return;
    round = awaited_round_locked();
  }
  if (departures_->has_left(peer_)) {  // it finished and said so: silent, and no failure
    std::lock_guard<std::mutex> lock(mutex_);
    ended_ = true;
    return;
  }
  try {
    raise_waited(awaited_words(), round);
  } catch (const TimeoutError&) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::current_exception();
    throw;
  }
}

void PeerChannel::wait_a_little(std::unique_lock<std::mutex>& lock,
                                std::chrono::nanoseconds left) {
  changed_.wait_for(lock, std::min<std::chrono::nanoseconds>(left, kLookForDeparture));
  lock.unlock();  // the store is asked without the lock: the thread may need it meanwhile
  const bool left_job = departures_->has_left(peer_);
  lock.lock();
  if (left_job) ended_ = true;
}

void PeerChannel::raise_waited(const std::string& what_for, int64_t round) const {
  departures_->leaving();  // Note [A failure closes more than its pair]
  throw TimeoutError(
      detail::str_cat("gossip_ext: asynchronous gossip waited ", duration_words(timeout_),
                      " for peer ", peer_, what_for, round,
                      "; the peer may have died, stalled or left the training loop"),
      {{peer_}, round, transport_->name(), timeout_});
}

}  // namespace gossip
