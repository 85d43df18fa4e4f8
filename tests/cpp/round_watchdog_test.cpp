// RoundWatchdog, the failure, timeout and teardown state machine of the NCCL transport, driven by
// real rounds of the in-process transport: a round is done when its receives have arrived.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/round_watchdog.h"

namespace gossip {
namespace {

using namespace std::chrono_literals;

// A posted in-process round as the watchdog sees it.
class InProcRound final : public WatchedRound {
 public:
  InProcRound(std::shared_ptr<Work> work, int64_t round, std::vector<int> peers)
      : WatchedRound(round, std::move(peers)), work_(std::move(work)) {}
  bool poll_done() override { return work_->is_completed(); }
  void on_done() override { released = true; }
  std::atomic<bool> released{false};

 private:
  std::shared_ptr<Work> work_;
};

// Two in-process ranks; rank 0's rounds receive from rank 1, whose sends the test controls.
struct Pair {
  std::shared_ptr<InProcHub> hub = std::make_shared<InProcHub>(2);
  InProcTransport rank0{hub, 0};
  InProcTransport rank1{hub, 1};

  std::shared_ptr<InProcRound> receive(int64_t round) {
    auto work = rank0.exchange({}, {{1, at::zeros({4})}}, round);
    return std::make_shared<InProcRound>(work, round, std::vector<int>{1});
  }
  void send(int64_t round) { rank1.exchange({{0, at::zeros({4})}}, {}, round); }
};

// The hooks, counting aborts and remembering whether every round had failed when one came.
struct Hooks {
  std::atomic<int> aborts{0};
  std::atomic<bool> failed_before_abort{true};
  std::vector<std::shared_ptr<InProcRound>> watched;
  std::atomic<bool> async_failure{false};

  RoundWatchdog make(std::chrono::milliseconds timeout) {
    return RoundWatchdog(
        {.rank = 0, .transport = "test", .timeout = timeout, .period = 5ms},
        [this] { return async_failure ? std::string("the link broke") : std::string(); },
        [this] {
          for (const auto& round : watched) {
            try {
              round->throw_if_failed();
              failed_before_abort = false;
            } catch (const std::exception&) {
            }
          }
          ++aborts;
        });
  }
};

// Waits for the watchdog's thread to fail the transport; false if it did not within `limit`.
bool fails_within(const RoundWatchdog& watchdog, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!watchdog.failed()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// Whether `round` itself has failed within `limit`. The watchdog records its failure, then fails
// its rounds with the lock released (fail_locked): a round may still be unfailed for a moment
// after watchdog.failed() says true.
bool round_fails_within(const WatchedRound& round, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (true) {
    try {
      round.throw_if_failed();
    } catch (const std::exception&) {
      return true;
    }
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(5ms);
  }
}

std::string error_of(const WatchedRound& round) {
  try {
    round.throw_if_failed();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(RoundWatchdogTest, CompletedRoundsAreRetiredAndDrainSucceeds) {
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(5s);
  auto round = pair.receive(0);
  watchdog.watch(round);
  pair.send(0);
  EXPECT_TRUE(watchdog.drain());
  EXPECT_TRUE(round->released);
  EXPECT_EQ(hooks.aborts, 0);
  EXPECT_NO_THROW(watchdog.throw_if_failed());
}

TEST(RoundWatchdogTest, DrainWaitsForARoundStillInFlight) {
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(5s);
  watchdog.watch(pair.receive(0));
  const auto start = std::chrono::steady_clock::now();
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    pair.send(0);
  });
  EXPECT_TRUE(watchdog.drain());  // a rank that finished first waits for its peer
  late.join();
  EXPECT_GE(std::chrono::steady_clock::now() - start, 150ms);
  EXPECT_EQ(hooks.aborts, 0);
}

TEST(RoundWatchdogTest, APeerThatOwesSeveralMessagesIsNamedOnce) {
  // A transport that posts a receive per message (NCCL, a large message in pieces) hands the
  // watchdog a peer per message; the timeout names each peer once.
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(200ms);
  auto work = pair.rank0.exchange({}, {{1, at::zeros({4})}}, 7);
  auto round = std::make_shared<InProcRound>(work, 7, std::vector<int>{1, 1, 1});
  EXPECT_EQ(round->recv_peers(), std::vector<int>{1});
  watchdog.watch(round);
  EXPECT_TRUE(fails_within(watchdog, 5s));
  ASSERT_TRUE(round_fails_within(*round, 5s));
  const std::string error = error_of(*round);
  EXPECT_NE(error.find("gossip round 7 waiting for messages from peers [1] ("), std::string::npos)
      << error;
}

TEST(RoundWatchdogTest, TheTimeoutCarriesThePeersTheRoundAndTheTimeoutAsData) {
  // The bindings set these as the Python exception's attributes (gossip_ext.PeerTimeoutError):
  // nobody reads them out of the message.
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(200ms);
  auto work = pair.rank0.exchange({}, {{1, at::zeros({4})}, {1, at::zeros({2})}}, 9);
  auto round = std::make_shared<InProcRound>(work, 9, std::vector<int>{1, 1});
  watchdog.watch(round);
  ASSERT_TRUE(fails_within(watchdog, 5s));
  ASSERT_TRUE(round_fails_within(*round, 5s));
  for (const std::function<void()>& raise : std::vector<std::function<void()>>{
           [&] { round->throw_if_failed(); }, [&] { watchdog.throw_if_failed(); }}) {
    try {
      raise();
      ADD_FAILURE() << "the round did not fail";
    } catch (const TimeoutError& e) {
      const PeerFailure& failure = e.failure();
      EXPECT_EQ(failure.peers, std::vector<int>{1});  // each peer once
      EXPECT_EQ(failure.round, std::optional<int64_t>(9));
      EXPECT_EQ(failure.transport, "test");
      EXPECT_EQ(failure.timeout, std::optional<std::chrono::milliseconds>(200ms));
    }
  }
}

TEST(RoundWatchdogTest, ARoundPastItsDeadlineFailsEveryRoundThenAbortsOnce) {
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(200ms);
  hooks.watched = {pair.receive(3), pair.receive(4)};
  for (const auto& round : hooks.watched) watchdog.watch(round);
  EXPECT_TRUE(fails_within(watchdog, 5s));
  EXPECT_FALSE(watchdog.drain());
  EXPECT_EQ(hooks.aborts, 1);
  EXPECT_TRUE(hooks.failed_before_abort);  // whoever the abort wakes finds the error
  for (const auto& round : hooks.watched) {
    const std::string error = error_of(*round);
    EXPECT_NE(error.find("gossip round 3 waiting for messages from peers [1]"), std::string::npos)
        << error;
  }
  EXPECT_THROW(watchdog.throw_if_failed(), TimeoutError);
  EXPECT_THROW(watchdog.watch(pair.receive(5)), TimeoutError);  // sticky
  watchdog.fail(std::make_exception_ptr(std::runtime_error("later")));
  EXPECT_EQ(hooks.aborts, 1);  // the first failure wins; one abort
}

TEST(RoundWatchdogTest, AWaitTightensTheDeadline) {
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(60s);
  auto round = pair.receive(0);
  watchdog.watch(round);
  watchdog.tighten_deadline(*round, std::chrono::steady_clock::now() + 100ms);
  watchdog.tighten_deadline(*round, std::chrono::steady_clock::now() + 60s);  // never later
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(watchdog.drain());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_NE(error_of(*round).find("round 0"), std::string::npos);
}

TEST(RoundWatchdogTest, AnAsynchronousBackendErrorFailsTheRounds) {
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(60s);
  auto round = pair.receive(0);
  hooks.watched = {round};
  watchdog.watch(round);
  hooks.async_failure = true;
  EXPECT_FALSE(watchdog.drain());
  EXPECT_NE(error_of(*round).find("test failed asynchronously: the link broke"),
            std::string::npos);
  EXPECT_EQ(hooks.aborts, 1);
  EXPECT_TRUE(hooks.failed_before_abort);
}

TEST(RoundWatchdogTest, AFailureTheTransportSawItselfAbortsAndSticks) {
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(60s);
  auto round = pair.receive(0);
  hooks.watched = {round};
  watchdog.watch(round);
  watchdog.fail(std::make_exception_ptr(TimeoutError("posting round 1 timed out")));
  EXPECT_EQ(hooks.aborts, 1);
  EXPECT_EQ(error_of(*round), "posting round 1 timed out");
  EXPECT_THROW(watchdog.throw_if_failed(), TimeoutError);
  EXPECT_FALSE(watchdog.drain());
}

TEST(RoundWatchdogTest, ARoundDiesOnTheThreadThatReleasesIt) {
  // The watchdog's thread finds the round done but never drops the last reference: a round's
  // buffers may need the caller's GIL to be released.
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(5s);
  auto round = pair.receive(0);
  const std::weak_ptr<InProcRound> alive = round;
  watchdog.watch(std::move(round));
  pair.send(0);
  EXPECT_TRUE(watchdog.drain());
  {
    const std::shared_ptr<InProcRound> held = alive.lock();  // done, but kept for release_done()
    ASSERT_NE(held, nullptr);
    EXPECT_TRUE(held->released.load());
  }
  watchdog.release_done();
  EXPECT_TRUE(alive.expired());
}

TEST(RoundWatchdogTest, FailedRoundsAreAlsoLeftForTheCallerToRelease) {
  Pair pair;
  Hooks hooks;
  RoundWatchdog watchdog = hooks.make(100ms);
  auto round = pair.receive(0);
  const std::weak_ptr<InProcRound> alive = round;
  watchdog.watch(std::move(round));
  EXPECT_TRUE(fails_within(watchdog, 5s));
  EXPECT_FALSE(watchdog.drain());
  EXPECT_FALSE(alive.expired());
  watchdog.release_done();
  EXPECT_TRUE(alive.expired());
}

TEST(RoundWatchdogTest, ThePrepareHookRunsFirstOnTheWatchdogsThread) {
  std::atomic<bool> prepared{false};
  std::thread::id where;
  std::atomic<bool> polled_unprepared{false};
  struct Probe final : WatchedRound {
    Probe(std::atomic<bool>& prepared, std::atomic<bool>& unprepared)
        : WatchedRound(0, {1}), prepared_(prepared), unprepared_(unprepared) {}
    bool poll_done() override {
      if (!prepared_) unprepared_ = true;
      return true;
    }
    std::atomic<bool>& prepared_;
    std::atomic<bool>& unprepared_;
  };
  RoundWatchdog watchdog({.timeout = 5s,
                          .period = 5ms,
                          .prepare_thread =
                              [&] {
                                where = std::this_thread::get_id();
                                prepared = true;
                              }},
                         {}, {});
  watchdog.watch(std::make_shared<Probe>(prepared, polled_unprepared));
  EXPECT_TRUE(watchdog.drain());
  EXPECT_TRUE(prepared);
  EXPECT_FALSE(polled_unprepared);
  EXPECT_NE(where, std::this_thread::get_id());
}

TEST(RoundWatchdogTest, APrepareHookThatThrowsFailsTheWatchdog) {
  RoundWatchdog watchdog(
      {.timeout = 5s,
       .period = 5ms,
       .prepare_thread = [] { throw std::runtime_error("no such device"); }},
      {}, {});
  EXPECT_TRUE(fails_within(watchdog, 5s));
  EXPECT_THROW(watchdog.throw_if_failed(), std::runtime_error);
}

TEST(RoundWatchdogTest, OptionsAreChecked) {
  EXPECT_THROW(RoundWatchdog({.timeout = 0ms}, {}, {}), ValueError);
  EXPECT_THROW(RoundWatchdog({.timeout = 1s, .period = 0ms}, {}, {}), ValueError);
}

}  // namespace
}  // namespace gossip
