// LoopbackTransport: one process plays rank `rank` of a world of `world_size` over a transport
// of world size one, every message going to and coming from itself. One GPU cannot hold two NCCL
// ranks, so this is how a single device runs real rounds through the NCCL transport: odd sizes,
// several messages per peer, travelling weights, compressed messages, the non-finite flag and a
// timeout. The same decorator over the in-process transport tests it on the CPU.
//
// Every send of a round is posted to the inner transport's own rank, and so is every receive, in
// the engine's posting order: the j-th receive gets the j-th send (the engine posts its dtype
// groups in the same order on both sides, and on a regular graph a rank receives as many messages
// as it sends). A rank then absorbs its own shares, which leaves z and w unchanged (the consensus
// fixed point of equal workers) while every byte crosses the transport.
//
// drop_sends(k) leaves out the last k sends of the next round, so that k receives never get their
// message: a stalled peer, for the timeout path, over transports that accept a receive without its
// send (in-process). NCCL rejects one from self outright ("Trying to recv to self without a
// matching send"); tests/gpu holds a round behind a busy compute stream instead.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace gossip {

class LoopbackTransport final : public Transport {
 public:
  // `inner` must have world size one.
  LoopbackTransport(std::shared_ptr<Transport> inner, int rank, int world_size);

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override;
  std::string name() const override;
  // Every peer maps to the inner transport's own rank: it connects that rank, if any peer.
  void connect_peers(const std::vector<int>& peers) override;

  void drop_sends(int count);

 private:
  std::shared_ptr<Transport> inner_;
  const int rank_;
  const int world_size_;
  int drop_ = 0;
};

}  // namespace gossip
