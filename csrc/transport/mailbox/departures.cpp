#include "transport/mailbox/departures.h"

#include <string>
#include <thread>

#include "common/error.h"
#include "common/limits.h"

namespace gossip {
namespace {

std::string left_key(int rank) { return "left/" + std::to_string(rank); }

}  // namespace

Departures::Departures(c10::intrusive_ptr<c10d::Store> store, std::optional<int> rank,
                       std::chrono::milliseconds leave_grace)
    : store_(std::move(store)), rank_(rank), leave_grace_(leave_grace) {
  GOSSIP_CHECK_ARG(store_, "gossip_ext: Departures: store must be a c10d Store, got None");
  GOSSIP_CHECK_ARG(!rank || *rank >= 0, "gossip_ext: Departures: rank must be >= 0, got ",
                   rank.value_or(0));
  check_timeout(leave_grace, "gossip_ext: Departures", "leave_grace", /*may_be_zero=*/true);
}

void Departures::announce(int rank) noexcept {
  try {
    store_->set(left_key(rank), std::vector<uint8_t>{'1'});
  } catch (...) {  // NOLINT(bugprone-empty-catch): peers then see a failure, as documented
  }
}

void Departures::leaving() noexcept {
  if (rank_) announce(*rank_);
}

bool Departures::has_left(int rank) const noexcept {
  try {
    return store_->check({left_key(rank)});
  } catch (...) {
    return false;  // no store to ask: the peer is not known to have left
  }
}

bool Departures::has_left_soon(int rank) const noexcept {
  const auto deadline = std::chrono::steady_clock::now() + leave_grace_;
  while (!has_left(rank)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

}  // namespace gossip
