#include "transport/loopback/loopback_transport.h"

#include <algorithm>

#include "common/error.h"
#include "common/limits.h"

namespace gossip {

LoopbackTransport::LoopbackTransport(std::shared_ptr<Transport> inner, int rank, int world_size)
    : inner_(std::move(inner)), rank_(rank), world_size_(world_size) {
  GOSSIP_CHECK_ARG(inner_ != nullptr,
                   "gossip_ext: LoopbackTransport: inner must be a transport, got None");
  GOSSIP_CHECK_ARG(inner_->world_size() == 1,
                   "gossip_ext: LoopbackTransport needs a transport of world size 1, got ",
                   inner_->world_size());
  GOSSIP_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size,
                   "gossip_ext: LoopbackTransport rank must be in [0, world_size), got rank ", rank,
                   " and world_size ", world_size);
  check_world_size_cap(world_size, "gossip_ext: LoopbackTransport");
}

std::shared_ptr<Work> LoopbackTransport::exchange(std::vector<PeerMessage> sends,
                                                  std::vector<PeerMessage> recvs, int64_t round) {
  GOSSIP_CHECK_ARG(sends.size() == recvs.size(), "gossip_ext: LoopbackTransport needs as many ",
                   "receives as sends in a round (a regular graph), got ", sends.size(),
                   " sends and ", recvs.size(), " receives in round ", round);
  const int self = inner_->rank();
  for (size_t j = 0; j < sends.size(); ++j) {
    GOSSIP_CHECK_ARG(sends[j].buffer.nbytes() == recvs[j].buffer.nbytes(),
                     "gossip_ext: LoopbackTransport pairs the j-th send with the j-th receive, "
                     "but message ", j, " of round ", round, " has ", sends[j].buffer.nbytes(),
                     " bytes to send and ", recvs[j].buffer.nbytes(), " to receive");
  }
  const size_t dropped = std::min(sends.size(), static_cast<size_t>(drop_));
  drop_ = 0;
  sends.resize(sends.size() - dropped);
  for (PeerMessage& m : sends) m.peer = self;
  for (PeerMessage& m : recvs) m.peer = self;
  return inner_->exchange(std::move(sends), std::move(recvs), round);
}

void LoopbackTransport::connect_peers(const std::vector<int>& peers) {
  inner_->connect_peers(peers.empty() ? std::vector<int>{} : std::vector<int>{inner_->rank()});
}

std::string LoopbackTransport::name() const {
  return detail::str_cat("loopback(rank ", rank_, " of ", world_size_, ") over ", inner_->name());
}

void LoopbackTransport::drop_sends(int count) {
  GOSSIP_CHECK_ARG(count >= 0, "gossip_ext: drop_sends count must be >= 0, got ", count);
  drop_ = count;
}

}  // namespace gossip
