// Schedules and mixing weights against docs/design.md section 2, recomputed here with plain integer
// loops: phone books, per-round out/in-peers, regularity, symmetric pairing and every error path.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/error.h"
#include "topology/graph.h"
#include "topology/mixing.h"

namespace gossip {
namespace {

constexpr GraphKind kAllKinds[] = {
    GraphKind::kNPeerDynamicDirectedExponential,
    GraphKind::kDynamicDirectedExponential,
    GraphKind::kDynamicBipartiteExponential,
    GraphKind::kDynamicDirectedLinear,
    GraphKind::kDynamicBipartiteLinear,
    GraphKind::kRing,
    GraphKind::kHypercube,
};

bool is_bipartite_kind(GraphKind kind) {
  return kind == GraphKind::kDynamicBipartiteExponential ||
         kind == GraphKind::kDynamicBipartiteLinear;
}

// Signed offsets of the offset-based graphs, spelled out from docs/design.md section 2.
std::vector<int64_t> design_offsets(GraphKind kind, int p, int64_t n) {
  std::vector<int64_t> offsets;
  switch (kind) {
    case GraphKind::kNPeerDynamicDirectedExponential:
      for (int64_t power = 1; power <= n - 1; power *= p + 1) {
        for (int64_t j = 1; j <= p; ++j) offsets.push_back(j * power);
      }
      break;
    case GraphKind::kDynamicDirectedExponential:
      for (int64_t power = 1; power <= n - 1; power *= 2) {
        offsets.insert(offsets.end(), {power, -power});
      }
      break;
    case GraphKind::kDynamicBipartiteExponential:
      offsets = {1, -1};
      for (int64_t power = 2; power <= n - 1; power *= 2) {
        offsets.insert(offsets.end(), {1 + power, -(1 + power)});
      }
      break;
    case GraphKind::kDynamicDirectedLinear:
    case GraphKind::kDynamicBipartiteLinear:
      for (int64_t i = 1; i <= n - 1; i += 2) offsets.insert(offsets.end(), {i, -i});
      break;
    case GraphKind::kRing:
      offsets = p == 1 ? std::vector<int64_t>{1} : std::vector<int64_t>{1, -1};
      break;
    default:
      ADD_FAILURE() << "no offsets for this kind";
  }
  return offsets;
}

// Node r's expected phone book. For bipartite graphs docs/design.md fixes the peer set, not the
// order, so callers compare those as sets.
std::vector<int> expected_book(GraphKind kind, int p, int n, int r) {
  std::vector<int> book;
  if (kind == GraphKind::kHypercube) {
    for (int bit = 1; bit < n; bit *= 2) book.push_back(r ^ bit);
    return book;
  }
  for (int64_t d : design_offsets(kind, p, n)) {
    const int peer = static_cast<int>(((r + d) % n + n) % n);
    if (peer != r && std::find(book.begin(), book.end(), peer) == book.end()) book.push_back(peer);
  }
  return book;
}

// Which (kind, p, n) the design accepts, decided from the rules rather than by asking Graph.
bool design_accepts(GraphKind kind, int p, int n) {
  if (p < 1 || p >= n) return false;
  if (is_bipartite_kind(kind) && n % 2 != 0) return false;
  if (kind == GraphKind::kRing && p > 2) return false;
  if (kind == GraphKind::kHypercube && (n & (n - 1)) != 0) return false;
  return p <= static_cast<int>(expected_book(kind, p, n, 0).size());
}

std::set<int> as_set(const std::vector<int>& v) { return {v.begin(), v.end()}; }

// Calls body(graph, p, n) for every accepted (kind, p in 1..3, n in 2..17).
void for_each_valid_graph(const std::function<void(const Graph&, int, int)>& body) {
  for (GraphKind kind : kAllKinds) {
    for (int n = 2; n <= 17; ++n) {
      for (int p = 1; p <= 3; ++p) {
        if (!design_accepts(kind, p, n)) continue;
        SCOPED_TRACE(std::string(graph_kind_name(kind)) + " n=" + std::to_string(n) +
                     " p=" + std::to_string(p));
        body(Graph({.kind = kind, .peers_per_itr = p}, n), p, n);
      }
    }
  }
}

// Expects body() to throw gossip::ValueError and returns its message.
std::string value_error_message(const std::function<void()>& body) {
  try {
    body();
  } catch (const ValueError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected gossip::ValueError";
  return "";
}

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not mention '" << part << "'";
}

Graph make_graph(GraphKind kind, int n, int p = 1) {
  return Graph({.kind = kind, .peers_per_itr = p}, n);
}

}  // namespace

TEST(GraphSchedule, NPeerExponentialMatchesDesign) {
  const Graph n8 = make_graph(GraphKind::kNPeerDynamicDirectedExponential, 8);
  EXPECT_EQ(n8.phone_book(0), (std::vector<int>{1, 2, 4}));
  const std::vector<int> book8{1, 2, 4};
  for (int64_t t = 0; t < 7; ++t) EXPECT_EQ(n8.out_peers(0, t), std::vector<int>{book8[t % 3]});
  const Graph n32 = make_graph(GraphKind::kNPeerDynamicDirectedExponential, 32);
  EXPECT_EQ(n32.phone_book(0), (std::vector<int>{1, 2, 4, 8, 16}));
  EXPECT_EQ(n32.phone_book(30), (std::vector<int>{31, 0, 2, 6, 14}));
  // p = 2 at n = 10: powers of 3 up to 9, offsets 1,2,3,6,9,18 (18 wraps to 8).
  const Graph p2 = make_graph(GraphKind::kNPeerDynamicDirectedExponential, 10, 2);
  EXPECT_EQ(p2.phone_book(0), (std::vector<int>{1, 2, 3, 6, 9, 8}));
  EXPECT_EQ(p2.out_peers(0, 0), (std::vector<int>{1, 2}));
  EXPECT_EQ(p2.out_peers(0, 1), (std::vector<int>{3, 6}));
  EXPECT_EQ(p2.out_peers(0, 2), (std::vector<int>{9, 8}));
  EXPECT_EQ(p2.out_peers(0, 3), (std::vector<int>{1, 2}));
  EXPECT_EQ(p2.period(), 3);
}

TEST(GraphSchedule, DirectedExponentialMatchesDesign) {
  const Graph n8 = make_graph(GraphKind::kDynamicDirectedExponential, 8);
  EXPECT_EQ(n8.phone_book(0), (std::vector<int>{1, 7, 2, 6, 4}));
  EXPECT_EQ(n8.period(), 5);
  const Graph n32 = make_graph(GraphKind::kDynamicDirectedExponential, 32);
  EXPECT_EQ(n32.phone_book(0), (std::vector<int>{1, 31, 2, 30, 4, 28, 8, 24, 16}));
  // p = 2 walks two slots per round and wraps around the 5-entry book.
  const Graph p2 = make_graph(GraphKind::kDynamicDirectedExponential, 8, 2);
  EXPECT_EQ(p2.out_peers(0, 0), (std::vector<int>{1, 7}));
  EXPECT_EQ(p2.out_peers(0, 1), (std::vector<int>{2, 6}));
  EXPECT_EQ(p2.out_peers(0, 2), (std::vector<int>{4, 1}));
  EXPECT_EQ(p2.out_peers(3, 3), (std::vector<int>{2, 5}));
  EXPECT_EQ(p2.period(), 5);
}

TEST(GraphSchedule, LinearRingAndHypercubeMatchDesign) {
  EXPECT_EQ(make_graph(GraphKind::kDynamicDirectedLinear, 8).phone_book(0),
            (std::vector<int>{1, 7, 3, 5}));
  EXPECT_EQ(make_graph(GraphKind::kDynamicDirectedLinear, 7).phone_book(0),
            (std::vector<int>{1, 6, 3, 4, 5, 2}));
  const Graph ring1 = make_graph(GraphKind::kRing, 5, 1);
  const Graph ring2 = make_graph(GraphKind::kRing, 5, 2);
  for (int64_t t = 0; t < 4; ++t) {
    EXPECT_EQ(ring1.out_peers(4, t), (std::vector<int>{0}));
    EXPECT_EQ(as_set(ring2.out_peers(2, t)), (std::set<int>{1, 3}));
  }
  EXPECT_FALSE(ring1.is_dynamic());
  EXPECT_FALSE(ring2.is_dynamic());
  const Graph cube = make_graph(GraphKind::kHypercube, 8);
  EXPECT_EQ(cube.phone_book(5), (std::vector<int>{4, 7, 1}));
  EXPECT_EQ(cube.out_peers(5, 4), (std::vector<int>{7}));
}

TEST(GraphSchedule, EveryKindFollowsItsPhoneBookSlots) {
  for_each_valid_graph([](const Graph& graph, int p, int n) {
    const int length = static_cast<int>(expected_book(graph.kind(), p, n, 0).size());
    EXPECT_EQ(graph.period(), length / std::gcd(length, p));
    for (int r = 0; r < n; ++r) {
      const std::vector<int> book = expected_book(graph.kind(), p, n, r);
      if (is_bipartite_kind(graph.kind())) {
        EXPECT_EQ(as_set(graph.phone_book(r)), as_set(book)) << "rank " << r;
      } else {
        EXPECT_EQ(graph.phone_book(r), book) << "rank " << r;
      }
      // Slots (g + t*p) mod L, including a round number past the int32 range.
      for (int64_t t : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{7}, int64_t{5'000'000'011}}) {
        std::vector<int> expected_out;
        for (int g = 0; g < p; ++g)
          expected_out.push_back(graph.phone_book(r)[(g + t * p) % length]);
        EXPECT_EQ(graph.out_peers(r, t), expected_out) << "rank " << r << " round " << t;
        // In-peers in slot order, then ascending sender.
        std::vector<int> expected_in;
        for (int g = 0; g < p; ++g) {
          for (int q = 0; q < n; ++q) {
            if (graph.phone_book(q)[(g + t * p) % length] == r) expected_in.push_back(q);
          }
        }
        EXPECT_EQ(graph.in_peers(r, t), expected_in) << "rank " << r << " round " << t;
      }
    }
  });
}

TEST(GraphSchedule, PeersAreEveryRankMetOverAPeriodAndSymmetric) {
  // What the NCCL transport connects ahead of the rounds: checked against the rounds themselves.
  const Graph n8 = make_graph(GraphKind::kNPeerDynamicDirectedExponential, 8);
  EXPECT_EQ(n8.peers(0), (std::vector<int>{1, 2, 4, 6, 7}));  // out +1,+2,+4; in -1,-2,-4
  for_each_valid_graph([](const Graph& graph, int, int n) {
    for (int r = 0; r < n; ++r) {
      std::set<int> met;
      for (int64_t t = 0; t < graph.period(); ++t) {
        for (const int q : graph.out_peers(r, t)) met.insert(q);
        for (const int q : graph.in_peers(r, t)) met.insert(q);
      }
      const std::vector<int> peers = graph.peers(r);
      EXPECT_EQ(std::set<int>(peers.begin(), peers.end()), met) << "rank " << r;
      EXPECT_TRUE(std::is_sorted(peers.begin(), peers.end()));
      for (const int q : peers) {
        const std::vector<int> back = graph.peers(q);
        EXPECT_TRUE(std::find(back.begin(), back.end(), r) != back.end()) << r << " " << q;
      }
    }
  });
}

TEST(GraphSchedule, IntegerLogarithmsAreExact) {
  // (p+1)^5 = 243 <= n-1 = 243: the offset 243 belongs in the book, and so does 2*243 = 486,
  // which wraps to 242. A float log_3(243) = 4.999... would drop both (L = 10).
  const Graph g244 = make_graph(GraphKind::kNPeerDynamicDirectedExponential, 244, 2);
  ASSERT_EQ(g244.phone_book(0).size(), 12u);
  EXPECT_EQ(g244.phone_book(0)[10], 243);
  EXPECT_EQ(g244.phone_book(0).back(), 242);
  EXPECT_EQ(make_graph(GraphKind::kNPeerDynamicDirectedExponential, 243, 2).phone_book(0).size(),
            10u);
  for (int n : {82, 243, 244, 730, 731}) {
    EXPECT_EQ(make_graph(GraphKind::kNPeerDynamicDirectedExponential, n, 2).phone_book(1),
              expected_book(GraphKind::kNPeerDynamicDirectedExponential, 2, n, 1))
        << "n=" << n;
  }
}

TEST(GraphProperties, NoSelfEdgesAndDistinctPeers) {
  for_each_valid_graph([](const Graph& graph, int p, int n) {
    for (int r = 0; r < n; ++r) {
      const std::vector<int>& book = graph.phone_book(r);
      EXPECT_EQ(as_set(book).size(), book.size()) << "rank " << r;
      EXPECT_EQ(std::count(book.begin(), book.end(), r), 0) << "rank " << r;
      for (int64_t t = 0; t < 2 * graph.period(); ++t) {
        const std::vector<int> out = graph.out_peers(r, t);
        EXPECT_EQ(as_set(out).size(), out.size());
        EXPECT_EQ(as_set(out).count(r), 0u);
        for (int peer : out) EXPECT_TRUE(peer >= 0 && peer < n) << peer;
      }
    }
  });
}

TEST(GraphProperties, RegularAndInPeersMirrorOutPeers) {
  for_each_valid_graph([](const Graph& graph, int p, int n) {
    EXPECT_TRUE(graph.is_regular());
    for (int64_t t = 0; t < 2 * graph.period() + 1; ++t) {
      std::vector<std::set<int>> senders(n);  // built from out_peers only
      for (int q = 0; q < n; ++q) {
        const std::vector<int> out = graph.out_peers(q, t);
        EXPECT_EQ(static_cast<int>(out.size()), p);
        for (int r : out) senders[r].insert(q);
      }
      for (int r = 0; r < n; ++r) {
        const std::vector<int> in = graph.in_peers(r, t);
        EXPECT_EQ(static_cast<int>(in.size()), p) << "rank " << r << " round " << t;
        EXPECT_EQ(as_set(in), senders[r]) << "rank " << r << " round " << t;
      }
    }
  });
}

TEST(GraphProperties, PairsSymmetricallyFlagMatchesSchedule) {
  for_each_valid_graph([](const Graph& graph, int p, int n) {
    bool symmetric = true;
    for (int64_t t = 0; t < graph.period(); ++t) {
      for (int r = 0; r < n; ++r) {
        symmetric = symmetric && as_set(graph.out_peers(r, t)) == as_set(graph.in_peers(r, t));
      }
    }
    EXPECT_EQ(graph.pairs_symmetrically(), symmetric);
    EXPECT_EQ(graph.is_bipartite(), is_bipartite_kind(graph.kind()));
  });
  EXPECT_TRUE(make_graph(GraphKind::kHypercube, 16, 2).pairs_symmetrically());
  EXPECT_TRUE(make_graph(GraphKind::kRing, 6, 2).pairs_symmetrically());
  EXPECT_TRUE(make_graph(GraphKind::kDynamicBipartiteExponential, 12).pairs_symmetrically());
  EXPECT_TRUE(make_graph(GraphKind::kDynamicBipartiteLinear, 10, 2).pairs_symmetrically());
  EXPECT_FALSE(make_graph(GraphKind::kDynamicDirectedExponential, 8).pairs_symmetrically());
  EXPECT_FALSE(make_graph(GraphKind::kNPeerDynamicDirectedExponential, 8).pairs_symmetrically());
  EXPECT_FALSE(make_graph(GraphKind::kRing, 5, 1).pairs_symmetrically());
}

TEST(GraphProperties, BipartiteGraphsPairOppositeParity) {
  for (GraphKind kind :
       {GraphKind::kDynamicBipartiteExponential, GraphKind::kDynamicBipartiteLinear}) {
    for (int n = 2; n <= 16; n += 2) {
      for (int p = 1; p <= 2; ++p) {
        if (!design_accepts(kind, p, n)) continue;
        SCOPED_TRACE(std::string(graph_kind_name(kind)) + " n=" + std::to_string(n) +
                     " p=" + std::to_string(p));
        const Graph graph({.kind = kind, .peers_per_itr = p}, n);
        for (int64_t t = 0; t < 2 * graph.period() + 1; ++t) {
          for (int r = 0; r < n; ++r) {
            const std::vector<int> out = graph.out_peers(r, t);
            for (int peer : out) EXPECT_NE(peer % 2, r % 2) << r << " -> " << peer;
            // Symmetric pairing: r sends to s exactly when s sends to r.
            EXPECT_EQ(as_set(out), as_set(graph.in_peers(r, t))) << "rank " << r << " round " << t;
          }
        }
      }
    }
  }
}

TEST(GraphEdgeCases, WorldSizeOneHasNoPeers) {
  for (GraphKind kind : kAllKinds) {
    for (int p : {1, 2}) {
      const Graph graph({.kind = kind, .peers_per_itr = p}, 1);
      EXPECT_TRUE(graph.phone_book(0).empty()) << graph_kind_name(kind);
      for (int64_t t = 0; t < 3; ++t) {
        EXPECT_TRUE(graph.out_peers(0, t).empty());
        EXPECT_TRUE(graph.in_peers(0, t).empty());
      }
    }
  }
  const Graph custom({.kind = GraphKind::kCustom, .phone_books = {{}}}, 1);
  EXPECT_TRUE(custom.out_peers(0, 5).empty());
}

TEST(GraphEdgeCases, CustomPhoneBookIsUsedAsGiven) {
  const Graph graph({.kind = GraphKind::kCustom, .phone_books = {{2, 1}, {0, 2}, {1, 0}}}, 3);
  EXPECT_EQ(graph.out_peers(0, 0), (std::vector<int>{2}));
  EXPECT_EQ(graph.out_peers(0, 1), (std::vector<int>{1}));
  EXPECT_EQ(graph.in_peers(0, 1), (std::vector<int>{2}));
  EXPECT_EQ(graph.in_peers(2, 0), (std::vector<int>{0}));
  // Two senders share a slot here (slot 0: 1 and 3 -> 0), yet every round is regular; in-peers
  // come in slot order, then ascending sender.
  const Graph shared({.kind = GraphKind::kCustom,
                      .peers_per_itr = 2,
                      .phone_books = {{1, 2}, {0, 3}, {1, 3}, {0, 2}}},
                     4);
  EXPECT_EQ(shared.in_peers(0, 0), (std::vector<int>{1, 3}));
  EXPECT_EQ(shared.in_peers(1, 0), (std::vector<int>{0, 2}));
  EXPECT_EQ(shared.in_peers(3, 0), (std::vector<int>{1, 2}));
}

TEST(GraphErrors, OptionsThatDoNotFitTheWorldSize) {
  auto error = [](GraphKind kind, int n, int p) {
    return value_error_message([&] { Graph({.kind = kind, .peers_per_itr = p}, n); });
  };
  std::string message = error(GraphKind::kDynamicBipartiteExponential, 5, 1);
  EXPECT_TRUE(Contains(message, "world size"));
  EXPECT_TRUE(Contains(message, "5"));
  EXPECT_TRUE(Contains(error(GraphKind::kDynamicBipartiteLinear, 7, 1), "7"));
  message = error(GraphKind::kNPeerDynamicDirectedExponential, 8, 0);
  EXPECT_TRUE(Contains(message, "peers_per_itr"));
  EXPECT_TRUE(Contains(message, "0"));
  EXPECT_TRUE(Contains(error(GraphKind::kDynamicDirectedExponential, 4, 4), "peers_per_itr"));
  EXPECT_TRUE(Contains(error(GraphKind::kRing, 2, 2), "peers_per_itr"));
  message = error(GraphKind::kRing, 8, 3);
  EXPECT_TRUE(Contains(message, "peers_per_itr"));
  EXPECT_TRUE(Contains(message, "3"));
  message = error(GraphKind::kHypercube, 6, 1);
  EXPECT_TRUE(Contains(message, "power of two"));
  EXPECT_TRUE(Contains(message, "6"));
  // More peers per round than distinct peers: the hypercube at n = 4 has 2.
  EXPECT_TRUE(Contains(error(GraphKind::kHypercube, 4, 3), "peers_per_itr (3)"));
  EXPECT_TRUE(Contains(error(GraphKind::kNPeerDynamicDirectedExponential, 0, 1), "world_size"));
}

TEST(GraphErrors, BadCustomPhoneBooks) {
  auto error = [](std::vector<std::vector<int>> books, int n, int p = 1) {
    return value_error_message(
        [&] { Graph({.kind = GraphKind::kCustom, .peers_per_itr = p, .phone_books = books}, n); });
  };
  EXPECT_TRUE(Contains(error({{0}, {0}}, 2), "itself"));
  std::string message = error({{1}, {2}}, 2);
  EXPECT_TRUE(Contains(message, "peer 2"));
  EXPECT_TRUE(Contains(message, "outside"));
  EXPECT_TRUE(Contains(error({{1, 2}, {2, 0}, {0, 0}}, 3), "twice"));
  EXPECT_TRUE(Contains(error({{1, 2}, {0}, {0, 1}}, 3), "same length"));
  // Everyone sends to 0 in slot 0: node 0 has in-degree 2, node 2 has none.
  message = error({{1}, {0}, {0}}, 3);
  EXPECT_TRUE(Contains(message, "in-degree"));
  EXPECT_TRUE(Contains(error({{1}, {0}}, 3), "phone_books"));
  EXPECT_TRUE(Contains(
      value_error_message([] { Graph({.kind = GraphKind::kRing, .phone_books = {{1}, {0}}}, 2); }),
      "phone_books"));
}

TEST(GraphErrors, BadRankOrRound) {
  const Graph graph = make_graph(GraphKind::kRing, 4);
  EXPECT_TRUE(Contains(value_error_message([&] { graph.out_peers(4, 0); }), "rank"));
  EXPECT_TRUE(Contains(value_error_message([&] { graph.in_peers(-1, 0); }), "rank"));
  EXPECT_TRUE(Contains(value_error_message([&] { graph.out_peers(0, -1); }), "round"));
}

TEST(MixingWeightsTest, UniformGivesEveryoneOneShare) {
  for (int k = 0; k <= 6; ++k) {
    const MixingWeights w = mixing_weights({.kind = MixingKind::kUniform}, k);
    EXPECT_DOUBLE_EQ(w.self_weight, 1.0 / (k + 1)) << k;
    if (k > 0) EXPECT_DOUBLE_EQ(w.peer_weight, 1.0 / (k + 1)) << k;
  }
}

TEST(MixingWeightsTest, SelfWeightSplitsTheRestEvenly) {
  for (double a : {0.1, 0.5, 0.9}) {
    for (int k = 1; k <= 4; ++k) {
      const MixingWeights w =
          mixing_weights({.kind = MixingKind::kSelfWeight, .self_weight = a}, k);
      EXPECT_DOUBLE_EQ(w.self_weight, a);
      EXPECT_DOUBLE_EQ(w.peer_weight, (1.0 - a) / k);
    }
  }
  // With nobody to send to, a node keeps everything.
  const MixingWeights alone =
      mixing_weights({.kind = MixingKind::kSelfWeight, .self_weight = 0.3}, 0);
  EXPECT_EQ(alone.self_weight, 1.0);
}

TEST(MixingWeightsTest, InvalidSelfWeightThrows) {
  for (double a : {0.0, 1.0, -0.25, 1.5, std::numeric_limits<double>::quiet_NaN(),
                   std::numeric_limits<double>::infinity()}) {
    const MixingOptions options{.kind = MixingKind::kSelfWeight, .self_weight = a};
    EXPECT_TRUE(Contains(value_error_message([&] { validate(options); }), "self_weight")) << a;
    EXPECT_TRUE(Contains(value_error_message([&] { mixing_weights(options, 2); }), "self_weight"));
  }
  EXPECT_TRUE(Contains(value_error_message([] { mixing_weights({}, -1); }), "num_out_peers"));
}

}  // namespace gossip
