// The in-process transport on its own, one std::thread per rank: delivery and order across
// threads, non-blocking completion, abort, and simulate() on top of it. These tests, with the
// engine tests, are what ThreadSanitizer runs (ctest label `inproc`, tools/run_sanitizers.sh),
// so each one has several threads touching one hub at once.
#include <chrono>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "engine/simulate.h"
#include "transport/inproc/inproc_transport.h"
#include "run_ranks.h"

namespace gossip {
namespace {

constexpr std::chrono::seconds kWait{30};

// Runs body(rank) on one thread per rank and rethrows the first rank's error here. A failing rank
// aborts the hub so that no other rank waits for it until the timeout.
template <typename Body>
void run_ranks(const std::shared_ptr<InProcHub>& hub, Body body) {
  gossip::run_ranks(hub->world_size(), body,
                     [&](int, const std::string& what) { hub->abort(what); });
}

// What rank `src` sends as its `k`-th message to `dst` in `round`: distinct for every tuple.
double payload(int src, int dst, int64_t round, int k) {
  return src * 1e6 + dst * 1e4 + static_cast<double>(round) * 10 + k;
}

}  // namespace

// Every rank sends two messages to every other rank each round (same tag, so they must arrive in
// posting order) and reuses its send buffers at once, before anyone has received them.
TEST(InProcTransportTest, AllToAllRoundsArriveInPostingOrder) {
  constexpr int kWorld = 4;
  constexpr int kRounds = 20;
  constexpr int64_t kNumel = 64;
  auto hub = std::make_shared<InProcHub>(kWorld);
  run_ranks(hub, [&](int rank) {
    InProcTransport transport(hub, rank);
    for (int64_t round = 0; round < kRounds; ++round) {
      std::vector<PeerMessage> sends, recvs;
      std::vector<at::Tensor> received;
      for (int peer = 0; peer < kWorld; ++peer) {
        if (peer == rank) continue;
        for (int k = 0; k < 2; ++k) {
          sends.push_back({peer, at::full({kNumel}, payload(rank, peer, round, k), at::kDouble)});
          received.push_back(at::zeros({kNumel}, at::kDouble));
          recvs.push_back({peer, received.back()});
        }
      }
      std::vector<at::Tensor> sent;
      for (const PeerMessage& m : sends) sent.push_back(m.buffer);
      auto work = transport.exchange(std::move(sends), std::move(recvs), round);
      for (const at::Tensor& buffer : sent) buffer.fill_(-1.0);  // a send never holds the buffer
      work->wait(kWait);
      EXPECT_TRUE(work->is_completed());
      size_t j = 0;
      for (int peer = 0; peer < kWorld; ++peer) {
        if (peer == rank) continue;
        for (int k = 0; k < 2; ++k, ++j) {
          const double want = payload(peer, rank, round, k);
          EXPECT_EQ(received[j].min().item<double>(), want) << "rank " << rank << " from " << peer;
          EXPECT_EQ(received[j].max().item<double>(), want) << "rank " << rank << " from " << peer;
        }
      }
    }
  });
}

// is_completed() never blocks: a receiver may poll it while the sender is still working.
TEST(InProcTransportTest, IsCompletedPollsWhileTheSenderPosts) {
  auto hub = std::make_shared<InProcHub>(2);
  run_ranks(hub, [&](int rank) {
    InProcTransport transport(hub, rank);
    for (int64_t round = 0; round < 50; ++round) {
      if (rank == 0) {
        transport.exchange({{1, at::arange(8, at::kDouble).add_(round)}}, {}, round)->wait(kWait);
        continue;
      }
      const at::Tensor buffer = at::zeros({8}, at::kDouble);
      auto work = transport.exchange({}, {{0, buffer}}, round);
      const auto deadline = std::chrono::steady_clock::now() + kWait;
      while (!work->is_completed()) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "round " << round;
        std::this_thread::yield();
      }
      EXPECT_EQ(buffer[0].item<double>(), static_cast<double>(round));
      EXPECT_EQ(buffer[7].item<double>(), static_cast<double>(round + 7));
    }
  });
}

// abort() from another thread wakes every rank blocked in wait(), long before its timeout, and
// each of them raises the reason.
TEST(InProcTransportTest, AbortWakesEveryWaiter) {
  constexpr int kWorld = 4;
  auto hub = std::make_shared<InProcHub>(kWorld);
  std::vector<std::string> errors(kWorld);
  const auto begin = std::chrono::steady_clock::now();
  std::vector<std::thread> waiters;
  for (int rank = 1; rank < kWorld; ++rank) {
    waiters.emplace_back([&, rank] {
      InProcTransport transport(hub, rank);
      auto work = transport.exchange({}, {{0, at::zeros({4}, at::kFloat)}}, /*round=*/3);
      try {
        work->wait(std::chrono::minutes(5));
        errors[rank] = "wait returned without a message";
      } catch (const std::runtime_error& e) {
        errors[rank] = e.what();
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let some of them block
  hub->abort("rank 0 failed: injected");
  for (std::thread& waiter : waiters) waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(60));
  for (int rank = 1; rank < kWorld; ++rank) EXPECT_EQ(errors[rank], "rank 0 failed: injected");
  // Later calls fail the same way; a second abort does not change the reason.
  hub->abort("second reason");
  InProcTransport transport(hub, 1);
  auto work = transport.exchange({}, {{0, at::zeros({4}, at::kFloat)}}, 4);
  try {
    work->is_completed();
    ADD_FAILURE() << "is_completed() on an aborted hub did not raise";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank 0 failed: injected");
  }
}

// A message of the wrong size is refused by the receiver, naming the peer and the round.
TEST(InProcTransportTest, WrongSizedMessageIsRefused) {
  auto hub = std::make_shared<InProcHub>(2);
  InProcTransport sender(hub, 0), receiver(hub, 1);
  sender.exchange({{1, at::zeros({5}, at::kDouble)}}, {}, 7);
  auto work = receiver.exchange({}, {{0, at::zeros({4}, at::kDouble)}}, 7);
  try {
    work->wait(kWait);
    ADD_FAILURE() << "a 5-element message was copied into a 4-element buffer";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("peer 0"), std::string::npos) << message;
    EXPECT_NE(message.find("round 7"), std::string::npos) << message;
  }
}

TEST(InProcTransportTest, BadWorldSizeOrRankIsAValueError) {
  EXPECT_THROW(InProcHub(0), ValueError);
  auto hub = std::make_shared<InProcHub>(2);
  EXPECT_THROW(InProcTransport(hub, 2), ValueError);
  EXPECT_THROW(InProcTransport(hub, -1), ValueError);
}

// simulate(): every node on its own thread, writing its row of one shared result tensor. The
// one-peer exponential graph reaches the exact average after log2(n) rounds. The wide case runs
// the kernels' at::parallel_for above its grain (32768 elements) on every rank's thread at once.
TEST(SimulateTest, ReachesTheAverageOnItsThreads) {
  constexpr int kWorld = 8;
  for (int64_t width : {3, 100003}) {
    SCOPED_TRACE("width " + std::to_string(width));
    const at::Tensor values = at::arange(kWorld * width, at::kDouble).reshape({kWorld, width});
    EngineOptions options;
    options.timeout = kWait;
    const at::Tensor result = simulate(values, 3, options);
    ASSERT_EQ(result.size(0), 4);
    // Values are at most kWorld * width: allow a few fp64 roundings of that.
    const double error = result[3].sub(values.mean(0)).abs().max().item<double>();
    EXPECT_LE(error, 1e-12 * kWorld * width) << "after log2(n) rounds";
  }
}

}  // namespace gossip
