#include "transport/host_staging/host_staging_transport.h"

#include <utility>

#include <ATen/ops/empty.h>

#include "common/error.h"

namespace gossip {
namespace {

// The host twin of `buffer` in `twins[index]`, allocated (pinned for a GPU buffer) on first use
// or when the slot's size or dtype changed.
const at::Tensor& twin(std::vector<at::Tensor>& twins, size_t index, const at::Tensor& buffer) {
  if (twins.size() <= index) twins.resize(index + 1);
  at::Tensor& host = twins[index];
  if (!host.defined() || host.numel() != buffer.numel() ||
      host.scalar_type() != buffer.scalar_type()) {
    host = at::empty({buffer.numel()}, at::TensorOptions()
                                           .dtype(buffer.scalar_type())
                                           .pinned_memory(buffer.device().is_cuda()));
  }
  return host;
}

// One staged round: the inner round plus the copies of its received twins into device buffers.
class HostStagingWork final : public Work {
 public:
  HostStagingWork(std::shared_ptr<Work> inner, std::vector<PeerMessage> device_recvs,
                  std::vector<at::Tensor> host_recvs)
      : inner_(std::move(inner)),
        device_recvs_(std::move(device_recvs)),
        host_recvs_(std::move(host_recvs)) {}

  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    // Completed, possibly by failing: wait() returns at once, or rethrows the inner error.
    inner_->wait(std::chrono::milliseconds(0));
    copy_back();
    return true;
  }

  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    copy_back();
  }

 private:
  void copy_back() {
    if (copied_) return;
    for (size_t j = 0; j < device_recvs_.size(); ++j) {
      device_recvs_[j].buffer.view({-1}).copy_(host_recvs_[j]);
    }
    copied_ = true;
  }

  std::shared_ptr<Work> inner_;
  std::vector<PeerMessage> device_recvs_;
  std::vector<at::Tensor> host_recvs_;
  bool copied_ = false;
};

}  // namespace

HostStagingTransport::HostStagingTransport(std::shared_ptr<Transport> inner)
    : inner_(std::move(inner)) {
  GOSSIP_CHECK_ARG(inner_ != nullptr,
                   "gossip_ext: HostStagingTransport: inner must be a transport, got None");
}

std::shared_ptr<Work> HostStagingTransport::exchange(std::vector<PeerMessage> sends,
                                                     std::vector<PeerMessage> recvs,
                                                     int64_t round) {
  // The engine sends one buffer to several peers: copy it once.
  std::vector<PeerMessage> host_sends;
  host_sends.reserve(sends.size());
  std::vector<const at::Tensor*> staged;  // the distinct device buffers copied so far
  for (const PeerMessage& send : sends) {
    size_t index = 0;
    while (index < staged.size() && !staged[index]->is_same(send.buffer)) ++index;
    if (index == staged.size()) {
      twin(send_twins_, index, send.buffer).copy_(send.buffer.view({-1}));
      staged.push_back(&send.buffer);
    }
    host_sends.push_back({send.peer, send_twins_[index]});
  }
  std::vector<PeerMessage> host_recvs;
  std::vector<at::Tensor> host_buffers;
  host_recvs.reserve(recvs.size());
  host_buffers.reserve(recvs.size());
  for (size_t j = 0; j < recvs.size(); ++j) {
    const at::Tensor& host = twin(recv_twins_, j, recvs[j].buffer);
    host_recvs.push_back({recvs[j].peer, host});
    host_buffers.push_back(host);
  }
  std::shared_ptr<Work> inner = inner_->exchange(std::move(host_sends), std::move(host_recvs), round);
  return std::make_shared<HostStagingWork>(std::move(inner), std::move(recvs),
                                           std::move(host_buffers));
}

std::string HostStagingTransport::name() const {
  return "host staging over " + inner_->name();
}

}  // namespace gossip
