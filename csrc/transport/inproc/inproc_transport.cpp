#include "transport/inproc/inproc_transport.h"

#include <algorithm>

#include "common/error.h"
#include "common/limits.h"

namespace gossip {

InProcHub::InProcHub(int world_size) {
  GOSSIP_CHECK_ARG(world_size >= 1, "InProcHub: world_size must be >= 1, got ", world_size);
  check_world_size_cap(world_size, "InProcHub");  // a mailbox, lock and condition per rank
  for (int r = 0; r < world_size; ++r) mailboxes_.push_back(std::make_unique<Mailbox>());
}

InProcHub::Mailbox& InProcHub::mailbox(int dst) {
  GOSSIP_INTERNAL_ASSERT(dst >= 0 && dst < world_size());
  return *mailboxes_[dst];
}

void InProcHub::throw_if_aborted() const {
  if (aborted_.load(std::memory_order_acquire)) throw std::runtime_error(abort_reason_);
}

void InProcHub::post(int src, int dst, int64_t tag, const at::Tensor& message) {
  at::Tensor copy = message.clone(at::MemoryFormat::Contiguous);
  Mailbox& box = mailbox(dst);
  {
    std::lock_guard<std::mutex> lock(box.mutex);
    box.messages[{src, tag}].push_back(std::move(copy));
  }
  box.arrived.notify_all();
}

bool InProcHub::try_take(int src, int dst, int64_t tag, at::Tensor* out) {
  Mailbox& box = mailbox(dst);
  std::lock_guard<std::mutex> lock(box.mutex);
  throw_if_aborted();
  auto it = box.messages.find({src, tag});
  if (it == box.messages.end()) return false;
  *out = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) box.messages.erase(it);
  return true;
}

bool InProcHub::take_until(int src, int dst, int64_t tag, at::Tensor* out,
                           std::chrono::steady_clock::time_point deadline) {
  Mailbox& box = mailbox(dst);
  std::unique_lock<std::mutex> lock(box.mutex);
  const bool ready = box.arrived.wait_until(lock, deadline, [&] {
    return aborted_.load(std::memory_order_acquire) || box.messages.count({src, tag}) > 0;
  });
  throw_if_aborted();
  if (!ready) return false;
  auto it = box.messages.find({src, tag});
  *out = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) box.messages.erase(it);
  return true;
}

void InProcHub::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (aborted_.load(std::memory_order_relaxed)) return;
    abort_reason_ = reason;
    aborted_.store(true, std::memory_order_release);
  }
  for (auto& box : mailboxes_) {
    // Taking the lock orders the flag before any waiter's predicate check: no lost wake-up.
    std::lock_guard<std::mutex> lock(box->mutex);
    box->arrived.notify_all();
  }
}

namespace {

class InProcWork final : public Work {
 public:
  InProcWork(std::shared_ptr<InProcHub> hub, int rank, int64_t round,
             std::vector<PeerMessage> recvs)
      : hub_(std::move(hub)), rank_(rank), round_(round), pending_(std::move(recvs)) {}

  bool is_completed() override {
    while (!pending_.empty()) {
      at::Tensor message;
      if (!hub_->try_take(pending_.front().peer, rank_, round_, &message)) return false;
      deliver(message);
    }
    return true;
  }

  void wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!pending_.empty()) {
      at::Tensor message;
      if (!hub_->take_until(pending_.front().peer, rank_, round_, &message, deadline)) {
        std::vector<int> missing;  // each peer once, however many messages it owes
        for (const PeerMessage& m : pending_) {
          if (std::find(missing.begin(), missing.end(), m.peer) == missing.end()) {
            missing.push_back(m.peer);
          }
        }
        throw TimeoutError(
            detail::str_cat("gossip_ext: rank ", rank_, " timed out after ", timeout.count(),
                            " ms in gossip round ", round_, " waiting for messages from peers ",
                            missing, " (inproc transport)"),
            {missing, round_, "inproc", timeout});
      }
      deliver(message);
    }
  }

 private:
  void deliver(const at::Tensor& message) {
    const at::Tensor& dst = pending_.front().buffer;
    TORCH_CHECK(message.numel() == dst.numel(), "gossip_ext: rank ", rank_, " received ",
                message.numel(), " elements from peer ", pending_.front().peer, " in round ",
                round_, " but expected ", dst.numel());
    dst.copy_(message);
    pending_.erase(pending_.begin());
  }

  std::shared_ptr<InProcHub> hub_;
  int rank_;
  int64_t round_;
  std::vector<PeerMessage> pending_;  // in posting order
};

// A send already delivered.
class DeliveredWork final : public Work {
 public:
  bool is_completed() override { return true; }
  void wait(std::chrono::milliseconds) override {}
};

// One asynchronous receive. The hub has no way to wake one waiter alone, so cancel() is seen
// within a slice of the wait.
class ReceiveWork final : public Work {
 public:
  static constexpr std::chrono::milliseconds kSlice{20};

  ReceiveWork(std::shared_ptr<InProcHub> hub, int rank, int peer, int64_t tag, at::Tensor buffer)
      : hub_(std::move(hub)), rank_(rank), peer_(peer), tag_(tag), buffer_(std::move(buffer)) {}

  bool is_completed() override { return done_.load(std::memory_order_acquire); }

  void wait(std::chrono::milliseconds timeout) override {
    if (done_.load(std::memory_order_acquire)) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    at::Tensor message;
    while (true) {
      if (cancelled_.load(std::memory_order_acquire)) {
        throw TimeoutError(
            detail::str_cat("gossip_ext: failed to receive from peer ", peer_,
                            ": the operation was cancelled (inproc transport)"),
            {{peer_}, std::nullopt, "inproc", std::nullopt});
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        throw TimeoutError(detail::str_cat("gossip_ext: failed to receive from peer ", peer_,
                                           ": timed out after ", timeout.count(),
                                           " ms (inproc transport)"),
                           {{peer_}, std::nullopt, "inproc", timeout});
      }
      if (hub_->take_until(peer_, rank_, tag_, &message, std::min(deadline, now + kSlice))) break;
    }
    TORCH_CHECK(message.numel() == buffer_.numel(), "gossip_ext: rank ", rank_, " received ",
                message.numel(), " elements from peer ", peer_, " but expected ",
                buffer_.numel());
    buffer_.copy_(message);
    done_.store(true, std::memory_order_release);
  }

  void cancel() override { cancelled_.store(true, std::memory_order_release); }

 private:
  std::shared_ptr<InProcHub> hub_;
  int rank_, peer_;
  int64_t tag_;
  at::Tensor buffer_;
  std::atomic<bool> done_{false}, cancelled_{false};
};

}  // namespace

std::shared_ptr<Work> InProcTransport::post_send(int peer, at::Tensor buffer, int64_t tag) {
  hub_->post(rank_, peer, tag, buffer);
  return std::make_shared<DeliveredWork>();
}

std::shared_ptr<Work> InProcTransport::post_recv(int peer, at::Tensor buffer, int64_t tag) {
  return std::make_shared<ReceiveWork>(hub_, rank_, peer, tag, std::move(buffer));
}

InProcTransport::InProcTransport(std::shared_ptr<InProcHub> hub, int rank)
    : hub_(std::move(hub)), rank_(rank) {
  GOSSIP_CHECK_ARG(hub_ != nullptr, "InProcTransport: hub must be an InProcHub, got None");
  GOSSIP_CHECK_ARG(rank >= 0 && rank < hub_->world_size(), "InProcTransport: rank must be in [0, ",
                   hub_->world_size(), "), got ", rank);
}

std::shared_ptr<Work> InProcTransport::exchange(std::vector<PeerMessage> sends,
                                                std::vector<PeerMessage> recvs, int64_t round) {
  for (const PeerMessage& m : sends) hub_->post(rank_, m.peer, round, m.buffer);
  return std::make_shared<InProcWork>(hub_, rank_, round, std::move(recvs));
}

}  // namespace gossip
