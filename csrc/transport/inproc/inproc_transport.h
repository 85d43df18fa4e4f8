// In-process transport: N ranks as threads of one process, exchanging through mailboxes.
//
// Used by the C++ multi-rank tests and by gossip_ext.simulate (large worlds without a cluster).
// A send copies the message into the receiver's mailbox at once, so a send never blocks and the
// sender may reuse its buffer; a receive waits on the mailbox's condition variable (no polling)
// until the message is there, the timeout passes, or the hub is aborted.
//
// Usage (one thread per rank):
//   auto hub = std::make_shared<gossip::InProcHub>(world_size);
//   gossip::InProcTransport transport(hub, rank);
//   auto work = transport.exchange({{peer, send_buf}}, {{from, recv_buf}}, round);
//   work->wait(std::chrono::seconds(10));
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "transport/transport.h"

namespace gossip {

class InProcHub {
 public:
  explicit InProcHub(int world_size);
  int world_size() const { return static_cast<int>(mailboxes_.size()); }

  void post(int src, int dst, int64_t tag, const at::Tensor& message);
  // Removes the oldest message from src to dst with this tag into *out, if one is there.
  bool try_take(int src, int dst, int64_t tag, at::Tensor* out);
  // Like try_take, but waits for the message until the deadline; false on timeout.
  bool take_until(int src, int dst, int64_t tag, at::Tensor* out,
                  std::chrono::steady_clock::time_point deadline);
  // Wakes every waiter, which then throws `reason`: one failed rank must not leave the others
  // waiting for messages that will never come.
  void abort(const std::string& reason);

 private:
  struct Mailbox {
    std::mutex mutex;
    std::condition_variable arrived;
    std::map<std::pair<int, int64_t>, std::deque<at::Tensor>> messages;  // (src, tag) -> FIFO
  };
  Mailbox& mailbox(int dst);
  void throw_if_aborted() const;

  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  std::mutex abort_mutex_;
  std::string abort_reason_;        // written once, before aborted_ is set
  std::atomic<bool> aborted_{false};
};

class InProcTransport final : public Transport {
 public:
  InProcTransport(std::shared_ptr<InProcHub> hub, int rank);
  int rank() const override { return rank_; }
  int world_size() const override { return hub_->world_size(); }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override;
  std::string name() const override { return "inproc"; }
  // A send is in the receiver's mailbox at once; a receive waits for it (Note [Asynchronous
  // messages] in transport.h).
  std::shared_ptr<Work> post_send(int peer, at::Tensor buffer, int64_t tag) override;
  std::shared_ptr<Work> post_recv(int peer, at::Tensor buffer, int64_t tag) override;

 private:
  std::shared_ptr<InProcHub> hub_;
  int rank_;
};

}  // namespace gossip
