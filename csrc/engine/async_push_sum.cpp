#include "engine/async_push_sum.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/limits.h"

namespace gossip {
namespace {

// A share below this fraction of the weight moves z by less than any float's resolution (and its
// ratio would overflow float32): it is counted in the weight and not mixed.
constexpr double kNegligibleShare = 1e-30;

// The arguments checked before the parameters are flattened (which makes them views of the
// engine's buffers): a construction refused leaves the caller's parameters as they were.
void check_async_arguments(const std::shared_ptr<Transport>& transport,
                           const std::shared_ptr<Departures>& departures,
                           const AsyncOptions& options) {
  GOSSIP_CHECK_ARG(transport != nullptr, "gossip_ext: transport must not be None");
  GOSSIP_CHECK_ARG(departures != nullptr, "gossip_ext: departures must not be None");
  check_timeout(options.timeout, "gossip_ext: AsyncPushSum");
  GOSSIP_CHECK_ARG(!options.staleness || *options.staleness >= 0,
                   "gossip_ext: staleness must be >= 0 or None, got ",
                   options.staleness.value_or(0));
}

}  // namespace

AsyncPushSum::AsyncPushSum(const std::vector<at::Tensor>& params,
                           const std::vector<std::string>& names,
                           std::shared_ptr<Transport> transport,
                           std::shared_ptr<Departures> departures, AsyncOptions options)
    : groups_((check_async_arguments(transport, departures, options),
               flatten_parameters(params, names))),
      transport_(std::move(transport)),
      departures_(std::move(departures)),
      options_(std::move(options)),
      graph_(options_.graph, transport_->world_size()),
      codec_(
          [&] {
            std::vector<MessageCodec::Part> parts;
            for (const FlatParameterGroup& g : groups_) {
              parts.push_back({g.flat.numel(), g.flat.scalar_type()});
            }
            return parts;
          }(),
          options_.message_dtype, options_.message_format,
          groups_.empty() ? c10::Device(c10::kCPU) : groups_.front().flat.device()),
      generation_(options_.generation) {
  open_channels(std::vector<int64_t>(static_cast<size_t>(world_size()), 0));
}

AsyncPushSum::~AsyncPushSum() { abandon("the engine was dropped"); }

void AsyncPushSum::open_channels(const std::vector<int64_t>& rounds) {
  const int me = rank();
  for (int peer : graph_.phone_book(me)) {
    if (!outboxes_.count(peer)) {
      outboxes_[peer] =
          std::make_shared<Outbox>(transport_, departures_, peer, generation_, options_.timeout);
    }
  }
  const int64_t period = graph_.period();
  for (int peer = 0; peer < world_size(); ++peer) {
    if (peer == me) continue;
    std::vector<bool> sends(static_cast<size_t>(period));
    bool ever = false;
    for (int64_t r = 0; r < period; ++r) {
      const std::vector<int> out = graph_.out_peers(peer, r);
      sends[static_cast<size_t>(r)] = std::find(out.begin(), out.end(), me) != out.end();
      ever = ever || sends[static_cast<size_t>(r)];
    }
    if (!ever) continue;
    mailboxes_[peer] = std::make_shared<Mailbox>(
        transport_, departures_, peer, generation_, options_.timeout, codec_.nbytes(),
        std::move(sends), rounds[static_cast<size_t>(peer)],
        options_.staleness ? std::nullopt : std::optional<int64_t>(kHeldLimit));
  }
}

std::vector<at::Tensor> AsyncPushSum::flats() const {
  std::vector<at::Tensor> flats;
  for (const FlatParameterGroup& g : groups_) {
    g.check_views();
    flats.push_back(g.flat);
  }
  return flats;
}

void AsyncPushSum::check_silences() {
  for (auto& [peer, outbox] : outboxes_) outbox->check_silence();
  for (auto& [peer, mailbox] : mailboxes_) mailbox->check_silence();
}

template <typename Body>
void AsyncPushSum::guarded(Body body) {
  raise_if_failed();
  try {
    body();
  } catch (const TimeoutError&) {
    failure_ = std::current_exception();
    throw;
  } catch (const NonFiniteError&) {
    failure_ = std::current_exception();
    throw;
  }
}

void AsyncPushSum::raise_if_failed() const {
  if (failure_) std::rethrow_exception(failure_);
}

void AsyncPushSum::start_round() {
  guarded([&] {
    check_silences();
    send_bound_absorb();
  });
}

void AsyncPushSum::finish_round() {
  guarded([&] {
    check_silences();
    absorb(options_.staleness ? std::optional<int64_t>(round_ - 1 + *options_.staleness)
                              : std::nullopt);
  });
}

void AsyncPushSum::send_bound_absorb() {
  const int64_t round = round_;
  const std::vector<int> scheduled = graph_.out_peers(rank(), round);
  // A send that failed (the peer died) is raised where its peer is scheduled: its unconfirmed
  // send stays in the backlog, so flow control would skip the peer from now on and no later post
  // would raise it.
  for (int peer : scheduled) outboxes_.at(peer)->raise_if_failed();
  // A peer that left is sent nothing more, and, with no staleness bound, one that has not taken
  // this worker's last message yet is skipped this round: its share stays here (Note [Flow
  // control by absorption]). A bound instead waits for it, tau rounds later.
  std::vector<int> live, out_peers;
  for (int peer : scheduled) {
    if (outboxes_.at(peer)->ended()) continue;
    live.push_back(peer);
    if (options_.staleness || outboxes_.at(peer)->backlog() < kMaxBacklog) {
      out_peers.push_back(peer);
    }
  }
  counts_.scheduled += static_cast<int64_t>(scheduled.size());
  counts_.held_back += static_cast<int64_t>(live.size() - out_peers.size());
  if (!out_peers.empty()) out_peers = send(round, out_peers);
  round_ = round + 1;
  if (options_.record) {
    AsyncEvent event{true, round, {}};
    for (int peer : out_peers) event.messages.emplace_back(peer, round);
    history_.push_back(std::move(event));
  }
  if (options_.staleness) {
    const int64_t owed = round - *options_.staleness;
    for (auto& [peer, outbox] : outboxes_) outbox->wait_until_past(owed);
    for (auto& [peer, mailbox] : mailboxes_) mailbox->wait_until_past(owed);
    absorb(round_ - 1 + *options_.staleness);
  } else {
    absorb(std::nullopt);
  }
}

std::vector<int> AsyncPushSum::send(int64_t round, const std::vector<int>& out_peers) {
  const double share = weight_ / static_cast<double>(out_peers.size() + 1);
  const std::vector<at::Tensor> values = flats();
  // One pass writes the message and keeps its rounding here: with every peer sent one,
  // (w z - k share q) / share = z + k (z - q), so the parameters are then the kept z.
  const at::Tensor message =
      codec_.encode(values, share, round, 0.0, static_cast<double>(out_peers.size()));
  if (options_.check_finite && !codec_.values_finite(message)) raise_nonfinite({});
  std::vector<int> sent;
  for (int peer : out_peers) {
    if (outboxes_.at(peer)->post(round, message)) sent.push_back(peer);
  }
  const auto unsent = static_cast<double>(out_peers.size() - sent.size());
  counts_.sent += static_cast<int64_t>(sent.size());
  if (unsent > 0) {
    // A share not sent (its peer left meanwhile) is kept: absorbed back as a message of weight
    // unsent * share, z <- (share z + unsent share q) / ((1 + unsent) share).
    codec_.absorb(values, message, 1.0 / unsent, (1.0 + unsent) / unsent);
  }
  weight_ = share * (1.0 + unsent);
  bytes_sent_ += static_cast<int64_t>(sent.size()) * codec_.nbytes();
  return sent;
}

void AsyncPushSum::absorb(std::optional<int64_t> through) {
  struct Arrival {
    int peer;
    int64_t round;
    at::Tensor message;
  };
  std::vector<Arrival> arrived;
  for (auto& [peer, mailbox] : mailboxes_) {
    for (Mailbox::Arrived& a : mailbox->take(through)) {
      arrived.push_back({peer, a.round, std::move(a.message)});
    }
  }
  if (arrived.empty()) return;
  if (options_.check_finite) {
    // Checked before anything is written: a refused round leaves the model as it was.
    std::vector<int> senders;
    for (const Arrival& a : arrived) {
      if (!std::isfinite(MessageCodec::weight_of(a.message)) || !codec_.values_finite(a.message)) {
        senders.push_back(a.peer);
      }
    }
    if (!senders.empty()) raise_nonfinite(senders);
  }
  const std::vector<at::Tensor> values = flats();
  double weight = weight_;
  for (const Arrival& a : arrived) {
    const double share = MessageCodec::weight_of(a.message);
    const double total = weight + share;
    // z <- (w z + w_m z_m) / (w + w_m) as (alpha z + z_m) / new_weight, in ratios of weights
    // (Note [Scale-free shares]).
    if (share > 0.0 && share >= kNegligibleShare * weight) {
      codec_.absorb(values, a.message, weight / share, total / share);
    }
    weight = total;
  }
  weight_ = weight;
  counts_.messages += static_cast<int64_t>(arrived.size());
  for (const Arrival& a : arrived) {
    const int64_t lag = (round_ - 1) - a.round;
    counts_.staleness_sum += lag;
    counts_.staleness_max = std::max(counts_.staleness_max.value_or(lag), lag);
  }
  if (options_.record) {
    AsyncEvent event{false, round_ - 1, {}};
    for (const Arrival& a : arrived) event.messages.emplace_back(a.peer, a.round);
    history_.push_back(std::move(event));
  }
}

std::vector<int64_t> AsyncPushSum::sent_counts() const {
  std::vector<int64_t> counts(static_cast<size_t>(world_size()), 0);
  for (const auto& [peer, outbox] : outboxes_) counts[static_cast<size_t>(peer)] = outbox->sent();
  return counts;
}

void AsyncPushSum::settle(const std::vector<int64_t>& sent_to_me) {
  GOSSIP_CHECK_ARG(static_cast<int>(sent_to_me.size()) == world_size(),
                   "gossip_ext: settle: sent_to_me must have one count per rank (",
                   world_size(), "), got ", sent_to_me.size());
  guarded([&] {
    for (auto& [peer, mailbox] : mailboxes_) mailbox->wait_for(sent_to_me[peer]);
    for (auto& [peer, outbox] : outboxes_) outbox->wait_until_past(std::nullopt);
    absorb(std::nullopt);  // every round that arrived, whatever the bound
  });
}

void AsyncPushSum::restore(int64_t round, double weight, const std::vector<int64_t>& rounds) {
  GOSSIP_CHECK_ARG(round >= 0, "gossip_ext: restore: round must be >= 0, got ", round);
  GOSSIP_CHECK_ARG(std::isfinite(weight) && weight > 0.0,
                   "gossip_ext: restore: ps_weight must be positive and finite, got ", weight);
  GOSSIP_CHECK_ARG(static_cast<int>(rounds.size()) == world_size(),
                   "gossip_ext: restore: rounds must have one round per rank (", world_size(),
                   "), got ", rounds.size());
  for (auto& [peer, box] : outboxes_) box->close();
  for (auto& [peer, box] : mailboxes_) box->close();
  outboxes_.clear();
  mailboxes_.clear();
  round_ = round;
  weight_ = weight;
  ++generation_;
  open_channels(rounds);
}

void AsyncPushSum::abandon(const std::string& why) {
  if (left_.exchange(true)) return;
  departures_->announce(rank());
  for (auto& [peer, box] : outboxes_) box->fail(why, round_);
  for (auto& [peer, box] : mailboxes_) box->fail(why, round_);
}

void AsyncPushSum::raise_nonfinite(const std::vector<int>& senders) const {
  const std::string whose = senders.empty()
                                ? detail::str_cat("in rank ", rank(), "'s own parameters")
                                : detail::str_cat("from peers ", senders);
  throw NonFiniteError(
      detail::str_cat("gossip_ext: rank ", rank(), " found NaN or Inf in its asynchronous round ",
                      round_, ", ", whose,
                      "; push-sum would spread them, so no round goes on, and the parameters keep "
                      "the model they hold"),
      {senders, round_, transport_->name(), std::nullopt});
}

}  // namespace gossip
