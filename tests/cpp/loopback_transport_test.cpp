// LoopbackTransport over the in-process transport: one process plays a rank of a larger world,
// its messages going to itself. The same decorator runs the NCCL transport's rounds on one GPU
// (tests/gpu/test_nccl_gossip.py); here it runs on the CPU in every CI run.
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "engine/gossip_engine.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/loopback/loopback_transport.h"

namespace gossip {
namespace {

using namespace std::chrono_literals;

struct Config {
  const char* name;
  MixingOptions mixing;
  bool synchronous;
  std::optional<at::ScalarType> message;
};

EngineOptions options_for(const Config& c) {
  EngineOptions options;
  options.graph = {.kind = GraphKind::kNPeerDynamicDirectedExponential, .peers_per_itr = 2};
  options.mixing = c.mixing;
  options.synchronous = c.synchronous;
  options.message_dtype = c.message;
  options.timeout = 300ms;
  return options;
}

std::shared_ptr<LoopbackTransport> loopback(int rank, int world_size) {
  auto hub = std::make_shared<InProcHub>(1);
  return std::make_shared<LoopbackTransport>(std::make_shared<InProcTransport>(hub, 0), rank,
                                             world_size);
}

const std::vector<Config> kConfigs = {
    {"sent in place", {.kind = MixingKind::kUniform}, true, {}},
    {"overlap", {.kind = MixingKind::kUniform}, false, {}},
    {"travelling weights", {.kind = MixingKind::kSelfWeight, .self_weight = 0.3}, true, {}},
    {"compressed", {.kind = MixingKind::kUniform}, true, at::kBFloat16},
    {"compressed overlap", {.kind = MixingKind::kUniform}, false, at::kHalf},
};

// A rank that absorbs its own shares keeps z and w: every message crossed the transport, and
// several dtype groups of odd sizes each sent and received their own messages.
TEST(LoopbackTransportTest, ARankThatAbsorbsItsOwnSharesKeepsItsModel) {
  for (const Config& c : kConfigs) {
    SCOPED_TRACE(c.name);
    const std::vector<at::Tensor> params = {at::randn({7}, at::kFloat),
                                            at::randn({3, 5}, at::kDouble)};
    std::vector<at::Tensor> before;
    for (const at::Tensor& p : params) before.push_back(p.clone());
    GossipEngine engine(params, {"a", "b"}, loopback(2, 5), options_for(c));
    for (int t = 0; t < 4; ++t) {
      engine.start_round();
      engine.finish_round();
    }
    EXPECT_EQ(engine.round(), 4);
    EXPECT_GT(engine.bytes_sent(), 0);
    EXPECT_NEAR(engine.ps_weight().item<double>(), 1.0, 1e-12);
    const double tol = c.message ? 1e-5 : 1e-6;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i], before[i], tol, tol)) << "parameter " << i;
    }
  }
}

// A send that never comes: the receive times out naming the peer and the round, and the
// parameters are still the model (Note [The parameters are the model]).
TEST(LoopbackTransportTest, ADroppedSendTimesOutAndLeavesTheModel) {
  for (const Config& c : kConfigs) {
    SCOPED_TRACE(c.name);
    const at::Tensor param = at::randn({9}, at::kFloat);
    auto transport = loopback(1, 4);
    GossipEngine engine({param}, {"p"}, transport, options_for(c));
    engine.start_round();
    engine.finish_round();
    const at::Tensor model = param.clone();
    transport->drop_sends(1);
    engine.start_round();
    try {
      engine.finish_round();
      ADD_FAILURE() << "a round missing a message was absorbed";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("gossip round 1 waiting for messages from peers [0]"),
                std::string::npos)
          << e.what();
    }
    if (c.synchronous || !c.message) EXPECT_TRUE(at::equal(param, model));
    EXPECT_THROW(engine.synchronize(), TimeoutError);  // sticky
  }
}

TEST(LoopbackTransportTest, ANonFiniteParameterIsCaughtOnItsWayBack) {
  const at::Tensor param = at::randn({5}, at::kFloat);
  param[3] = std::numeric_limits<float>::infinity();
  GossipEngine engine({param}, {"p"}, loopback(0, 3),
                      options_for({"sent in place", {.kind = MixingKind::kUniform}, true, {}}));
  engine.start_round();
  EXPECT_THROW(engine.finish_round(), NonFiniteError);
}

// A world of one that records what it is asked to connect, as the NCCL transport would connect.
class RecordingSelf final : public Transport {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage>, std::vector<PeerMessage>,
                                 int64_t) override {
    throw std::logic_error("not used");
  }
  std::string name() const override { return "recording"; }
  void connect_peers(const std::vector<int>& peers) override { connected.push_back(peers); }
  std::vector<std::vector<int>> connected;
};

TEST(LoopbackTransportTest, ConnectingPeersConnectsTheInnerRankToItself) {
  auto inner = std::make_shared<RecordingSelf>();
  LoopbackTransport loopback(inner, /*rank=*/2, /*world_size=*/5);
  loopback.connect_peers({0, 1, 3, 4});
  loopback.connect_peers({});
  EXPECT_EQ(inner->connected, (std::vector<std::vector<int>>{{0}, {}}));
}

TEST(LoopbackTransportTest, ArgumentsAreChecked) {
  auto hub = std::make_shared<InProcHub>(2);
  EXPECT_THROW(LoopbackTransport(std::make_shared<InProcTransport>(hub, 0), 0, 3), ValueError);
  EXPECT_THROW(loopback(3, 3), ValueError);
  EXPECT_THROW(loopback(0, 2)->drop_sends(-1), ValueError);
}

}  // namespace
}  // namespace gossip
