// Communication graphs: who sends to whom in each gossip round.
//
// The graphs of SGP (Assran et al., ICML 2019) with its bugs fixed (exact integer logarithms,
// bipartite graphs that really pair nodes symmetrically), a hypercube pairing and a user-supplied
// phone book. docs/design.md section 2 is the specification.
//
// A graph is a phone book per node (its ordered, distinct out-peers, never itself) of one common
// length L. Round t uses the slots (g + t * peers_per_itr) mod L for g = 0..peers_per_itr-1.
//
// Cross-rank contract: every method is a pure function of (options, world_size, rank, round).
// Every rank builds the same Graph and computes the same schedule locally; nothing is negotiated.
//
// Usage:
//   gossip::Graph graph({.kind = gossip::GraphKind::kDynamicDirectedExponential}, /*world_size=*/8);
//   std::vector<int> to = graph.out_peers(/*rank=*/3, /*round=*/0);    // {4}
//   std::vector<int> from = graph.in_peers(/*rank=*/3, /*round=*/0);   // {2}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gossip {

enum class GraphKind {
  kNPeerDynamicDirectedExponential,
  kDynamicDirectedExponential,
  kDynamicBipartiteExponential,
  kDynamicDirectedLinear,
  kDynamicBipartiteLinear,
  kRing,
  kHypercube,
  kCustom,
};

// The Python class name of a kind, e.g. "DynamicDirectedExponentialGraph".
const char* graph_kind_name(GraphKind kind);

struct GraphOptions {
  GraphKind kind = GraphKind::kNPeerDynamicDirectedExponential;
  int peers_per_itr = 1;
  // kCustom only: phone_books[r] lists the out-peers of node r; its size is the world size.
  std::vector<std::vector<int>> phone_books;
};

// Throws gossip::ValueError naming the bad field: a kind that is no GraphKind (pybind11 makes one
// from any int), peers_per_itr outside [1, kMaxWorldSize), more phone books than kMaxWorldSize.
// What depends on the world size is Graph's to check.
void validate(const GraphOptions& options);

class Graph {
 public:
  // Validates the options for this world size and throws gossip::ValueError saying why they do
  // not fit. world_size 1 is always valid: the node has no peers. world_size is at most
  // kMaxWorldSize, and the schedule at most kMaxScheduleEntries (common/limits.h): a linear
  // graph's grows as the square of the world size.
  Graph(GraphOptions options, int world_size);

  int world_size() const { return world_size_; }
  int peers_per_itr() const { return options_.peers_per_itr; }
  GraphKind kind() const { return options_.kind; }
  const GraphOptions& options() const { return options_; }

  const std::vector<int>& phone_book(int rank) const;
  std::vector<int> out_peers(int rank, int64_t round) const;
  // Ordered by slot, then by sender rank: a fixed order, so sums over received messages are
  // reproducible.
  std::vector<int> in_peers(int rank, int64_t round) const;
  // Every rank that `rank` exchanges a message with in some round, ascending: its phone book and
  // the ranks whose phone book holds it. Symmetric: q is among peers(r) exactly when r is among
  // peers(q). What a transport that connects its peers ahead of the rounds connects.
  std::vector<int> peers(int rank) const;

  // The schedule repeats after this many rounds.
  int64_t period() const { return period_; }
  // Every round, every node has as many in-peers as out-peers.
  bool is_regular() const { return is_regular_; }
  // Active (odd) nodes only talk to passive (even) nodes and the other way round.
  bool is_bipartite() const;
  // Every round, every node's in-peers equal its out-peers: the graph pairs nodes symmetrically,
  // as push-pull averaging (D-PSGD) needs.
  bool pairs_symmetrically() const { return pairs_symmetrically_; }
  // The peers change from round to round.
  bool is_dynamic() const { return period_ > 1; }

 private:
  int slot(int64_t round, int g) const;
  void build_phone_books();
  // Refuses a schedule of `peers` phone-book slots per rank beyond kMaxScheduleEntries, before
  // anything of that size is allocated.
  void check_schedule_size(int64_t peers) const;
  void validate_and_index();

  GraphOptions options_;
  int world_size_;
  int phone_book_length_ = 0;
  int64_t period_ = 1;
  bool is_regular_ = true;
  bool pairs_symmetrically_ = true;
  std::vector<std::vector<int>> phone_books_;
  // senders_by_slot_[s][r]: the nodes q with phone_books_[q][s] == r, ascending.
  std::vector<std::vector<std::vector<int>>> senders_by_slot_;
};

}  // namespace gossip
