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
    work->wait(timeout_);
  } catch (const TimeoutError& failure) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      current_ = nullptr;
      if (closing_) return false;
    }
    raise_unless_left(failure, failure.failure().timeout.has_value(), round, what);
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = nullptr;
  return !closing_;
}

void PeerChannel::raise_unless_left(const std::exception& failure, bool timed_out, int64_t round,
                                    const char* what) {
  if (timed_out) {
    // This worker's own wait ran out: gloo closes its connections now, and the peers that see
    // them close must find it gone (Note [A failure closes more than its pair]).
    departures_->leaving();
  }
  if (departures_->has_left_soon(peer_)) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ended_ = true;
    }
    changed_.notify_all();
    return;
  }
  departures_->leaving();
  // Say how it was seen: a wait that ran out its timeout, or a connection that closed (the peer
  // died or left: seen at once, no timeout waited out).
  const std::string how =
      timed_out ? "did not answer within " + duration_words(timeout_) + "; the peer may have stalled"
                : "saw its connection close, without waiting out a timeout; the peer may have "
                  "died";
  throw TimeoutError(
      detail::str_cat("gossip_ext: asynchronous gossip failed to ", what, " peer ", peer_,
                      " (its round ", round, "): it ", how, " or left the training loop: ",
                      failure.what()),
      {{peer_}, round, transport_->name(),
       timed_out ? std::optional<std::chrono::milliseconds>(timeout_) : std::nullopt});
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
  throw TimeoutError(
      detail::str_cat("gossip_ext: asynchronous gossip waited ", duration_words(timeout_),
                      " for peer ", peer_, what_for, round,
                      "; the peer may have died, stalled or left the training loop"),
      {{peer_}, round, transport_->name(), timeout_});
}

}  // namespace gossip
