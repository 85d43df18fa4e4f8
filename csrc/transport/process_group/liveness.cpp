#include "transport/process_group/liveness.h"

#include <condition_variable>
#include <random>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/limits.h"
#include "transport/message_tags.h"

namespace gossip {
namespace {

constexpr int64_t kNonceValues = 2;  // 16 bytes
// How long an answer may take to leave: the asker waits for it at most its own timeout.
constexpr std::chrono::milliseconds kAnswerWait{30000};

void abort_quietly(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->abort();
  } catch (const std::exception&) {
  }
}

// Waits for `work` up to `timeout` without letting gloo's own deadline run out (Note [A silence
// is confirmed over the group]): a helper thread waits without one, and the work is aborted at
// the deadline. Whether it completed.
bool wait_aborting_at(const c10::intrusive_ptr<c10d::Work>& work,
                      std::chrono::milliseconds timeout) {
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false, ok = false;
  std::thread waiter([&] {
    bool completed = false;
    try {
      completed = work->wait(kMaxTimeout);
    } catch (const std::exception&) {
    }
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
    ok = completed;
    changed.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (!changed.wait_for(lock, timeout, [&] { return done; })) {
      lock.unlock();
      abort_quietly(work);
    }
  }
  waiter.join();
  return ok;
}

}  // namespace

LivenessResponder::LivenessResponder(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  GOSSIP_CHECK_ARG(group_,
                   "LivenessResponder: process_group must be a process group, got None");
  thread_ = std::thread([this] { run(); });
}

LivenessResponder::~LivenessResponder() { close(); }

void LivenessResponder::run() {
  at::Tensor nonce = at::zeros({kNonceValues}, at::kLong);
  while (true) {
    c10::intrusive_ptr<c10d::Work> work;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closing_) return;
      std::vector<at::Tensor> tensors{nonce};
      try {
        work = group_->recvAnysource(tensors, static_cast<int>(tags::kPingTag));
      } catch (const std::exception&) {
        return;  // the group's connections closed: the epoch is over
      }
      posted_ = work;
    }
    bool completed = false;
    try {
      completed = work->wait(kMaxTimeout);
    } catch (const std::exception&) {
      return;
    }
    if (!completed) return;  // aborted: closing
    try {
      std::vector<at::Tensor> answer{nonce.clone()};
      auto sending = group_->send(answer, work->sourceRank(), static_cast<int>(tags::kPongTag));
      wait_aborting_at(sending, kAnswerWait);
    } catch (const std::exception&) {
      // The asker went away meanwhile: its next ping is answered again.
    }
  }
}

void LivenessResponder::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) return;
    closing_ = true;
    if (posted_) abort_quietly(posted_);
  }
  if (thread_.joinable()) thread_.join();
}

bool ping(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int peer,
          std::chrono::milliseconds timeout) {
  GOSSIP_CHECK_ARG(group, "ping: process_group must be a process group, got None");
  GOSSIP_CHECK_ARG(peer >= 0 && peer < group->getSize() && peer != group->getRank(),
                   "ping: peer must be another rank of the group, got ", peer);
  check_timeout(timeout, "ping");
  std::random_device entropy;
  std::mt19937_64 draw((static_cast<uint64_t>(entropy()) << 32) ^ entropy());
  at::Tensor nonce = at::empty({kNonceValues}, at::kLong);
  for (int64_t i = 0; i < kNonceValues; ++i) {
    nonce.data_ptr<int64_t>()[i] = static_cast<int64_t>(draw());
  }
  at::Tensor answer = at::zeros({kNonceValues}, at::kLong);
  try {
    std::vector<at::Tensor> answers{answer}, nonces{nonce};
    auto receiving = group->recv(answers, peer, static_cast<int>(tags::kPongTag));
    auto sending = group->send(nonces, peer, static_cast<int>(tags::kPingTag));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    if (!wait_aborting_at(sending, timeout)) {
      abort_quietly(receiving);
      return false;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (!wait_aborting_at(receiving, std::max(left, std::chrono::milliseconds(1)))) return false;
  } catch (const std::exception&) {
    return false;  // the connection closed: no answer
  }
  return at::equal(answer, nonce);
}

}  // namespace gossip
