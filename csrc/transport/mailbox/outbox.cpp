#include <utility>

#include "common/error.h"
#include "transport/mailbox/mailbox.h"
#include "transport/message_tags.h"

namespace gossip {

Outbox::Outbox(std::shared_ptr<Transport> transport, std::shared_ptr<Departures> departures,
               int peer, int64_t generation, std::chrono::milliseconds timeout)
    : PeerChannel(std::move(transport), std::move(departures), peer, generation, timeout) {
  start_thread();
}

Outbox::~Outbox() { close(); }

bool Outbox::post(int64_t round, at::Tensor message) {
  int64_t sequence = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    raise_if_failed_locked();
    if (ended_) return false;
    TORCH_CHECK(!closing_, "gossip_ext: Outbox.post: the outbox to peer ", peer_, " is closed");
    sequence = sent_;
  }
  std::shared_ptr<Work> work;
  try {
    work = transport_->post_send(peer_, std::move(message),
                                 tags::mailbox_tag(generation_, sequence));
  } catch (const std::exception& failure) {
    // gloo's send throws at once where the peer's connection has closed.
    raise_unless_left(failure, round, "send to");
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    posted_.push_back({round, std::move(work), std::chrono::steady_clock::now()});
    ++sent_;
  }
  changed_.notify_all();
  return true;
}

void Outbox::run() {
  while (true) {
    Posted next;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return closing_ || !posted_.empty(); });
      if (closing_) return;
      next = posted_.front();
    }
    if (!wait_for_work(next.work, next.round, "send to")) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      posted_.pop_front();  // the buffer goes with it
    }
    changed_.notify_all();
  }
}

void Outbox::cancel_posted() {
  // No send of this worker's outlives its gossip.
  std::deque<Posted> posted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    posted = posted_;
  }
  for (const Posted& p : posted) p.work->cancel();
}

void Outbox::wait_until_past(std::optional<int64_t> round) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!posted_.empty() && (!round || posted_.front().round <= *round) && !ended_) {
    raise_if_failed_locked();
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds::zero()) {
      const int64_t round = posted_.front().round;
      lock.unlock();  // raise_waited writes to the store
      raise_waited(awaited_words(), round);
    }
    wait_a_little(lock, left);
  }
  raise_if_failed_locked();
}

std::optional<std::chrono::steady_clock::time_point> Outbox::waiting_since_locked() const {
  if (posted_.empty()) return std::nullopt;
  return posted_.front().at;  // the peer has not taken this send yet
}

int64_t Outbox::awaited_round_locked() const {
  return posted_.empty() ? -1 : posted_.front().round;
}

int64_t Outbox::backlog() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(posted_.size());
}

int64_t Outbox::sent() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sent_;
}

}  // namespace gossip
