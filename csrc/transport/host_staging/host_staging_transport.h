// Host staging: gossip of device tensors (CUDA parameters) over a transport that carries host
// tensors only (the process-group transport on gloo). GossipDataParallel(comm_device="cpu").
//
// The decorator gives every message slot a host twin, pinned when the device is a GPU, reused
// round after round while the slot's size and dtype stay the same:
//   exchange():  copies each distinct send buffer to its host twin and posts the inner exchange
//                on the twins;
//   completion:  when the inner round has completed (wait(), or is_completed() returning true),
//                copies every received twin into its device buffer, once, before the engine
//                reads it.
// Both copies are blocking. The send copy thereby runs after the compute stream's last write to
// the parameters, and the receive copy has finished before the next exchange reuses the twins,
// so no events are needed. One synchronous copy each way per round costs little beside the
// message time on the slow networks this mode is for; a fast network would use NCCL instead.
//
// Works for any device, the CPU included (then the twins are plain host tensors), which is how
// the staging logic is tested without a GPU.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace gossip {

class HostStagingTransport final : public Transport {
 public:
  explicit HostStagingTransport(std::shared_ptr<Transport> inner);

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override;
  std::string name() const override;
  void connect_peers(const std::vector<int>& peers) override { inner_->connect_peers(peers); }
  void abandon(const std::string& why) override { inner_->abandon(why); }

 private:
  std::shared_ptr<Transport> inner_;
  std::vector<at::Tensor> send_twins_;  // by distinct send buffer, in posting order
  std::vector<at::Tensor> recv_twins_;  // by receive, in posting order
};

}  // namespace gossip
