// store_check_in, the NCCL transport's rendezvous before its blocking calls, over a c10d HashStore
// shared by ranks that run as threads.
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "common/error.h"
#include "transport/store_check_in.h"

namespace gossip {
namespace {

using namespace std::chrono_literals;

// Runs store_check_in on `ranks` of a group of `world_size` as threads; each slot of the result
// holds "" (returned) or the error's message.
std::vector<std::string> check_in(c10d::Store& store, const std::vector<int>& ranks,
                                  int world_size, std::chrono::milliseconds timeout) {
  std::vector<std::string> outcome(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        store_check_in(store, "group/connect/0", ranks[i], world_size, timeout, "connect");
      } catch (const TimeoutError& e) {
        outcome[i] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return outcome;
}

TEST(StoreCheckInTest, ReturnsOnceEveryRankHasCheckedIn) {
  c10d::HashStore store;
  const auto outcome = check_in(store, {0, 1, 2, 3}, 4, 10s);
  for (const std::string& error : outcome) EXPECT_EQ(error, "");
}

TEST(StoreCheckInTest, ARankThatNeverComesIsNamedAfterTheTimeout) {
  c10d::HashStore store;
  const auto start = std::chrono::steady_clock::now();
  const auto outcome = check_in(store, {0, 1, 3}, 4, 300ms);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, 250ms);
  EXPECT_LT(elapsed, 10s);
  for (const std::string& error : outcome) {
    EXPECT_NE(error.find("timed out after 300 ms waiting for ranks [2] to connect"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("group/connect/0"), std::string::npos) << error;
  }
}

TEST(StoreCheckInTest, KeysOfOneCheckInDoNotSatisfyAnother) {
  c10d::HashStore store;
  ASSERT_EQ(check_in(store, {0, 1}, 2, 10s), (std::vector<std::string>{"", ""}));
  // A second check-in under the same store and another key waits for its own keys.
  std::string error;
  try {
    store_check_in(store, "group/connect/1", 0, 2, 200ms, "connect");
  } catch (const TimeoutError& e) {
    error = e.what();
    // The missing ranks as data; a check-in is no gossip round.
    EXPECT_EQ(e.failure().peers, std::vector<int>{1});
    EXPECT_EQ(e.failure().round, std::nullopt);
    EXPECT_EQ(e.failure().timeout, std::optional(std::chrono::milliseconds(200)));
  }
  EXPECT_NE(error.find("ranks [1]"), std::string::npos) << error;
}

}  // namespace
}  // namespace gossip
