#include "engine/gossip_engine.h"

#include <algorithm>
#include <cmath>

#include <ATen/ops/all.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "common/error.h"
#include "common/limits.h"
#include "kernels/push_sum.h"

namespace gossip {
namespace {

// Elements of `dtype` that hold the weight's 8-byte-aligned slot at the tail of a message.
int64_t weight_slot_elements(at::ScalarType dtype) {
  return 8 / static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

GossipEngine::GossipEngine(const std::vector<at::Tensor>& params,
                           const std::vector<std::string>& names,
                           std::shared_ptr<Transport> transport, EngineOptions options)
    : transport_(std::move(transport)),
      options_(std::move(options)),
      graph_(options_.graph, transport_ ? transport_->world_size() : 1) {
  TORCH_CHECK_VALUE(transport_ != nullptr, "gossip_ext: transport must not be None");
  check_timeout(options_.timeout, "gossip_ext");
  validate(options_.mixing);
  TORCH_CHECK_VALUE(options_.push_sum || graph_.pairs_symmetrically(),
                    "gossip_ext: push_sum=False (push-pull averaging, D-PSGD) needs a graph that "
                    "pairs nodes symmetrically in every round, but ",
                    graph_kind_name(graph_.kind()), " at world size ", graph_.world_size(),
                    " does not; use DynamicBipartiteExponentialGraph, "
                    "DynamicBipartiteLinearGraph, HypercubeGraph or RingGraph(peers_per_itr=2)");
  TORCH_CHECK_VALUE(!options_.message_dtype.has_value() ||
                        *options_.message_dtype == at::kHalf ||
                        *options_.message_dtype == at::kBFloat16,
                    "gossip_ext: message_dtype must be torch.float16 or torch.bfloat16 (or None for "
                    "full precision), got ",
                    *options_.message_dtype);
  TORCH_CHECK_VALUE(!options_.message_dtype.has_value() || !options_.message_format.has_value(),
                    "gossip_ext: message_dtype and message_format exclude each other");
  groups_ = flatten_parameters(params, names);
  lazy_ = !options_.push_sum ||
          (options_.allow_lazy_mixing && options_.mixing.kind == MixingKind::kUniform &&
           graph_.is_regular());
  for (const FlatParameterGroup& group : groups_) {
    const at::ScalarType dtype = group.flat.scalar_type();
    compressed_.push_back(
        (options_.message_dtype.has_value() || options_.message_format.has_value()) &&
        (dtype == at::kFloat || dtype == at::kDouble));
  }
  const bool any_compressed = std::find(compressed_.begin(), compressed_.end(), true) !=
                              compressed_.end();
  in_place_ = options_.synchronous && lazy_ && options_.mixing.kind == MixingKind::kUniform &&
              !any_compressed;
  fold_at_absorb_ = options_.synchronous;

  for (const FlatParameterGroup& group : groups_) {
    if (group.flat.scalar_type() == at::kDouble) weight_dtype_ = at::kDouble;
  }
  const at::TensorOptions device = groups_[0].flat.options();
  weight_ = at::full({1}, 1.0, device.dtype(weight_dtype_));
  kept_weight_ = weight_.clone();
  if (in_place_) in_place_divisor_ = weight_.clone();
  if (options_.check_finite) {
    nonfinite_ = at::zeros({1}, device.dtype(at::kInt));
    if (!nonfinite_.is_cpu()) {
      nonfinite_host_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
      nonfinite_copied_.emplace(nonfinite_.device().type());
    }
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    // A quantized message is bytes: its scales, then its codes.
    const at::ScalarType dtype = quantized(g)        ? at::kByte
                                 : compressed_[g]    ? *options_.message_dtype
                                                     : groups_[g].flat.scalar_type();
    const int64_t numel = quantized(g)
                              ? quant_message_bytes(groups_[g].flat.numel(), *options_.message_format)
                              : groups_[g].flat.numel();
    const int64_t slot = weight_slot_elements(dtype);
    const int64_t message_numel = lazy_ ? numel : round_up(numel, slot) + slot;
    recv_.emplace_back();
    if (in_place_) {
      send_.push_back(at::Tensor());  // the flat buffer itself is sent
      continue;
    }
    at::Tensor message = at::empty({message_numel}, device.dtype(dtype));
    message.zero_();  // padding bytes travel too: keep them deterministic
    send_.push_back(message);
  }
  transport_->connect_peers(graph_.peers(rank()));  // collective: every rank builds its engine
}

int64_t GossipEngine::message_bytes() const {
  int64_t bytes = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const at::Tensor& message = in_place_ ? groups_[g].flat : send_[g];
    bytes += static_cast<int64_t>(message.nbytes());
  }
  return bytes;
}

at::Tensor GossipEngine::weight_slot(const at::Tensor& message) const {
  const int64_t weight_bytes = static_cast<int64_t>(c10::elementSize(weight_dtype_));
  const int64_t total_bytes = message.numel() * static_cast<int64_t>(message.element_size());
  return message.view(at::kByte).narrow(0, total_bytes - 8, weight_bytes).view(weight_dtype_);
}

at::Tensor GossipEngine::message_body(size_t g, const at::Tensor& message) const {
  const int64_t numel = groups_[g].flat.numel();
  return message.narrow(
      0, 0, quantized(g) ? quant_message_bytes(numel, *options_.message_format) : numel);
}

std::shared_ptr<Work> GossipEngine::start_round() {
  raise_if_failed();
  check_last_absorb_finite();
  TORCH_CHECK(work_ == nullptr, "gossip_ext: gossip round ", round_,
              " is still in flight; finish it before starting another");
  for (const FlatParameterGroup& group : groups_) group.check_views();

  const int rank = transport_->rank();
  const std::vector<int> out_peers = graph_.out_peers(rank, round_);
  in_peers_ = graph_.in_peers(rank, round_);
  const MixingWeights weights = mixing_weights(options_.mixing, static_cast<int>(out_peers.size()));
  const auto num_out = static_cast<int64_t>(out_peers.size());

  // Note [The parameters are the model]: nothing below writes the parameters (but the overlap
  // fold of compressed messages), and nothing a caller reads changes before the round is posted.
  std::vector<PeerMessage> sends;
  std::vector<PeerMessage> recvs;
  int64_t bytes = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const at::Tensor& flat = groups_[g].flat;
    const at::Tensor& message = in_place_ ? flat : send_[g];
    if (!in_place_ && num_out > 0) {
      const at::Tensor body = message_body(g, message);
      const std::optional<at::Tensor> weight =
          lazy_ ? std::nullopt : std::optional<at::Tensor>(weight_);
      if (compressed_[g]) {
        // Note [Compressed messages]: folded in now, or at the absorb (feedback 0 here).
        const double feedback =
            fold_at_absorb_ ? 0.0 : static_cast<double>(num_out) / weights.self_weight;
        if (quantized(g)) {
          ops::quantize_into_(flat, body, block_format_name(*options_.message_format),
                              weights.peer_weight, weight, feedback);
        } else {
          ops::compress_into_(flat, body, weights.peer_weight, weight, feedback);
        }
      } else {
        ops::scale_into(flat, body, weights.peer_weight, weight);
      }
      if (!lazy_) weight_slot(message).copy_(weight_.mul(weights.peer_weight));
    }
    for (int peer : out_peers) sends.push_back({peer, message});
    bytes += num_out * static_cast<int64_t>(message.nbytes());
    std::vector<at::Tensor>& buffers = recv_[g];
    while (buffers.size() < in_peers_.size()) {
      buffers.push_back(in_place_ ? at::empty_like(flat) : at::empty_like(message));
    }
    for (size_t j = 0; j < in_peers_.size(); ++j) recvs.push_back({in_peers_[j], buffers[j]});
  }

  // A transport that fails to post may have delivered part of the round: the engine fails.
  fail_on_error([&] { work_ = transport_->exchange(std::move(sends), std::move(recvs), round_); });
  bytes_sent_ += bytes;
  sent_scale_ = fold_at_absorb_ ? -static_cast<double>(num_out) : 0.0;
  if (in_place_) {
    self_scale_ = 1.0;
    in_place_divisor_.fill_(static_cast<double>(num_out + 1));
  } else {
    self_scale_ = lazy_ ? weights.self_weight : 1.0;
  }
  kept_share_ = weights.self_weight;
  if (!lazy_) kept_weight_.copy_(weight_).mul_(weights.self_weight);
  return work_;
}

void GossipEngine::raise_if_failed() const {
  if (failure_) std::rethrow_exception(failure_);
}

void GossipEngine::fail_on_error(const std::function<void()>& body) {
  try {
    body();
  } catch (...) {
    failure_ = std::current_exception();
    work_.reset();
    throw;
  }
}

void GossipEngine::finish_round() {
  raise_if_failed();
  check_last_absorb_finite();
  if (work_ == nullptr) return;
  fail_on_error([&] {
    work_->wait(options_.timeout);
    absorb();
  });
}

bool GossipEngine::try_finish_round() {
  raise_if_failed();
  check_last_absorb_finite();
  if (work_ == nullptr) return true;
  fail_on_error([&] {
    if (!work_->is_completed()) return;
    // A round also completes by failing (a peer died): wait() returns at once and rethrows the
    // transport's error instead of letting stale receive buffers be absorbed.
    work_->wait(options_.timeout);
    absorb();
  });
  return work_ == nullptr;
}

void GossipEngine::synchronize() {
  finish_round();
  if (last_absorbed_ != nullptr) {
    fail_on_error([&] { last_absorbed_->synchronize(options_.timeout); });
    last_absorbed_.reset();
  }
  check_last_absorb_finite();
}

void GossipEngine::absorb() {
  const size_t num_received = in_peers_.size();
  std::optional<at::Tensor> new_weight;
  std::optional<at::Tensor> self_weight;
  if (!lazy_) {
    // Folding at the absorb reads the node's whole numerator w * z and subtracts what it sent;
    // otherwise the kept share w_kept * z is what stays.
    self_weight = fold_at_absorb_ && sent_scale_ != 0.0 ? weight_ : kept_weight_;
    at::Tensor sum = kept_weight_.clone();
    for (size_t j = 0; j < num_received; ++j) sum.add_(weight_slot(recv_[0][j]));
    new_weight = sum;
  } else if (in_place_) {
    new_weight = in_place_divisor_;
  }
  std::optional<at::Tensor> nonfinite;
  if (options_.check_finite) {
    nonfinite_.zero_();
    nonfinite = nonfinite_;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const at::Tensor& flat = groups_[g].flat;
    std::vector<at::Tensor> received;
    received.reserve(num_received);
    for (size_t j = 0; j < num_received; ++j) received.push_back(message_body(g, recv_[g][j]));
    const std::string format =
        quantized(g) ? block_format_name(*options_.message_format) : std::string();
    if (compressed_[g] && fold_at_absorb_ && sent_scale_ != 0.0) {
      const at::Tensor sent = message_body(g, send_[g]);
      if (quantized(g)) {
        ops::absorb_quantized_(flat, received, format, 1.0, self_weight, new_weight, nonfinite,
                               sent, sent_scale_);
      } else {
        ops::absorb_(flat, received, 1.0, self_weight, new_weight, nonfinite, sent, sent_scale_);
      }
    } else {
      // Uncompressed groups (and compressed ones under overlap, folded at the send) keep their
      // share; lazy mixing's share is a plain scale.
      const std::optional<at::Tensor> kept =
          lazy_ ? std::nullopt : std::optional<at::Tensor>(kept_weight_);
      if (quantized(g)) {
        ops::absorb_quantized_(flat, received, format, self_scale_, kept, new_weight, nonfinite);
      } else {
        ops::absorb_(flat, received, self_scale_, kept, new_weight, nonfinite);
      }
    }
  }
  if (!lazy_) weight_.copy_(*new_weight);
  self_scale_ = 1.0;
  sent_scale_ = 0.0;
  last_absorbed_ = std::move(work_);
  work_.reset();
  if (options_.check_finite) {
    nonfinite_check_pending_ = true;
    checked_round_ = round_;
    checked_in_peers_ = in_peers_;
    if (nonfinite_copied_.has_value()) {
      // A GPU: no host sync here (Note [Non-finite messages]); the next call reads the copy.
      const c10::Device device = nonfinite_.device();
      nonfinite_host_.copy_(nonfinite_, /*non_blocking=*/true);
      nonfinite_copied_->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
    }
  }
  ++round_;
  if (!nonfinite_copied_.has_value()) check_last_absorb_finite();
}

void GossipEngine::check_last_absorb_finite() {
  if (!nonfinite_check_pending_) return;
  nonfinite_check_pending_ = false;
  int flag = 0;
  if (nonfinite_copied_.has_value()) {
    nonfinite_copied_->synchronize();
    flag = nonfinite_host_.item<int>();
  } else {
    flag = nonfinite_.item<int>();
  }
  if (flag == 0) return;
  try {
    raise_nonfinite(checked_round_, checked_in_peers_);
  } catch (...) {
    failure_ = std::current_exception();
    throw;
  }
}

void GossipEngine::raise_nonfinite(int64_t round, const std::vector<int>& in_peers) const {
  // The slow path, taken once: the receive buffers still hold the round's messages.
  std::vector<int> senders;
  for (size_t j = 0; j < in_peers.size(); ++j) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      // A quantized message's NaN or Inf is a NaN block scale (Note [Quantized messages]).
      const at::Tensor body =
          quantized(g) ? recv_[g][j]
                             .narrow(0, 0, quant_blocks(groups_[g].flat.numel()) * 4)
                             .view(at::kFloat)
                       : recv_[g][j].narrow(0, 0, groups_[g].flat.numel());
      if (!at::isfinite(body).all().item<bool>()) {
        senders.push_back(in_peers[j]);
        break;
      }
    }
  }
  const int rank = transport_->rank();
  if (!senders.empty()) {
    throw NonFiniteError(
        detail::str_cat(
            "gossip_ext: round ", round, ": the messages from peers ", senders,
            " hold NaN or Inf values: the training of those workers has diverged, and rank ", rank,
            " absorbed them. Pass check_finite=False to let non-finite values through."),
        {senders, round, transport_->name(), std::nullopt});
  }
  throw NonFiniteError(
      detail::str_cat(
          "gossip_ext: round ", round, ": the parameters of this rank (rank ", rank,
          ") hold NaN or Inf values; no message did: the training of this worker has diverged "
          "(look at its loss and learning rate). Pass check_finite=False to let non-finite "
          "values through."),
      {{}, round, transport_->name(), std::nullopt});
}

at::Tensor GossipEngine::ps_weight() const {
  if (lazy_) return at::full({1}, 1.0, weight_.options());
  return weight_.clone();
}

at::Tensor GossipEngine::kept_ps_weight() const {
  if (!in_flight()) return ps_weight();
  if (lazy_) return at::full({1}, kept_share_, weight_.options());
  return kept_weight_.clone();
}

std::vector<at::Tensor> GossipEngine::ps_numerators() const {
  const at::Tensor weight = ps_weight();
  std::vector<at::Tensor> numerators;
  for (const FlatParameterGroup& group : groups_) {
    at::Tensor x = at::empty_like(group.flat);
    ops::scale_into(group.flat, x, 1.0, weight);
    numerators.push_back(x);
  }
  return numerators;
}

void GossipEngine::restore(int64_t round, double ps_weight) {
  raise_if_failed();
  TORCH_CHECK(work_ == nullptr, "gossip_ext: cannot restore a checkpoint while gossip round ",
              round_, " is in flight");
  TORCH_CHECK_VALUE(round >= 0, "gossip_ext: checkpoint round must be >= 0, got ", round);
  TORCH_CHECK_VALUE(std::isfinite(ps_weight) && ps_weight > 0.0,
                    "gossip_ext: checkpoint ps_weight must be finite and > 0, got ", ps_weight);
  TORCH_CHECK_VALUE(!lazy_ || ps_weight == 1.0, "gossip_ext: checkpoint ps_weight is ", ps_weight,
                    " but this configuration uses lazy mixing, where it is always 1");
  round_ = round;
  weight_.fill_(ps_weight);
}

void GossipEngine::set_peers_per_itr(int peers_per_itr) {
  raise_if_failed();
  TORCH_CHECK(work_ == nullptr, "gossip_ext: cannot change peers_per_itr while gossip round ",
              round_, " is in flight");
  GraphOptions options = options_.graph;
  options.peers_per_itr = peers_per_itr;
  Graph graph(options, graph_.world_size());  // validates peers_per_itr for this world size
  TORCH_CHECK_VALUE(options_.push_sum || graph.pairs_symmetrically(),
                    "gossip_ext: push_sum=False needs a graph that pairs nodes symmetrically, but ",
                    graph_kind_name(graph.kind()), " with peers_per_itr=", peers_per_itr,
                    " at world size ", graph.world_size(), " does not");
  // Lazy mixing (and with it the message layout) was chosen for a regular graph.
  TORCH_CHECK_VALUE(graph.is_regular() == graph_.is_regular(), "gossip_ext: peers_per_itr=",
                    peers_per_itr, " makes ", graph_kind_name(graph.kind()),
                    graph.is_regular() ? " regular" : " irregular", " at world size ",
                    graph.world_size(), ", unlike peers_per_itr=", graph_.peers_per_itr());
  transport_->connect_peers(graph.peers(rank()));  // collective, as set_peers_per_itr is
  options_.graph = std::move(options);
  graph_ = std::move(graph);
  // In-peer counts change with the schedule: receive buffers are allocated again as needed.
  for (std::vector<at::Tensor>& buffers : recv_) buffers.clear();
}

}  // namespace gossip
