// What the constructors refuse before allocating or waiting on a size a user handed in
// (common/limits.h), and parameters that overlap in memory, which flattening would untie
// (engine/flat_parameters.h). tests/test_bindings_refuse.py calls every binding the same way.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "common/limits.h"
#include "engine/flat_parameters.h"
#include "engine/gossip_engine.h"
#include "engine/simulate.h"
#include "topology/graph.h"
#include "topology/mixing.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/loopback/loopback_transport.h"

namespace gossip {
namespace {

// The message of what `body` throws, which must be a ValueError (ours or torch's).
template <typename Body>
std::string value_error(Body body) {
  try {
    body();
  } catch (const ValueError& e) {
    return e.what();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "no ValueError";
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

EngineOptions ring_options() {
  return EngineOptions{.graph = {.kind = GraphKind::kRing}, .mixing = {}};
}

TEST(BoundsTest, AWorldBeyondTheCapIsRefusedBeforeAnythingIsAllocated) {
  const int huge = 100'000'000;
  EXPECT_TRUE(contains(value_error([&] { InProcHub hub(huge); }),
                       "world_size must be <= 65536, got 100000000"));
  EXPECT_TRUE(contains(value_error([&] { Graph graph({.kind = GraphKind::kRing}, huge); }),
                       "got 100000000"));
  auto inner = std::make_shared<InProcTransport>(std::make_shared<InProcHub>(1), 0);
  EXPECT_TRUE(contains(value_error([&] { LoopbackTransport loopback(inner, 0, huge); }),
                       "world_size must be <= 65536"));
  // The cap itself is a world.
  EXPECT_EQ(InProcHub(kMaxWorldSize).world_size(), kMaxWorldSize);
  EXPECT_EQ(Graph({.kind = GraphKind::kHypercube}, kMaxWorldSize).world_size(), kMaxWorldSize);
}

TEST(BoundsTest, ALinearGraphsScheduleIsCappedNotItsWorld) {
  const std::string message =
      value_error([] { Graph graph({.kind = GraphKind::kDynamicDirectedLinear}, 8192); });
  EXPECT_TRUE(contains(message, "DynamicDirectedLinearGraph: world_size 8192")) << message;
  EXPECT_TRUE(contains(message, "use an exponential graph")) << message;
  EXPECT_EQ(Graph({.kind = GraphKind::kDynamicDirectedExponential}, 8192).world_size(), 8192);
}

TEST(BoundsTest, AKindThatIsNoEnumeratorIsRefused) {
  EXPECT_TRUE(contains(value_error([] { validate(GraphOptions{.kind = GraphKind(99)}); }),
                       "kind must be one of GraphKind's values, got 99"));
  EXPECT_TRUE(contains(value_error([] { validate(MixingOptions{.kind = MixingKind(7)}); }),
                       "kind must be one of MixingKind's values, got 7"));
  EXPECT_TRUE(contains(value_error([] { mixing_weights({}, 100'000'000); }),
                       "num_out_peers must be < 65536"));
}

TEST(BoundsTest, ANullHubIsRefused) {
  EXPECT_TRUE(contains(value_error([] { InProcTransport transport(nullptr, 0); }),
                       "hub must be an InProcHub, got None"));
}

TEST(BoundsTest, TimeoutsAreBounded) {
  EngineOptions options = ring_options();
  options.timeout = std::chrono::hours(24 * 365 * 1000);
  auto transport = std::make_shared<InProcTransport>(std::make_shared<InProcHub>(1), 0);
  const std::vector<at::Tensor> params{at::zeros({2})};
  EXPECT_TRUE(contains(value_error([&] { GossipEngine engine(params, {"w"}, transport, options); }),
                       "timeout must be at most"));
}

TEST(BoundsTest, SimulateBoundsItsRanksAndRounds) {
  EXPECT_TRUE(contains(value_error([] { simulate(at::zeros({5000, 1}), 1, ring_options()); }),
                       "values has 5000 rows"));
  EXPECT_TRUE(
      contains(value_error([] { simulate(at::zeros({2, 1}), int64_t{1} << 40, ring_options()); }),
               "rounds must be <= 16777216"));
}

TEST(BoundsTest, OverlappingParametersAreRefusedNamingBoth) {
  const at::Tensor storage = at::zeros({6});
  const std::string message = value_error([&] {
    check_disjoint_parameters({at::zeros({2}), storage, storage.view({2, 3})}, {"a", "b", "c"});
  });
  EXPECT_TRUE(contains(message, "'b' (parameters[1]) and 'c' (parameters[2]) overlap")) << message;
  // Without names, by index; a partial overlap of two slices.
  EXPECT_TRUE(contains(value_error([&] {
                         check_disjoint_parameters(
                             {storage.narrow(0, 1, 3), storage.narrow(0, 3, 3)}, {});
                       }),
                       "gossip_ext: parameters[0] and parameters[1] overlap"));
  // A column and a row of one matrix share one element.
  const at::Tensor matrix = at::zeros({3, 2});
  EXPECT_TRUE(contains(value_error([&] {
                         check_disjoint_parameters({matrix.select(1, 0), matrix.select(0, 2)}, {});
                       }),
                       "overlap"));
}

TEST(BoundsTest, DisjointPartsOfOneStorageAreFine) {
  const at::Tensor storage = at::zeros({6});
  check_disjoint_parameters({storage.narrow(0, 0, 3), storage.narrow(0, 3, 3)}, {});
  const at::Tensor matrix = at::zeros({3, 2});
  check_disjoint_parameters({matrix.select(1, 1), matrix.select(1, 0)}, {});  // interleaved
  check_disjoint_parameters({storage.narrow(0, 0, 0), storage}, {});          // empty
}

TEST(BoundsTest, FlatteningRefusesOverlapAndReflattensItsOwnViews) {
  const at::Tensor storage = at::zeros({4});
  EXPECT_TRUE(
      contains(value_error([&] { flatten_parameters({storage, storage.view({2, 2})}, {}); }),
               "overlap in memory"));
  // Flattened once, the parameters are disjoint views of one buffer: flattened again (an engine
  // of a later elastic epoch), they move to a buffer of their own.
  std::vector<at::Tensor> params{at::zeros({3}), at::zeros({2})};
  const auto first = flatten_parameters(params, {});
  const auto second = flatten_parameters(params, {});
  EXPECT_FALSE(params[0].storage().is_alias_of(first[0].flat.storage()));
  EXPECT_TRUE(params[0].storage().is_alias_of(second[0].flat.storage()));
}

}  // namespace
}  // namespace gossip
