#include "transport/process_group/process_group_transport.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "common/error.h"
#include "transport/message_tags.h"

namespace gossip {
namespace {

constexpr int64_t kMaxMessagesPerPeer = 64;
// Round tags wrap inside the rounds' range of the tag registry: the Python layer's own messages on
// the same group take the ranges above it, and must never be matched to a round's.
constexpr int64_t kRoundTagMask = tags::kRoundSpan - 1;
static_assert((tags::kRoundSpan & kRoundTagMask) == 0, "the rounds' span is a power of two");

// Aborting is best effort: the work may have completed or failed meanwhile.
void abort_quietly(c10d::Work& work) {
  try {
    work.abort();
  } catch (const std::exception&) {
  }
}

// One asynchronous message (Note [Asynchronous messages] in transport.h): its c10d Work, waited on
// by the thread that calls wait().
class PointToPointWork final : public Work {
 public:
  PointToPointWork(c10::intrusive_ptr<c10d::Work> work, at::Tensor buffer, int peer,
                   std::string transport, bool is_recv)
      : work_(std::move(work)),
        buffer_(std::move(buffer)),
        peer_(peer),
        transport_(std::move(transport)),
        is_recv_(is_recv) {}

  bool is_completed() override { return work_->isCompleted(); }

  void wait(std::chrono::milliseconds timeout) override {
    const auto started = std::chrono::steady_clock::now();
    std::string why;
    try {
      // c10d reports an aborted Work by returning false.
      if (work_->wait(timeout)) return;
      why = "the operation was cancelled";
    } catch (const std::exception& e) {
      why = e.what();
    }
    // gloo says a wait ran out by its message; the time taken says it whatever the wording.
    const bool timed_out = why.find("Timed out") != std::string::npos ||
                           std::chrono::steady_clock::now() - started >= timeout;
    throw TimeoutError(
        detail::str_cat("gossip_ext: failed to ", is_recv_ ? "receive from" : "send to", " peer ",
                        peer_, ": ", why),
        {{peer_}, std::nullopt, transport_,
         timed_out ? std::optional<std::chrono::milliseconds>(timeout) : std::nullopt});
  }

  void cancel() override { abort_quietly(*work_); }

 private:
  const c10::intrusive_ptr<c10d::Work> work_;
  const at::Tensor buffer_;  // kept alive until the message has moved
  const int peer_;
  const std::string transport_;
  const bool is_recv_;
};

}  // namespace

// One posted round: its c10d Work objects in posting order (receives first) and their progress.
class ProcessGroupWork final : public Work {
 public:
  struct Entry {
    int peer;
    bool is_recv;
    c10::intrusive_ptr<c10d::Work> work;
  };

  ProcessGroupWork(int rank, std::string transport, int64_t round, std::vector<Entry> entries,
                   std::vector<at::Tensor> keep_alive)
      : rank_(rank),
        transport_(std::move(transport)),
        round_(round),
        entries_(std::move(entries)),
        keep_alive_(std::move(keep_alive)) {}

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return finished_;
  }

  void wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return finished_; })) {
      std::vector<int> missing = pending_peers_locked(/*receives=*/true);
      std::vector<int> unsent = pending_peers_locked(/*receives=*/false);
      lock.unlock();
      abort_pending();
      // The peers: those it waits for, then those its unconfirmed sends go to.
      std::vector<int> peers = missing;
      peers.insert(peers.end(), unsent.begin(), unsent.end());
      throw TimeoutError(
          detail::str_cat(
              "gossip_ext: rank ", rank_, " timed out after ", timeout.count(),
              " ms in gossip round ", round_, " waiting for messages from peers ", missing,
              unsent.empty() ? "" : detail::str_cat(" (sends to peers ", unsent, " not confirmed)"),
              ". A peer may have died, stalled or left the training loop."),
          {std::move(peers), round_, transport_, timeout});
    }
    if (error_) std::rethrow_exception(error_);
  }

  // Runs on the progress thread.
  void progress() {
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& entry = entries_[i];
      try {
        // c10d reports an aborted Work by returning false.
        if (!entry.work->wait()) throw std::runtime_error("the operation was aborted");
      } catch (const std::exception& e) {
        // Most often the peer died and gloo saw its connection close. The user's contract is
        // the same as for a silent peer, so it is the same error type: TimeoutError, at once.
        finish(std::make_exception_ptr(TimeoutError(
            detail::str_cat("gossip_ext: rank ", rank_, " failed to ",
                            entry.is_recv ? "receive from" : "send to", " peer ", entry.peer,
                            " in gossip round ", round_,
                            "; the peer may have died or left the training loop: ", e.what()),
            {{entry.peer}, round_, transport_, std::nullopt})));
        return;
      }
      std::lock_guard<std::mutex> lock(mutex_);
      completed_ = i + 1;
    }
    finish(nullptr);
  }

  // Fails the round with `why` (unless it finished) and releases its progress thread.
  void abandon(const std::string& why) {
    finish(std::make_exception_ptr(TimeoutError(
        detail::str_cat("gossip_ext: rank ", rank_, " gave up gossip round ", round_, ": ", why),
        {{}, round_, transport_, std::nullopt})));
    abort_pending();
  }

  // Releases a progress thread blocked on this round (timeout or shutdown).
  void abort_pending() {
    size_t first;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      first = completed_;
    }
    for (size_t i = first; i < entries_.size(); ++i) abort_quietly(*entries_[i].work);
  }

 private:
  // The first outcome stands: an abandoned round's progress thread, released by the abort,
  // finishes it again with the abort's error.
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      error_ = std::move(error);
      finished_ = true;
      keep_alive_.clear();
    }
    changed_.notify_all();
  }

  std::vector<int> pending_peers_locked(bool receives) const {
    std::vector<int> peers;
    for (size_t i = completed_; i < entries_.size(); ++i) {
      if (entries_[i].is_recv == receives &&
          std::find(peers.begin(), peers.end(), entries_[i].peer) == peers.end()) {
        peers.push_back(entries_[i].peer);
      }
    }
    return peers;
  }

  const int rank_;
  const std::string transport_;  // named in the errors' data
  const int64_t round_;
  const std::vector<Entry> entries_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<at::Tensor> keep_alive_;  // every buffer of the round, until it completes
  size_t completed_ = 0;
  bool finished_ = false;
  std::exception_ptr error_;
};

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  GOSSIP_CHECK_ARG(group_, "gossip_ext: process_group must not be None");
  progress_ = std::thread([this] { progress_loop(); });
}

ProcessGroupTransport::~ProcessGroupTransport() {
  std::deque<std::shared_ptr<ProcessGroupWork>> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    pending = queue_;
  }
  for (const auto& work : pending) work->abort_pending();
  queued_.notify_all();
  progress_.join();
}

void ProcessGroupTransport::abandon(const std::string& why) {
  std::deque<std::shared_ptr<ProcessGroupWork>> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending = queue_;
  }
  for (const auto& work : pending) work->abandon(why);
}

std::string ProcessGroupTransport::name() const {
  return "process_group(" + group_->getBackendName() + ")";
}

std::shared_ptr<Work> ProcessGroupTransport::exchange(std::vector<PeerMessage> sends,
                                                      std::vector<PeerMessage> recvs,
                                                      int64_t round) {
  // Tag of the k-th message between this rank and `peer` in this round, in posting order.
  std::map<int, int64_t> sent_to, received_from;
  auto tag = [round](std::map<int, int64_t>& count, int peer) {
    const int64_t k = count[peer]++;
    TORCH_CHECK(k < kMaxMessagesPerPeer, "gossip_ext: more than ", kMaxMessagesPerPeer,
                " messages to one peer in one round");
    const int64_t sequence = (round * kMaxMessagesPerPeer + k) & kRoundTagMask;
    return static_cast<int>(tags::kRoundBase + sequence);
  };

  std::vector<ProcessGroupWork::Entry> entries;
  std::vector<at::Tensor> keep_alive;
  for (const auto* list : {&recvs, &sends}) {
    for (const PeerMessage& m : *list) {
      TORCH_CHECK(m.buffer.device().is_cpu(), "gossip_ext: the process-group transport needs ",
                  "CPU buffers, got one on ", m.buffer.device());
    }
  }
  // Receives first (see the header). Posting itself can fail: gloo's send throws at once when the
  // peer's connection has closed. Then what was posted is cancelled, so that no receive of the
  // round is left to write into the engine's buffers later, and the failure is a TimeoutError like
  // every other peer failure.
  auto post = [&](const PeerMessage& m, bool is_recv) {
    std::vector<at::Tensor> tensors{m.buffer};
    try {
      entries.push_back({m.peer, is_recv,
                         is_recv ? group_->recv(tensors, m.peer, tag(received_from, m.peer))
                                 : group_->send(tensors, m.peer, tag(sent_to, m.peer))});
    } catch (const std::exception& e) {
      for (const ProcessGroupWork::Entry& posted : entries) abort_quietly(*posted.work);
      throw TimeoutError(
          detail::str_cat("gossip_ext: rank ", rank(), " failed to post a ",
                          is_recv ? "receive from" : "send to", " peer ", m.peer,
                          " in gossip round ", round,
                          "; the peer may have died or left the training loop: ", e.what()),
          {{m.peer}, round, name(), std::nullopt});
    }
    keep_alive.push_back(m.buffer);
  };
  for (const PeerMessage& m : recvs) post(m, /*is_recv=*/true);
  for (const PeerMessage& m : sends) post(m, /*is_recv=*/false);
  auto work = std::make_shared<ProcessGroupWork>(rank(), name(), round, std::move(entries),
                                                 std::move(keep_alive));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(work);
  }
  queued_.notify_one();
  return work;
}

std::shared_ptr<Work> ProcessGroupTransport::post_one(int peer, at::Tensor buffer, int64_t tag,
                                                      bool is_recv) {
  TORCH_CHECK(buffer.device().is_cpu(), "gossip_ext: the process-group transport needs CPU ",
              "buffers, got one on ", buffer.device());
  std::vector<at::Tensor> tensors{buffer};
  auto work = is_recv ? group_->recv(tensors, peer, static_cast<int>(tag))
                      : group_->send(tensors, peer, static_cast<int>(tag));
  return std::make_shared<PointToPointWork>(std::move(work), std::move(buffer), peer, name(),
                                            is_recv);
}

std::shared_ptr<Work> ProcessGroupTransport::post_send(int peer, at::Tensor buffer, int64_t tag) {
  return post_one(peer, std::move(buffer), tag, /*is_recv=*/false);
}

std::shared_ptr<Work> ProcessGroupTransport::post_recv(int peer, at::Tensor buffer, int64_t tag) {
  return post_one(peer, std::move(buffer), tag, /*is_recv=*/true);
}

void ProcessGroupTransport::progress_loop() {
  while (true) {
    std::shared_ptr<ProcessGroupWork> work;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      work = queue_.front();
    }
    work->progress();
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.pop_front();
  }
}

}  // namespace gossip
