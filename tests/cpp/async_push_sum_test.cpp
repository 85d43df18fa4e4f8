// Asynchronous push-sum (engine/async_push_sum.h) with its ranks as threads over the in-process
// transport, so that ThreadSanitizer (ctest label `inproc`) sees the engine's calls beside its
// channels' threads. What it promises, against arithmetic done here: mass conserved exactly (the
// weights sum to the number of workers at quiescence and the weighted mean of the models is the
// mean of what they held), a share that could not be sent kept whole by its sender, a NaN refused
// before it is absorbed, and a silent peer named with its round.
#include <chrono>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "common/error.h"
#include "engine/async_push_sum.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/mailbox/departures.h"
#include "run_ranks.h"

namespace gossip {
namespace {

using std::chrono::milliseconds;

at::Tensor initial(int rank, int64_t numel = 300) {
  return at::linspace(-1.0, 1.0, numel, at::kFloat) * (rank + 1) + rank;
}

AsyncOptions options(std::optional<int64_t> staleness, milliseconds timeout = milliseconds(20000)) {
  AsyncOptions o;
  o.staleness = staleness;
  o.timeout = timeout;
  return o;
}

// Every rank gossips some rounds, then settles with the counts gathered here.
TEST(AsyncPushSum, ConservesTheMassExactlyAtQuiescence) {
  for (std::optional<int64_t> staleness : {std::optional<int64_t>(), std::optional<int64_t>(1)}) {
    constexpr int n = 4;
    auto hub = std::make_shared<InProcHub>(n);
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<at::Tensor> params(n);
    std::vector<std::unique_ptr<AsyncPushSum>> engines(n);
    for (int r = 0; r < n; ++r) {
      params[r] = initial(r).to(at::kDouble);
      engines[r] = std::make_unique<AsyncPushSum>(
          std::vector<at::Tensor>{params[r]}, std::vector<std::string>{"w"},
          std::make_shared<InProcTransport>(hub, r), std::make_shared<Departures>(store, r),
          options(staleness));
    }
    // Without a bound the ranks run as many rounds as they like; a bound makes a rank wait for
    // its peers' rounds, so there every rank runs as many.
    run_ranks(n, [&](int r) {
      const int rounds = staleness ? 6 : 5 + r;
      for (int round = 0; round < rounds; ++round) engines[r]->start_round();
    });
    std::vector<std::vector<int64_t>> sent(n);
    for (int r = 0; r < n; ++r) sent[r] = engines[r]->sent_counts();
    run_ranks(n, [&](int r) {
      std::vector<int64_t> to_me(n);
      for (int s = 0; s < n; ++s) to_me[s] = sent[s][r];
      engines[r]->settle(to_me);
    });
    double weights = 0.0;
    at::Tensor mean = at::zeros({300}, at::kDouble), expected = at::zeros({300}, at::kDouble);
    for (int r = 0; r < n; ++r) {
      weights += engines[r]->weight();
      mean += engines[r]->weight() * engines[r]->groups()[0].flat;
      expected += initial(r).to(at::kDouble);
    }
    EXPECT_NEAR(weights, n, 1e-12);
    EXPECT_TRUE(at::allclose(mean / n, expected / n, 0, 1e-12));
    for (int r = 0; r < n; ++r) engines[r]->abandon("done");
  }
}

// Sends fail as they are posted, as gloo's do once a peer's connection has closed.
class ClosedSends final : public Transport {
 public:
  explicit ClosedSends(std::shared_ptr<Transport> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> s, std::vector<PeerMessage> r,
                                 int64_t round) override {
    return inner_->exchange(std::move(s), std::move(r), round);
  }
  std::string name() const override { return "closed sends"; }
  std::shared_ptr<Work> post_send(int peer, at::Tensor, int64_t) override {
    throw std::runtime_error(detail::str_cat("Connection closed by peer ", peer));
  }
  std::shared_ptr<Work> post_recv(int peer, at::Tensor buffer, int64_t tag) override {
    return inner_->post_recv(peer, std::move(buffer), tag);
  }

 private:
  std::shared_ptr<Transport> inner_;
};

// Flattening makes the parameters views of the engine's buffers, so the arguments are checked
// first: a construction refused leaves the caller's parameters where and as they were.
TEST(AsyncPushSum, ARefusedConstructionLeavesTheParametersAsTheyWere) {
  auto hub = std::make_shared<InProcHub>(2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  const at::Tensor param = initial(0);
  const at::Tensor values = param.clone();
  const void* storage = param.data_ptr();
  const auto build = [&](std::shared_ptr<Transport> transport,
                         std::shared_ptr<Departures> departures, AsyncOptions o) {
    AsyncPushSum engine(std::vector<at::Tensor>{param}, std::vector<std::string>{"w"},
                        std::move(transport), std::move(departures), std::move(o));
  };
  auto transport = std::make_shared<InProcTransport>(hub, 0);
  auto departures = std::make_shared<Departures>(store, 0);
  EXPECT_THROW(build(nullptr, departures, options(std::nullopt)), ValueError);
  EXPECT_THROW(build(transport, nullptr, options(std::nullopt)), ValueError);
  EXPECT_THROW(build(transport, departures, options(-1)), ValueError);
  EXPECT_THROW(build(transport, departures, options(std::nullopt, milliseconds(-1))), ValueError);
  EXPECT_EQ(param.data_ptr(), storage);
  EXPECT_TRUE(at::equal(param, values));
}

TEST(AsyncPushSum, AShareThatCouldNotBeSentStaysWholeWithItsSender) {
  // Rank 1 said it leaves and its connection closed between the round's look at its outbox and
  // the send: rank 0 keeps the share, its rounding included, and its weight and model are what
  // they were.
  for (const char* format : {"none", "int8"}) {
    auto hub = std::make_shared<InProcHub>(2);
    auto store = c10::make_intrusive<c10d::HashStore>();
    Departures(store, 1).leaving();
    at::Tensor param = initial(0);
    AsyncOptions o = options(std::nullopt);
    if (std::string(format) == "int8") o.message_format = BlockFormat::kInt8;
    AsyncPushSum engine({param}, {"w"},
                        std::make_shared<ClosedSends>(std::make_shared<InProcTransport>(hub, 0)),
                        std::make_shared<Departures>(store, 0, milliseconds(50)), o);
    engine.start_round();
    EXPECT_EQ(engine.weight(), 1.0) << format;
    EXPECT_EQ(engine.counts().sent, 0) << format;
    EXPECT_EQ(engine.bytes_sent(), 0) << format;
    EXPECT_TRUE(at::allclose(engine.groups()[0].flat, initial(0), 0, 1e-6)) << format;
  }
}

TEST(AsyncPushSum, ANaNIsRefusedBeforeItIsAbsorbedAndNamesItsSender) {
  auto hub = std::make_shared<InProcHub>(2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<at::Tensor> params = {initial(0), initial(1)};
  params[1][7] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::unique_ptr<AsyncPushSum>> engines(2);
  for (int r = 0; r < 2; ++r) {
    AsyncOptions o = options(/*staleness=*/0);
    o.check_finite = r == 0;  // rank 1 sends its NaN; rank 0 must catch it
    engines[r] = std::make_unique<AsyncPushSum>(
        std::vector<at::Tensor>{params[r]}, std::vector<std::string>{"w"},
        std::make_shared<InProcTransport>(hub, r), std::make_shared<Departures>(store, r), o);
  }
  std::vector<std::string> errors(2);
  at::Tensor before;
  run_ranks(2, [&](int r) {
    try {
      engines[r]->start_round();
    } catch (const NonFiniteError& e) {
      errors[r] = e.what();
      EXPECT_EQ(e.failure().peers, std::vector<int>{1});
      EXPECT_EQ(e.failure().round, 1);
    }
  });
  EXPECT_NE(errors[0].find("from peers [1]"), std::string::npos) << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
  // Rank 0 holds its own model (its send kept nothing lossy), untouched by the refused absorb.
  EXPECT_TRUE(at::equal(engines[0]->groups()[0].flat, initial(0)));
  EXPECT_THROW(engines[0]->finish_round(), NonFiniteError);  // and stays failed
  for (auto& e : engines) e->abandon("done");
}

TEST(AsyncPushSum, ASilentPeerIsNamedWithItsRound) {
  // Rank 1 never starts: rank 0, bound to wait for its round 0, names it after the timeout.
  auto hub = std::make_shared<InProcHub>(2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  AsyncPushSum engine({initial(0)}, {"w"}, std::make_shared<InProcTransport>(hub, 0),
                      std::make_shared<Departures>(store, 0), options(0, milliseconds(300)));
  try {
    engine.start_round();
    FAIL() << "a bound waited for a silent peer without an error";
  } catch (const TimeoutError& e) {
    EXPECT_EQ(e.failure().peers, std::vector<int>{1});
    EXPECT_EQ(e.failure().round, 0);
  }
  EXPECT_THROW(engine.finish_round(), TimeoutError);
}

}  // namespace
}  // namespace gossip
