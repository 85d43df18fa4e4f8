#include <cstring>
#include <utility>

#include <ATen/ATen.h>

#include "common/error.h"
#include "transport/mailbox/mailbox.h"
#include "transport/message_tags.h"

namespace gossip {
namespace {

// A message of a trillion parameters in float32, with room: more is a size passed by mistake.
constexpr int64_t kMaxMessageBytes = int64_t{1} << 42;

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Mailbox::Mailbox(std::shared_ptr<Transport> transport, std::shared_ptr<Departures> departures,
                 int peer, int64_t generation, std::chrono::milliseconds timeout, int64_t nbytes,
                 std::vector<bool> sends_in_round, int64_t start,
                 std::optional<int64_t> held_limit)
    : PeerChannel(std::move(transport), std::move(departures), peer, generation, timeout),
      nbytes_(nbytes),
      sends_in_round_(std::move(sends_in_round)),
      held_limit_(held_limit) {
  GOSSIP_CHECK_ARG(nbytes >= MessageHeader::kBytes, "gossip_ext: Mailbox: nbytes must hold the ",
                   MessageHeader::kBytes, "-byte header, got ", nbytes);
  GOSSIP_CHECK_ARG(nbytes <= kMaxMessageBytes, "gossip_ext: Mailbox: nbytes must be at most ",
                   kMaxMessageBytes, ", got ", nbytes);
  GOSSIP_CHECK_ARG(std::find(sends_in_round_.begin(), sends_in_round_.end(), true) !=
                       sends_in_round_.end(),
                   "gossip_ext: Mailbox: peer ", peer,
                   " never sends to this worker (sends_in_round has no true entry)");
  GOSSIP_CHECK_ARG(start >= 0, "gossip_ext: Mailbox: start must be >= 0, got ", start);
  GOSSIP_CHECK_ARG(!held_limit || *held_limit >= 1,
                   "gossip_ext: Mailbox: held_limit must be >= 1 or None, got ",
                   held_limit.value_or(0));
  expected_ = next_round(start);
  last_arrival_ = std::chrono::steady_clock::now();
  start_thread();
}

Mailbox::~Mailbox() { close(); }

std::optional<int64_t> Mailbox::next_round(int64_t start) const {
  const auto period = static_cast<int64_t>(sends_in_round_.size());
  for (int64_t round = start; round < start + period; ++round) {
    if (sends_in_round_[round % period]) return round;
  }
  return std::nullopt;
}

std::optional<std::chrono::steady_clock::time_point> Mailbox::waiting_since_locked() const {
  // A mailbox that holds its limit receives nothing more until this worker takes what it holds.
  if (!expected_ || holds_enough()) return std::nullopt;
  return last_arrival_;
}

bool Mailbox::holds_enough() const {
  return held_limit_ && !lifted_ && static_cast<int64_t>(arrived_.size()) >= *held_limit_;
}

void Mailbox::run() {
  while (true) {
    int64_t expected = 0;
    int64_t sequence = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return closing_ || !holds_enough(); });
      if (closing_) return;
      expected = expected_.value_or(-1);
      sequence = received_;
    }
    at::Tensor buffer = at::empty({nbytes_}, at::kByte);
    std::shared_ptr<Work> work;
    try {
      work = transport_->post_recv(peer_, buffer, tags::mailbox_tag(generation_, sequence));
    } catch (const std::exception& failure) {
      // A connection already closed fails the receive as it is posted, not in its wait.
      raise_unless_left(failure, expected, "receive from");
      return;
    }
    if (!wait_for_work(work, expected, "receive from")) return;
    int64_t round = 0;
    std::memcpy(&round, buffer.data_ptr<uint8_t>() + MessageHeader::kRoundOffset, sizeof(round));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const double now = steady_seconds();
      arrived_.push_back({round, std::move(buffer)});
      arrival_times_.push_back(now);
      last_arrival_ = std::chrono::steady_clock::now();
      if (arrival_times_.size() > kArrivalsKept) arrival_times_.pop_front();
      ++received_;
      expected_ = next_round(round + 1);
    }
    changed_.notify_all();
  }
}

std::vector<Mailbox::Arrived> Mailbox::take(std::optional<int64_t> through) {
  std::vector<Arrived> taken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!arrived_.empty() && (!through || arrived_.front().round <= *through)) {
      taken.push_back(std::move(arrived_.front()));
      arrived_.pop_front();
    }
    if (taken.empty() && arrived_.empty()) raise_if_failed_locked();
  }
  if (!taken.empty()) changed_.notify_all();  // room for the next receive
  return taken;
}

std::vector<double> Mailbox::arrival_times() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {arrival_times_.begin(), arrival_times_.end()};
}

int64_t Mailbox::received() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return received_;
}

std::optional<int64_t> Mailbox::expected() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return expected_;
}

template <typename Done>
bool Mailbox::wait_lifted(Done done, std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  // A wait must not wait on its own untaken messages: receive past held_limit meanwhile.
  lifted_ = true;
  changed_.notify_all();
  struct Restore {
    bool& lifted;
    ~Restore() { lifted = false; }
  } restore{lifted_};
  while (!done() && !ended_) {
    raise_if_failed_locked();
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds::zero() || closing_) return false;
    wait_a_little(lock, left);
  }
  return true;
}

template <typename Done>
void Mailbox::wait_until(Done done) {
  if (!wait_lifted(done, std::chrono::steady_clock::now() + timeout_)) {
    int64_t round = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      round = awaited_round_locked();
    }
    raise_waited(awaited_words(), round);  // it writes to the store: not under the lock
  }
}

void Mailbox::wait_until_past(int64_t round) {
  wait_until([&] { return !expected_ || *expected_ > round; });
}

void Mailbox::wait_for(int64_t count) {
  wait_until([&] { return received_ >= count; });
}

bool Mailbox::wait_for_before(int64_t count, std::chrono::nanoseconds left) {
  wait_lifted([&] { return received_ >= count; }, std::chrono::steady_clock::now() + left);
  std::lock_guard<std::mutex> lock(mutex_);
  return received_ >= count;
}

}  // namespace gossip
