// The gossip engine over the in-process transport, one std::thread per rank, checked against a
// reference written here: the round's column-stochastic mixing matrix, built from the schedule and
// docs/design.md's weights, applied to the stacked numerators and push-sum weights.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "engine/gossip_engine.h"
#include "transport/host_staging/host_staging_transport.h"
#include "transport/inproc/inproc_transport.h"
#include "run_ranks.h"

namespace gossip {
namespace {

using Vector = std::vector<double>;
using Matrix = std::vector<Vector>;

const MixingOptions kUniform{.kind = MixingKind::kUniform};
const MixingOptions kSelfWeight{.kind = MixingKind::kSelfWeight, .self_weight = 0.3};

Vector values_of(const at::Tensor& t) {
  const at::Tensor d = t.detach().to(at::kDouble).contiguous();
  return Vector(d.const_data_ptr<double>(), d.const_data_ptr<double>() + d.numel());
}

// One rank as doubles: de-biased values and numerators per dtype group, and its push-sum weight.
struct RankState {
  std::vector<Vector> z, x;
  double w = 0.0;
};

RankState state_of(const GossipEngine& engine) {
  RankState s;
  for (const FlatParameterGroup& group : engine.groups()) s.z.push_back(values_of(group.flat));
  for (const at::Tensor& x : engine.ps_numerators()) s.x.push_back(values_of(x));
  s.w = engine.ps_weight().item<double>();
  return s;
}

// n ranks on one hub; rank r owns parameters of the given dtypes (shapes cycle through {3}, {2, 2},
// {5}) with random values, so no two ranks start equal.
// With `staged`, every rank's transport goes through HostStagingTransport, as CUDA parameters
// gossiping over gloo do.
struct World {
  World(int n, const EngineOptions& options, const std::vector<at::ScalarType>& dtypes,
        bool staged = false)
      : hub(std::make_shared<InProcHub>(n)), params(n), initial(n) {
    const std::vector<std::vector<int64_t>> shapes = {{3}, {2, 2}, {5}};
    std::mt19937_64 rng(n);
    std::uniform_real_distribution<double> value(-3.0, 3.0);
    for (int r = 0; r < n; ++r) {
      std::vector<std::string> names;
      for (size_t i = 0; i < dtypes.size(); ++i) {
        at::Tensor p = at::empty(shapes[i % shapes.size()], at::kDouble);
        double* data = p.data_ptr<double>();
        for (int64_t e = 0; e < p.numel(); ++e) data[e] = value(rng);
        params[r].push_back(p.to(dtypes[i]).requires_grad_(true));
        initial[r].push_back(values_of(params[r].back()));
        names.push_back("p" + std::to_string(i));
      }
      std::shared_ptr<Transport> transport = std::make_shared<InProcTransport>(hub, r);
      if (staged) transport = std::make_shared<HostStagingTransport>(transport);
      engines.push_back(std::make_unique<GossipEngine>(params[r], names, transport, options));
    }
  }
  int size() const { return static_cast<int>(engines.size()); }

  std::shared_ptr<InProcHub> hub;
  std::vector<std::vector<at::Tensor>> params;
  std::vector<std::vector<Vector>> initial;  // [rank][param], taken before flattening
  std::vector<std::unique_ptr<GossipEngine>> engines;
};

// Runs `rounds` rounds with every rank on its own thread. trace[t][r] is rank r after t rounds
// (trace[0] is the start). A failing rank aborts the hub so that no other rank waits forever, and
// its error is rethrown here.
std::vector<std::vector<RankState>> run_rounds(World& world, int rounds) {
  const int n = world.size();
  std::vector<std::vector<RankState>> trace(rounds + 1, std::vector<RankState>(n));
  for (int r = 0; r < n; ++r) trace[0][r] = state_of(*world.engines[r]);
  run_ranks(
      n,
      [&](int r) {
        c10::NoGradGuard no_grad;
        for (int t = 0; t < rounds; ++t) {
          world.engines[r]->start_round();
          world.engines[r]->finish_round();
          trace[t + 1][r] = state_of(*world.engines[r]);
        }
      },
      [&](int, const std::string& what) { world.hub->abort(what); });
  return trace;
}

// W[j][i]: the share of node i's value that node j holds after round t. docs/design.md section 1: a
// node keeps `self` and gives `peer` to each out-peer; uniform mixing gives everyone 1/(k+1).
Matrix mixing_matrix(const Graph& graph, const MixingOptions& mixing, int64_t t) {
  const int n = graph.world_size();
  Matrix w(n, Vector(n, 0.0));
  for (int i = 0; i < n; ++i) {
    const std::vector<int> out = graph.out_peers(i, t);
    const double k = static_cast<double>(out.size());
    const bool uniform = mixing.kind == MixingKind::kUniform || out.empty();
    const double self = uniform ? 1.0 / (k + 1.0) : mixing.self_weight;
    const double peer = uniform ? 1.0 / (k + 1.0) : (1.0 - mixing.self_weight) / k;
    w[i][i] += self;
    for (int j : out) w[j][i] += peer;
  }
  return w;
}

// One round on stacked vectors: out[j] = sum_i m[j][i] * v[i].
std::vector<Vector> mix(const Matrix& m, const std::vector<Vector>& v) {
  std::vector<Vector> out(v.size(), Vector(v[0].size(), 0.0));
  for (size_t j = 0; j < v.size(); ++j) {
    for (size_t i = 0; i < v.size(); ++i) {
      for (size_t e = 0; e < v[i].size(); ++e) out[j][e] += m[j][i] * v[i][e];
    }
  }
  return out;
}

// Element-wise |got - want| <= tol * max(1, |want|).
void expect_close(const Vector& got, const Vector& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t e = 0; e < got.size(); ++e) {
    EXPECT_LE(std::abs(got[e] - want[e]), tol * std::max(1.0, std::abs(want[e])))
        << what << " element " << e << ": got " << got[e] << ", want " << want[e];
  }
}

// Checks every round of `trace` against the mixing matrices of `graph`.
void expect_matches_reference(const std::vector<std::vector<RankState>>& trace, const Graph& graph,
                              const MixingOptions& mixing, const std::vector<double>& tols) {
  // Reference push-sum state from the start: x[group][rank] = z (every weight starts at 1).
  std::vector<std::vector<Vector>> x(trace[0][0].z.size());
  for (size_t g = 0; g < x.size(); ++g) {
    for (const RankState& s : trace[0]) x[g].push_back(s.z[g]);
  }
  std::vector<Vector> w(trace[0].size(), Vector{1.0});
  for (size_t t = 0; t + 1 < trace.size(); ++t) {
    const Matrix m = mixing_matrix(graph, mixing, static_cast<int64_t>(t));
    for (std::vector<Vector>& group : x) group = mix(m, group);
    w = mix(m, w);
    for (size_t r = 0; r < w.size(); ++r) {
      const std::string where = "round " + std::to_string(t) + " rank " + std::to_string(r);
      EXPECT_NEAR(trace[t + 1][r].w, w[r][0], tols.back()) << where;
      for (size_t g = 0; g < x.size(); ++g) {
        Vector z = x[g][r];
        for (double& v : z) v /= w[r][0];
        expect_close(trace[t + 1][r].z[g], z, tols[g], where + " z group " + std::to_string(g));
        expect_close(trace[t + 1][r].x[g], x[g][r], tols[g],
                     where + " x group " + std::to_string(g));
      }
    }
  }
}

// Sums over ranks of the numerators (per group, element-wise) and of the weights never change.
void expect_mass_conserved(const std::vector<std::vector<RankState>>& trace,
                           const std::vector<double>& tols) {
  auto total = [](const std::vector<RankState>& ranks, size_t g) {
    Vector sum(ranks[0].x[g].size(), 0.0);
    for (const RankState& s : ranks) {
      for (size_t e = 0; e < sum.size(); ++e) sum[e] += s.x[g][e];
    }
    return sum;
  };
  const double n = static_cast<double>(trace[0].size());
  for (size_t t = 1; t < trace.size(); ++t) {
    double weight = 0.0;
    for (const RankState& s : trace[t]) weight += s.w;
    EXPECT_NEAR(weight, n, n * tols.back()) << "round " << t - 1;
    for (size_t g = 0; g < trace[0][0].x.size(); ++g) {
      expect_close(total(trace[t], g), total(trace[0], g), n * tols[g],
                   "round " + std::to_string(t - 1) + " group " + std::to_string(g));
    }
  }
}

struct Case {
  GraphKind kind;
  int peers_per_itr;
  MixingOptions mixing;
  bool allow_lazy_mixing = true;
};

// Push-sum cases at n = 2, 3, 4, 8: directed and pairing graphs, lazy and travelling weights.
std::vector<std::pair<int, Case>> push_sum_cases() {
  std::vector<std::pair<int, Case>> cases;
  for (int n : {2, 3, 4, 8}) {
    for (const MixingOptions& mixing : {kUniform, kSelfWeight}) {
      for (GraphKind kind :
           {GraphKind::kNPeerDynamicDirectedExponential, GraphKind::kDynamicDirectedExponential,
            GraphKind::kDynamicDirectedLinear, GraphKind::kRing}) {
        cases.push_back({n, {kind, 1, mixing}});
      }
      if (n % 2 == 0) cases.push_back({n, {GraphKind::kDynamicBipartiteExponential, 1, mixing}});
      if (n != 3) cases.push_back({n, {GraphKind::kHypercube, 1, mixing}});
    }
    if (n >= 3) cases.push_back({n, {GraphKind::kNPeerDynamicDirectedExponential, 2, kSelfWeight}});
    cases.push_back({n, {GraphKind::kDynamicDirectedExponential, 1, kUniform, false}});
  }
  return cases;
}

EngineOptions options_for(const Case& c, bool push_sum = true) {
  EngineOptions options;
  options.graph = {.kind = c.kind, .peers_per_itr = c.peers_per_itr};
  options.mixing = c.mixing;
  options.push_sum = push_sum;
  options.allow_lazy_mixing = c.allow_lazy_mixing;
  options.timeout = std::chrono::seconds(30);
  return options;
}

std::string describe(int n, const Case& c) {
  return std::string(graph_kind_name(c.kind)) + " n=" + std::to_string(n) +
         " p=" + std::to_string(c.peers_per_itr) +
         (c.mixing.kind == MixingKind::kUniform ? " uniform" : " self_weight") +
         (c.allow_lazy_mixing ? "" : " no-lazy");
}

}  // namespace

TEST(GossipEngineTest, MassIsConservedEveryRound) {
  for (const auto& [n, c] : push_sum_cases()) {
    SCOPED_TRACE(describe(n, c));
    World world(n, options_for(c), {at::kDouble, at::kDouble});
    // Lazy mixing exactly when mixing is uniform and the weight is allowed to stay home.
    EXPECT_EQ(world.engines[0]->lazy_mixing(),
              c.mixing.kind == MixingKind::kUniform && c.allow_lazy_mixing);
    expect_mass_conserved(run_rounds(world, 7), {1e-12});
  }
}

TEST(GossipEngineTest, OneRoundIsTheMixingMatrix) {
  for (const auto& [n, c] : push_sum_cases()) {
    for (bool synchronous : {false, true}) {  // synchronous: sent in place where lazy
      SCOPED_TRACE(describe(n, c) + (synchronous ? " synchronous" : ""));
      EngineOptions options = options_for(c);
      options.synchronous = synchronous;
      World world(n, options, {at::kDouble, at::kDouble});
      const auto trace = run_rounds(world, 7);
      expect_matches_reference(trace, Graph(options.graph, n), c.mixing, {1e-12});
    }
  }
}

TEST(GossipEngineTest, PushPullIsTheMixingMatrixOnPairingGraphs) {
  const std::vector<std::pair<int, Case>> cases = {
      {2, {GraphKind::kHypercube, 1, kUniform}},
      {4, {GraphKind::kHypercube, 1, kSelfWeight}},
      {8, {GraphKind::kHypercube, 2, kUniform}},
      {4, {GraphKind::kDynamicBipartiteExponential, 1, kUniform}},
      {8, {GraphKind::kDynamicBipartiteExponential, 2, kSelfWeight}},
      {6, {GraphKind::kDynamicBipartiteLinear, 2, kUniform}},
      {5, {GraphKind::kRing, 2, kUniform}},
  };
  for (const auto& [n, c] : cases) {
    SCOPED_TRACE(describe(n, c));
    World world(n, options_for(c, /*push_sum=*/false), {at::kDouble});
    const auto trace = run_rounds(world, 6);
    expect_matches_reference(trace, Graph(options_for(c).graph, n), c.mixing, {1e-12});
    expect_mass_conserved(trace, {1e-12});
  }
  // A directed graph cannot average push-pull: refused up front, naming the option.
  EngineOptions directed =
      options_for({GraphKind::kDynamicDirectedExponential, 1, kUniform}, false);
  try {
    World world(8, directed, {at::kDouble});
    ADD_FAILURE() << "push_sum=false on a directed graph was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("push_sum"), std::string::npos) << e.what();
  }
}

TEST(GossipEngineTest, ExactConsensusAfterLog2NRounds) {
  struct Consensus {
    int n;
    GraphKind kind;
    bool push_sum;
  };
  for (const Consensus& c : {Consensus{8, GraphKind::kNPeerDynamicDirectedExponential, true},
                             Consensus{16, GraphKind::kNPeerDynamicDirectedExponential, true},
                             Consensus{8, GraphKind::kHypercube, false}}) {
    SCOPED_TRACE(std::string(graph_kind_name(c.kind)) + " n=" + std::to_string(c.n));
    World world(c.n, options_for({c.kind, 1, kUniform}, c.push_sum), {at::kDouble});
    const int log2n = static_cast<int>(std::lround(std::log2(c.n)));
    const auto trace = run_rounds(world, log2n);
    Vector mean(trace[0][0].z[0].size(), 0.0);
    for (const RankState& s : trace[0]) {
      for (size_t e = 0; e < mean.size(); ++e) mean[e] += s.z[0][e] / c.n;
    }
    double spread_before = 0.0;  // one round short of log2(n), the average is not reached yet
    for (int r = 0; r < c.n; ++r) {
      expect_close(trace[log2n][r].z[0], mean, 1e-12, "rank " + std::to_string(r));
      for (size_t e = 0; e < mean.size(); ++e) {
        spread_before = std::max(spread_before, std::abs(trace[log2n - 1][r].z[0][e] - mean[e]));
      }
    }
    EXPECT_GT(spread_before, 1e-3);
  }
}

TEST(GossipEngineTest, MixedDtypesShareOneSchedule) {
  for (const MixingOptions& mixing : {kUniform, kSelfWeight}) {
    const Case c{GraphKind::kDynamicDirectedExponential, 1, mixing};
    SCOPED_TRACE(describe(4, c));
    World world(4, options_for(c), {at::kFloat, at::kDouble, at::kFloat});
    ASSERT_EQ(world.engines[0]->groups().size(), 2u);
    EXPECT_EQ(world.engines[0]->groups()[0].flat.scalar_type(), at::kFloat);
    const auto trace = run_rounds(world, 6);
    // fp32 numerators carry fp32 rounding; the fp64 group and the weight must stay exact.
    expect_matches_reference(trace, Graph(options_for(c).graph, 4), mixing, {1e-5, 1e-12});
    expect_mass_conserved(trace, {1e-5, 1e-12});
  }
}

TEST(GossipEngineTest, ParametersBecomeViewsOfTheFlatBuffer) {
  c10::NoGradGuard no_grad;
  World world(1, options_for({GraphKind::kRing, 1, kUniform}),
              {at::kDouble, at::kFloat, at::kDouble});
  const std::vector<at::Tensor>& params = world.params[0];
  const auto& groups = world.engines[0]->groups();
  ASSERT_EQ(groups.size(), 2u);
  // Groups in order of first appearance; parameters back to back inside their group.
  const int group_of[] = {0, 1, 0};
  const int64_t offset_of[] = {0, 0, 3};
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& flat = groups[group_of[i]].flat;
    const auto* base = static_cast<const char*>(flat.const_data_ptr());
    EXPECT_EQ(params[i].const_data_ptr(), base + offset_of[i] * flat.element_size()) << i;
    EXPECT_TRUE(params[i].requires_grad()) << i;
    EXPECT_EQ(values_of(params[i]), world.initial[0][i]) << "flattening changed parameter " << i;
  }
  EXPECT_EQ(groups[0].flat.numel(), 3 + 5);
  EXPECT_EQ(groups[1].flat.numel(), 4);
  // Writes through either side are seen by the other.
  params[2].mul_(2.0);
  const Vector flat0 = values_of(groups[0].flat);
  for (int e = 0; e < 8; ++e) {
    EXPECT_EQ(flat0[e], e < 3 ? world.initial[0][0][e] : 2.0 * world.initial[0][2][e - 3]) << e;
  }
  groups[1].flat.fill_(2.5);
  EXPECT_EQ(values_of(params[1]), Vector(4, 2.5));
}

TEST(GossipEngineTest, ReplacingParameterStorageFailsLoudly) {
  c10::NoGradGuard no_grad;
  World world(2, options_for({GraphKind::kRing, 1, kUniform}), {at::kDouble, at::kDouble});
  // In-place updates keep the views, so rounds go on.
  for (int r = 0; r < 2; ++r) world.params[r][1].add_(1.0);
  run_rounds(world, 2);
  world.params[0][1].set_data(at::zeros_like(world.params[0][1]));
  try {
    world.engines[0]->start_round();
    ADD_FAILURE() << "start_round accepted a parameter whose storage was replaced";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'p1'"), std::string::npos) << e.what();
  }
}

// An empty parameter (say, a zero-width bias) views the flat buffer like any other and must not
// be mistaken for one whose storage was replaced.
TEST(GossipEngineTest, ZeroElementParameterKeepsGossiping) {
  auto hub = std::make_shared<InProcHub>(1);
  const std::vector<at::Tensor> params = {at::ones({3}, at::kDouble), at::ones({0}, at::kDouble)};
  GossipEngine engine(params, {"weight", "empty_bias"}, std::make_shared<InProcTransport>(hub, 0),
                      options_for({GraphKind::kRing, 1, kUniform}));
  engine.start_round();
  engine.finish_round();
  EXPECT_EQ(engine.round(), 1);
  EXPECT_EQ(values_of(params[0]), Vector(3, 1.0));
}

TEST(GossipEngineTest, MissingPeerTimesOutNamingPeerAndRound) {
  EngineOptions options = options_for({GraphKind::kNPeerDynamicDirectedExponential, 1, kUniform});
  options.timeout = std::chrono::milliseconds(200);
  World world(4, options, {at::kDouble});
  run_rounds(world, 2);
  // Round 2 uses slot 0 (offset +1) again, so rank 0 waits for rank 3, which never starts it.
  world.engines[0]->start_round();
  const auto begin = std::chrono::steady_clock::now();
  try {
    world.engines[0]->finish_round();
    ADD_FAILURE() << "finish_round returned without the peer's message";
  } catch (const TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("round 2"), std::string::npos) << message;
    EXPECT_NE(message.find("[3]"), std::string::npos) << message;
    // The same as data, for the Python exception's attributes.
    EXPECT_EQ(e.failure().peers, std::vector<int>{3});
    EXPECT_EQ(e.failure().round, std::optional<int64_t>(2));
    EXPECT_EQ(e.failure().transport, "inproc");
    EXPECT_EQ(e.failure().timeout, std::optional(std::chrono::milliseconds(200)));
  }
  const auto waited = std::chrono::steady_clock::now() - begin;
  EXPECT_GE(waited, std::chrono::milliseconds(200));
  EXPECT_LT(waited, std::chrono::seconds(10));
}

TEST(GossipEngineTest, WorldSizeOneIsANoOp) {
  for (const Case& c : {Case{GraphKind::kNPeerDynamicDirectedExponential, 1, kUniform},
                        Case{GraphKind::kDynamicBipartiteExponential, 1, kSelfWeight},
                        Case{GraphKind::kHypercube, 2, kUniform}}) {
    SCOPED_TRACE(describe(1, c));
    World world(1, options_for(c), {at::kDouble, at::kFloat});
    const auto trace = run_rounds(world, 3);
    EXPECT_EQ(world.engines[0]->round(), 3);
    for (int t = 1; t <= 3; ++t) {
      EXPECT_EQ(trace[t][0].z, trace[0][0].z) << "round " << t - 1;
      EXPECT_EQ(trace[t][0].w, 1.0);
    }
  }
}

// Note [Non-finite messages]: rank 2 of a ring diverges. Its out-peer (rank 3) raises naming it,
// rank 2 raises naming itself, and ranks 0 and 1, which never see its values, go on.
std::vector<std::string> one_round_errors(World& world) {
  const int n = world.size();
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      c10::NoGradGuard no_grad;
      try {
        world.engines[r]->start_round();
        world.engines[r]->finish_round();
      } catch (const NonFiniteError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  return errors;
}

TEST(GossipEngineTest, NonFiniteMessageRaisesNamingTheSender) {
  for (const MixingOptions& mixing : {kUniform, kSelfWeight}) {
    for (double bad : {std::nan(""), -std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE(std::string(mixing.kind == MixingKind::kUniform ? "uniform " : "self_weight ") +
                   std::to_string(bad));
      World world(4, options_for({GraphKind::kRing, 1, mixing}), {at::kFloat, at::kDouble});
      {
        c10::NoGradGuard no_grad;
        world.params[2][1].view(-1)[3].fill_(bad);
      }
      const std::vector<std::string> errors = one_round_errors(world);
      EXPECT_EQ(errors[0], "");
      EXPECT_EQ(errors[1], "");
      EXPECT_NE(errors[3].find("round 0: the messages from peers [2] hold NaN or Inf"),
                std::string::npos)
          << errors[3];
      EXPECT_NE(errors[2].find("the parameters of this rank (rank 2) hold NaN or Inf"),
                std::string::npos)
          << errors[2];
      // The failure is sticky: the parameters now hold the values, so gossip must not go on.
      EXPECT_THROW(world.engines[3]->start_round(), NonFiniteError);
      EXPECT_THROW(world.engines[3]->finish_round(), NonFiniteError);
      // The senders and the round as data; none for the rank whose own parameters diverged.
      const std::vector<std::pair<int, std::vector<int>>> senders_of{{3, {2}}, {2, {}}};
      for (const auto& [rank, senders] : senders_of) {
        try {
          world.engines[rank]->finish_round();
          ADD_FAILURE() << "rank " << rank << " did not stay failed";
        } catch (const NonFiniteError& e) {
          EXPECT_EQ(e.failure().peers, senders) << "rank " << rank;
          EXPECT_EQ(e.failure().round, std::optional<int64_t>(0)) << "rank " << rank;
        }
      }
    }
  }
}

TEST(GossipEngineTest, CheckFiniteOffLetsNonFiniteValuesThrough) {
  EngineOptions options = options_for({GraphKind::kRing, 1, kUniform});
  options.check_finite = false;
  World world(4, options, {at::kFloat});
  {
    c10::NoGradGuard no_grad;
    world.params[2][0].view(-1)[0].fill_(std::nan(""));
  }
  const std::vector<std::string> errors = one_round_errors(world);
  for (const std::string& error : errors) EXPECT_EQ(error, "");
  EXPECT_TRUE(std::isnan(values_of(world.params[3][0])[0]));
  EXPECT_FALSE(std::isnan(values_of(world.params[1][0])[0]));
}

// The staging decorator moves bytes only: rounds through it equal direct rounds bit for bit, in
// every message layout (lazy and travelling weights, several dtype groups, sent in place or not).
TEST(GossipEngineTest, HostStagingGivesTheSameRoundsAsTheInnerTransport) {
  for (const Case& c : {Case{GraphKind::kNPeerDynamicDirectedExponential, 2, kUniform},
                        Case{GraphKind::kDynamicDirectedExponential, 1, kSelfWeight},
                        Case{GraphKind::kRing, 1, kUniform, /*allow_lazy_mixing=*/false}}) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(describe(5, c) + (in_place ? " in place" : ""));
      EngineOptions options = options_for(c);
      options.synchronous = in_place;
      World direct(5, options, {at::kFloat, at::kDouble});
      World staged(5, options, {at::kFloat, at::kDouble}, /*staged=*/true);
      const auto want = run_rounds(direct, 4);
      const auto got = run_rounds(staged, 4);
      for (size_t t = 0; t < want.size(); ++t) {
        for (size_t r = 0; r < want[t].size(); ++r) {
          EXPECT_EQ(got[t][r].z, want[t][r].z) << "round " << t << " rank " << r;
          EXPECT_EQ(got[t][r].w, want[t][r].w) << "round " << t << " rank " << r;
        }
      }
    }
  }
}

// A transport whose round completes by failing, as a gloo round does when a peer dies.
class FailedRoundTransport final : public Transport {
 public:
  class FailedWork final : public Work {
   public:
    bool is_completed() override { return true; }
    void wait(std::chrono::milliseconds) override {
      throw std::runtime_error("failed to receive from peer 1 in gossip round 0");
    }
  };
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage>, std::vector<PeerMessage>,
                                 int64_t) override {
    return std::make_shared<FailedWork>();
  }
  std::string name() const override { return "failed"; }
};

// try_finish_round (bounded asynchrony) must surface the failure, not absorb stale buffers.
TEST(GossipEngineTest, RoundThatCompletedByFailingRaisesInsteadOfBeingAbsorbed) {
  for (bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged" : "direct");
    std::shared_ptr<Transport> transport = std::make_shared<FailedRoundTransport>();
    if (staged) transport = std::make_shared<HostStagingTransport>(transport);
    const at::Tensor param = at::ones({4}, at::kFloat);
    GossipEngine engine({param}, {"p"}, transport, options_for({GraphKind::kRing, 1, kUniform}));
    engine.start_round();
    try {
      engine.try_finish_round();
      ADD_FAILURE() << "try_finish_round absorbed a failed round";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("peer 1"), std::string::npos) << e.what();
    }
    EXPECT_EQ(engine.round(), 0);
    EXPECT_THROW(engine.finish_round(), std::runtime_error);  // sticky
  }
}

// Note [Compressed messages]: 16-bit messages under travelling weights conserve the numerators'
// sum to the state's rounding every round, and the wire carries half (float32) or a quarter
// (float64) of the bytes.
TEST(GossipEngineTest, CompressedMessagesConserveMassAndShrinkTheWire) {
  for (at::ScalarType message : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(message));
    EngineOptions options = options_for({GraphKind::kNPeerDynamicDirectedExponential, 2,
                                         kSelfWeight});
    World full(5, options, {at::kFloat, at::kDouble});
    options.message_dtype = message;
    World compressed(5, options, {at::kFloat, at::kDouble});
    const auto trace = run_rounds(compressed, 20);
    expect_mass_conserved(trace, {1e-5, 1e-12, 1e-12});
    run_rounds(full, 20);
    // 20 rounds, 2 peers. A float32 group of 3 elements pads to 4 and adds the 8-byte weight
    // slot: 24 bytes, 16 in 16 bits; a float64 group of 4 elements: 40 bytes, 16 in 16 bits.
    EXPECT_EQ(full.engines[0]->bytes_sent(), 20 * 2 * (24 + 40));
    EXPECT_EQ(compressed.engines[0]->bytes_sent(), 20 * 2 * (16 + 16));
    // message_bytes() says the same before any round: what one out-peer is sent each round.
    EXPECT_EQ(full.engines[0]->message_bytes(), 24 + 40);
    EXPECT_EQ(compressed.engines[0]->message_bytes(), 16 + 16);
  }
}

// Note [Compressed messages], synchronous: the fold happens at the absorb, reading the node's own
// message; the numerators' sum is conserved as when folding at the send, lazy or not.
TEST(GossipEngineTest, SynchronousCompressedRoundsFoldAtTheAbsorbAndConserveMass) {
  for (const MixingOptions& mixing : {kUniform, kSelfWeight}) {
    SCOPED_TRACE(mixing.kind == MixingKind::kUniform ? "uniform (lazy)" : "self weight");
    EngineOptions options = options_for({GraphKind::kNPeerDynamicDirectedExponential, 2, mixing});
    options.synchronous = true;
    options.message_dtype = at::kBFloat16;
    World world(5, options, {at::kFloat, at::kDouble});
    expect_mass_conserved(run_rounds(world, 20), {1e-5, 1e-12, 1e-12});
  }
}

// Note [The parameters are the model]: while a round is in flight the parameters and the weight
// are still those of the last model, whether the round is sent in place, compressed (folded at
// the absorb) or carries weights.
TEST(GossipEngineTest, ARoundInFlightLeavesTheParametersTheModel) {
  struct Config {
    const char* name;
    Case c;
    std::optional<at::ScalarType> message;
  };
  for (const Config& config :
       {Config{"in place", {GraphKind::kNPeerDynamicDirectedExponential, 1, kUniform}, {}},
        Config{"travelling weights", {GraphKind::kDynamicDirectedExponential, 1, kSelfWeight}, {}},
        Config{"compressed", {GraphKind::kRing, 1, kUniform}, at::kBFloat16}}) {
    SCOPED_TRACE(config.name);
    EngineOptions options = options_for(config.c);
    options.synchronous = true;
    options.message_dtype = config.message;
    World world(4, options, {at::kFloat, at::kDouble});
    run_rounds(world, 2);  // weights away from 1 where they travel
    std::vector<RankState> before;
    for (auto& engine : world.engines) before.push_back(state_of(*engine));
    // The in-process transport copies at posting, so ranks can start one after the other.
    for (auto& engine : world.engines) engine->start_round();
    for (int r = 0; r < world.size(); ++r) {
      const RankState now = state_of(*world.engines[r]);
      EXPECT_EQ(now.z, before[r].z) << "rank " << r;
      EXPECT_EQ(now.w, before[r].w) << "rank " << r;
      EXPECT_EQ(world.engines[r]->round(), 2);
    }
    for (auto& engine : world.engines) engine->finish_round();
    for (auto& engine : world.engines) EXPECT_EQ(engine->round(), 3);
  }
}

// A transport that throws while posting, as gloo does when a send finds its peer's connection
// closed.
class PostFailsTransport final : public Transport {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 4; }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage>, std::vector<PeerMessage>,
                                 int64_t round) override {
    throw TimeoutError(detail::str_cat("gossip_ext: rank 0 failed to send to peer 1 in gossip round ",
                                       round));
  }
  std::string name() const override { return "post fails"; }
};

// Note [The parameters are the model]: a round that fails to post changes nothing a caller can
// see, and every later call raises its error.
TEST(GossipEngineTest, ARoundThatFailsToPostChangesNothingAndStaysFailed) {
  for (bool lazy : {true, false}) {
    for (std::optional<at::ScalarType> message :
         {std::optional<at::ScalarType>(), std::optional<at::ScalarType>(at::kHalf)}) {
      SCOPED_TRACE(std::string(lazy ? "lazy" : "travelling weights") +
                   (message ? " compressed" : ""));
      EngineOptions options = options_for({GraphKind::kRing, 1, kUniform, lazy});
      options.synchronous = true;
      options.message_dtype = message;
      at::Tensor param = at::arange(1, 6, at::kFloat);
      const at::Tensor original = param.clone();
      GossipEngine engine({param}, {"p"}, std::make_shared<PostFailsTransport>(), options);
      EXPECT_THROW(engine.start_round(), TimeoutError);
      EXPECT_TRUE(at::equal(engine.groups()[0].flat, original));
      EXPECT_EQ(engine.ps_weight().item<double>(), 1.0);
      EXPECT_EQ(engine.round(), 0);
      EXPECT_EQ(engine.bytes_sent(), 0);
      EXPECT_FALSE(engine.in_flight());
      for (const auto& call : std::vector<std::function<void()>>{
               [&] { engine.start_round(); }, [&] { engine.finish_round(); },
               [&] { engine.try_finish_round(); }, [&] { engine.synchronize(); },
               [&] { engine.raise_if_failed(); }}) {
        try {
          call();
          ADD_FAILURE() << "a call after the failed round did not raise";
        } catch (const TimeoutError& e) {
          EXPECT_NE(std::string(e.what()).find("peer 1 in gossip round 0"), std::string::npos)
              << e.what();
        }
      }
    }
  }
}

TEST(GossipEngineTest, PeersPerItrChangesFromTheNextRoundAndKeepsMass) {
  World world(8, options_for({GraphKind::kNPeerDynamicDirectedExponential, 1, kUniform}),
              {at::kDouble});
  run_rounds(world, 2);
  const int64_t one_peer = world.engines[0]->bytes_sent() / 2;
  for (auto& engine : world.engines) engine->set_peers_per_itr(2);
  EXPECT_EQ(world.engines[0]->graph().peers_per_itr(), 2);
  expect_mass_conserved(run_rounds(world, 3), {1e-12});
  EXPECT_EQ(world.engines[0]->bytes_sent(), 2 * one_peer + 3 * 2 * one_peer);
  // A peer per round for every node is more than 8 nodes have: refused, naming the option.
  try {
    world.engines[0]->set_peers_per_itr(8);
    ADD_FAILURE() << "peers_per_itr=8 was accepted at world size 8";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("peers_per_itr"), std::string::npos) << e.what();
  }
  EXPECT_EQ(world.engines[0]->graph().peers_per_itr(), 2);
}

// An in-process rank that records the peers it is asked to connect (what NCCL connects).
class ConnectRecordingTransport final : public Transport {
 public:
  ConnectRecordingTransport(std::shared_ptr<InProcHub> hub, int rank) : inner_(hub, rank) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override {
    for (const auto* list : {&sends, &recvs}) {
      for (const PeerMessage& m : *list) used.insert(m.peer);
    }
    return inner_.exchange(std::move(sends), std::move(recvs), round);
  }
  std::string name() const override { return "recording"; }
  void connect_peers(const std::vector<int>& peers) override { connected.push_back(peers); }

  std::vector<std::vector<int>> connected;
  std::set<int> used;

 private:
  InProcTransport inner_;
};

TEST(GossipEngineTest, TheEngineConnectsEveryPeerItsRoundsUseFirst) {
  const int n = 8;
  auto hub = std::make_shared<InProcHub>(n);
  const EngineOptions options =
      options_for({GraphKind::kNPeerDynamicDirectedExponential, 1, kUniform});
  std::vector<std::shared_ptr<ConnectRecordingTransport>> transports;
  std::vector<std::unique_ptr<GossipEngine>> engines;
  for (int r = 0; r < n; ++r) {
    transports.push_back(std::make_shared<ConnectRecordingTransport>(hub, r));
    engines.push_back(std::make_unique<GossipEngine>(std::vector<at::Tensor>{at::ones({4})},
                                                     std::vector<std::string>{"w"},
                                                     transports.back(), options));
  }
  const auto rounds = [&](int count) {
    for (int t = 0; t < count; ++t) {
      std::vector<std::thread> threads;
      for (auto& engine : engines) {
        threads.emplace_back([&engine] {
          engine->start_round();
          engine->finish_round();
        });
      }
      for (std::thread& thread : threads) thread.join();
    }
  };
  rounds(3);
  // Built: rank 0 connected out-peers +1, +2, +4 and in-peers -1, -2, -4, before any round.
  ASSERT_EQ(transports[0]->connected.size(), 1u);
  EXPECT_EQ(transports[0]->connected[0], (std::vector<int>{1, 2, 4, 6, 7}));
  for (const auto& transport : transports) {
    const std::vector<int>& peers = transport->connected[0];
    for (const int q : transport->used) {
      EXPECT_TRUE(std::find(peers.begin(), peers.end(), q) != peers.end())
          << "rank " << transport->rank() << " used peer " << q << " it had not connected";
    }
  }
  // A new schedule connects its peers (n = 8, p = 2: offsets 1, 2, 3, 6) before its rounds.
  for (auto& engine : engines) engine->set_peers_per_itr(2);
  ASSERT_EQ(transports[0]->connected.size(), 2u);
  EXPECT_EQ(transports[0]->connected[1], engines[0]->graph().peers(0));
  EXPECT_EQ(transports[0]->connected[1], (std::vector<int>{1, 2, 3, 5, 6, 7}));
  rounds(2);
}

TEST(GossipEngineTest, PeersPerItrCannotChangeWhileARoundIsInFlight) {
  World world(2, options_for({GraphKind::kRing, 1, kUniform}), {at::kDouble});
  world.engines[0]->start_round();
  EXPECT_THROW(world.engines[0]->set_peers_per_itr(1), c10::Error);
  world.hub->abort("test over");
}

TEST(GossipEngineTest, MessageDtypeMustBe16Bit) {
  EngineOptions options = options_for({GraphKind::kRing, 1, kUniform});
  options.message_dtype = at::kFloat;
  try {
    World world(2, options, {at::kFloat});
    ADD_FAILURE() << "a float32 message_dtype was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("message_dtype must be torch.float16 or torch.bfloat16"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace gossip
