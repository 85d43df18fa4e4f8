// The channels of asynchronous gossip (transport/mailbox) over the in-process transport: each
// Mailbox and Outbox runs a thread of its own while the test's thread takes, posts and waits, so
// ThreadSanitizer (ctest label `inproc`) sees both sides. What they promise: messages in the
// sender's order with the rounds their headers carry, the flow-control limit and its lifting, a
// silent peer named with its round and the timeout (by a wait, or by the checks of a worker that
// keeps stepping, but not after a pause of its own), a peer that left let go without an error, a
// failure seen as a receive is posted, and close() releasing a thread that waits.
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "common/error.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/mailbox/departures.h"
#include "transport/mailbox/mailbox.h"

namespace gossip {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kLong{20000};
constexpr int64_t kBytes = 64;

// A message of `kBytes` whose header carries `round` and whose first value byte is `mark`.
at::Tensor message(int64_t round, uint8_t mark = 0) {
  at::Tensor bytes = at::zeros({kBytes}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>() + MessageHeader::kRoundOffset, &round, sizeof(round));
  bytes.data_ptr<uint8_t>()[MessageHeader::kBytes] = mark;
  return bytes;
}

struct Pair {
  std::shared_ptr<InProcHub> hub = std::make_shared<InProcHub>(2);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::shared_ptr<Transport> t0 = std::make_shared<InProcTransport>(hub, 0);
  std::shared_ptr<Transport> t1 = std::make_shared<InProcTransport>(hub, 1);
  std::shared_ptr<Departures> d0 = std::make_shared<Departures>(store, 0, milliseconds(50));
  std::shared_ptr<Departures> d1 = std::make_shared<Departures>(store, 1, milliseconds(50));
};

template <typename Done>
void eventually(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(2));
  }
  ASSERT_TRUE(done());
}

TEST(Mailbox, TakesTheSendersMessagesInOrderWithTheirRoundsAndWalksItsSchedule) {
  Pair p;
  // Rank 0 sends to rank 1 in its even rounds (a schedule of period 2).
  Mailbox box(p.t1, p.d1, 0, /*generation=*/3, kLong, kBytes, {true, false}, 0, std::nullopt);
  Outbox out(p.t0, p.d0, 1, /*generation=*/3, kLong);
  EXPECT_EQ(box.expected(), 0);
  for (int64_t round : {0, 2, 4}) ASSERT_TRUE(out.post(round, message(round, round + 1)));
  box.wait_for(3);
  EXPECT_EQ(box.received(), 3);
  EXPECT_EQ(box.expected(), 6);
  EXPECT_EQ(box.arrival_times().size(), 3u);
  auto first = box.take(2);  // a staleness bound: rounds <= 2 only
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].round, 0);
  EXPECT_EQ(first[1].round, 2);
  EXPECT_EQ(first[1].message.data_ptr<uint8_t>()[MessageHeader::kBytes], 3);
  auto rest = box.take(std::nullopt);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].round, 4);
  out.wait_until_past(std::nullopt);
  EXPECT_EQ(out.sent(), 3);
  EXPECT_EQ(out.backlog(), 0);
}

TEST(Mailbox, HoldsAtMostItsLimitUntakenAndAWaitLiftsIt) {
  Pair p;
  Mailbox box(p.t1, p.d1, 0, 0, kLong, kBytes, {true}, 0, /*held_limit=*/1);
  Outbox out(p.t0, p.d0, 1, 0, kLong);
  for (int64_t round = 0; round < 3; ++round) ASSERT_TRUE(out.post(round, message(round)));
  eventually([&] { return box.received() == 1; });
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(box.received(), 1) << "a second receive was posted past the limit";
  ASSERT_EQ(box.take(std::nullopt).size(), 1u);
  eventually([&] { return box.received() == 2; });
  box.wait_for(3);  // lifts the limit while it waits
  EXPECT_EQ(box.take(std::nullopt).size(), 2u);
}

TEST(Mailbox, ASilentPeerIsNamedWithItsRoundAndTheTimeout) {
  Pair p;
  Mailbox box(p.t1, p.d1, 0, 0, milliseconds(200), kBytes, {true}, 5, std::nullopt);
  try {
    box.wait_for(1);
    FAIL() << "waited for a message that never came without an error";
  } catch (const TimeoutError& e) {
    EXPECT_EQ(e.failure().peers, std::vector<int>{0});
    EXPECT_EQ(e.failure().round, 5);
    EXPECT_EQ(e.failure().timeout, milliseconds(200));
    EXPECT_NE(std::string(e.what()).find("peer 0"), std::string::npos) << e.what();
  }
  // This worker gave up and said it leaves (Note [A failure closes more than its pair]); the
  // receive itself has no deadline (Note [Silence is measured while this worker trains]), so
  // the channel has not failed on its own.
  EXPECT_TRUE(p.d0->has_left(1));
  EXPECT_NO_THROW(box.raise_if_failed());
}

// check_silence at every step of a worker that keeps stepping names a peer silent for the
// timeout, and keeps the error.
TEST(Mailbox, APeerSilentWhileThisWorkerStepsIsNamedByTheChecks) {
  Pair p;
  Mailbox box(p.t1, p.d1, 0, 0, milliseconds(200), kBytes, {true}, 5, std::nullopt);
  const auto began = std::chrono::steady_clock::now();
  std::optional<TimeoutError> seen;
  while (!seen && std::chrono::steady_clock::now() - began < std::chrono::seconds(5)) {
    try {
      box.check_silence();
    } catch (const TimeoutError& e) {
      seen = e;
    }
    std::this_thread::sleep_for(milliseconds(10));  // a step
  }
  const auto took = std::chrono::steady_clock::now() - began;
  ASSERT_TRUE(seen) << "a peer silent for 25 timeouts was never named";
  EXPECT_GE(took, milliseconds(200));
  EXPECT_LT(took, milliseconds(2000));
  EXPECT_EQ(seen->failure().peers, std::vector<int>{0});
  EXPECT_EQ(seen->failure().round, 5);
  EXPECT_EQ(seen->failure().timeout, milliseconds(200));
  EXPECT_THROW(box.raise_if_failed(), TimeoutError);
  EXPECT_TRUE(p.d0->has_left(1));
}

// A pause of this worker's own longer than the timeout (every worker in the user's barrier) is no
// silence: the clock starts again at the next step, and a message then is on time.
TEST(Mailbox, APauseOfThisWorkersOwnIsNoSilence) {
  Pair p;
  Mailbox box(p.t1, p.d1, 0, 0, milliseconds(200), kBytes, {true}, 0, std::nullopt);
  box.check_silence();
  std::this_thread::sleep_for(milliseconds(500));  // no step: a barrier of the user's
  for (int step = 0; step < 10; ++step) {
    EXPECT_NO_THROW(box.check_silence()) << "step " << step;
    std::this_thread::sleep_for(milliseconds(10));
  }
  Outbox out(p.t0, p.d0, 1, 0, kLong);
  ASSERT_TRUE(out.post(0, message(0)));
  eventually([&] { return box.received() == 1; });
  EXPECT_NO_THROW(box.check_silence());
  EXPECT_FALSE(p.d0->has_left(1));
  EXPECT_NO_THROW(box.raise_if_failed());
}

TEST(Mailbox, APeerThatSaidItLeftEndsTheChannelWithoutAnError) {
  Pair p;
  Mailbox box(p.t1, p.d1, 0, 0, kLong, kBytes, {true}, 0, std::nullopt);
  p.d0->leaving();
  box.wait_for(1);  // returns: the peer left (seen within half a second)
  EXPECT_TRUE(box.ended());
  EXPECT_NO_THROW(box.raise_if_failed());
  EXPECT_TRUE(box.take(std::nullopt).empty());
}

// Every connection closed already: gloo then fails a receive or a send as it is posted, not in
// its wait.
class ClosedTransport final : public Transport {
 public:
  int rank() const override { return 2; }
  int world_size() const override { return 4; }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage>, std::vector<PeerMessage>,
                                 int64_t) override {
    throw std::runtime_error("closed");
  }
  std::string name() const override { return "closed"; }
  std::shared_ptr<Work> post_send(int peer, at::Tensor, int64_t) override { refuse(peer); }
  std::shared_ptr<Work> post_recv(int peer, at::Tensor, int64_t) override { refuse(peer); }

 private:
  [[noreturn]] static void refuse(int peer) {
    throw std::runtime_error(detail::str_cat("Connection closed by peer ", peer));
  }
};

TEST(Mailbox, AFailureAsTheReceiveIsPostedIsThePeersErrorSeenAtOnce) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto departures = std::make_shared<Departures>(store, 2, milliseconds(50));
  auto closed = std::make_shared<ClosedTransport>();
  Mailbox box(closed, departures, 1, 0, kLong, kBytes, {true}, 0, std::nullopt);
  eventually([&] {
    try {
      box.raise_if_failed();
      return false;
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.failure().peers, std::vector<int>{1});
      EXPECT_FALSE(e.failure().timeout.has_value()) << "no timeout was waited out";
      EXPECT_NE(std::string(e.what()).find("saw its connection close"), std::string::npos);
      return true;
    }
  });
  EXPECT_TRUE(departures->has_left(2)) << "this worker says it leaves, as after any failure";
  Outbox out(closed, departures, 3, 0, kLong);
  EXPECT_THROW(out.post(0, message(0)), TimeoutError);
}

TEST(Mailbox, CloseReleasesAWaitingThreadAndFailNamesWhy) {
  Pair p;
  auto box = std::make_unique<Mailbox>(p.t1, p.d1, 0, 0, kLong, kBytes,
                                       std::vector<bool>{true}, 0, std::nullopt);
  std::this_thread::sleep_for(milliseconds(20));  // its receive is posted and waits
  const auto started = std::chrono::steady_clock::now();
  box->fail("the engine was closed", 7);
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(2));
  try {
    box->raise_if_failed();
    FAIL() << "a failed channel raised nothing";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("the engine was closed"), std::string::npos);
    EXPECT_EQ(e.failure().round, 7);
    EXPECT_TRUE(e.failure().peers.empty());
  }
  box.reset();  // a second close, in the destructor, finds the thread joined
}

}  // namespace
}  // namespace gossip
