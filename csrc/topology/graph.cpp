#include "topology/graph.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "common/error.h"
#include "common/limits.h"

namespace gossip {
namespace {

int64_t positive_mod(int64_t value, int64_t n) {
  const int64_t r = value % n;
  return r < 0 ? r + n : r;
}

// Signed rank offsets shared by every node of an offset-based graph, in phone-book order. All
// powers are computed with integers: SGP's float logarithms give the wrong peer count at exact
// powers (log_3(243) == 4.999...).
std::vector<int64_t> offsets_for(GraphKind kind, int peers_per_itr, int64_t n) {
  std::vector<int64_t> offsets;
  switch (kind) {
    case GraphKind::kNPeerDynamicDirectedExponential:
      // r + j * (p+1)^i for i = 0.. while (p+1)^i <= n-1, j = 1..p.
      for (int64_t step = 1; step <= n - 1; step *= peers_per_itr + 1) {
        for (int64_t j = 1; j <= peers_per_itr; ++j) offsets.push_back(j * step);
      }
      break;
    case GraphKind::kDynamicDirectedExponential:
      for (int64_t step = 1; step <= n - 1; step *= 2) {
        offsets.push_back(step);
        offsets.push_back(-step);
      }
      break;
    case GraphKind::kDynamicBipartiteExponential:
      // Odd offsets 1, then 1 + 2^i: they always join an even node to an odd one.
      offsets = {1, -1};
      for (int64_t step = 2; step <= n - 1; step *= 2) {
        offsets.push_back(1 + step);
        offsets.push_back(-(1 + step));
      }
      break;
    case GraphKind::kDynamicDirectedLinear:
    case GraphKind::kDynamicBipartiteLinear:
      for (int64_t i = 1; i <= n - 1; i += 2) {
        offsets.push_back(i);
        offsets.push_back(-i);
      }
      break;
    case GraphKind::kRing:
      offsets = peers_per_itr == 1 ? std::vector<int64_t>{1} : std::vector<int64_t>{1, -1};
      break;
    case GraphKind::kHypercube:
    case GraphKind::kCustom:
      GOSSIP_INTERNAL_ASSERT(false);
  }
  return offsets;
}

}  // namespace

const char* graph_kind_name(GraphKind kind) {
  switch (kind) {
    case GraphKind::kNPeerDynamicDirectedExponential:
      return "NPeerDynamicDirectedExponentialGraph";
    case GraphKind::kDynamicDirectedExponential:
      return "DynamicDirectedExponentialGraph";
    case GraphKind::kDynamicBipartiteExponential:
      return "DynamicBipartiteExponentialGraph";
    case GraphKind::kDynamicDirectedLinear:
      return "DynamicDirectedLinearGraph";
    case GraphKind::kDynamicBipartiteLinear:
      return "DynamicBipartiteLinearGraph";
    case GraphKind::kRing:
      return "RingGraph";
    case GraphKind::kHypercube:
      return "HypercubeGraph";
    case GraphKind::kCustom:
      return "CustomGraph";
  }
  return "unknown graph";
}

void validate(const GraphOptions& options) {
  const int kind = static_cast<int>(options.kind);
  GOSSIP_CHECK_ARG(kind >= static_cast<int>(GraphKind::kNPeerDynamicDirectedExponential) &&
                       kind <= static_cast<int>(GraphKind::kCustom),
                   "GraphOptions: kind must be one of GraphKind's values, got ", kind);
  const char* name = graph_kind_name(options.kind);
  GOSSIP_CHECK_ARG(options.peers_per_itr >= 1, name, ": peers_per_itr must be >= 1, got ",
                   options.peers_per_itr);
  GOSSIP_CHECK_ARG(options.peers_per_itr < kMaxWorldSize, name, ": peers_per_itr must be < ",
                   kMaxWorldSize, " (the largest world size), got ", options.peers_per_itr);
  GOSSIP_CHECK_ARG(options.phone_books.size() <= static_cast<size_t>(kMaxWorldSize), name,
                   ": phone_books has ", options.phone_books.size(),
                   " entries, more than the largest world size, ", kMaxWorldSize);
}

Graph::Graph(GraphOptions options, int world_size)
    : options_(std::move(options)), world_size_(world_size) {
  validate(options_);
  const char* name = graph_kind_name(options_.kind);
  GOSSIP_CHECK_ARG(world_size >= 1, name, ": world_size must be >= 1, got ", world_size);
  check_world_size_cap(world_size, name);
  if (options_.kind == GraphKind::kCustom) {
    GOSSIP_CHECK_ARG(static_cast<int>(options_.phone_books.size()) == world_size, name,
                     ": phone_books has ", options_.phone_books.size(),
                     " entries but the world size is ", world_size);
  } else {
    GOSSIP_CHECK_ARG(options_.phone_books.empty(), name,
                     ": phone_books is only for CustomGraph");
  }
  if (world_size == 1) {
    // A single node has nobody to talk to: gossip is a no-op, whatever the graph.
    GOSSIP_CHECK_ARG(options_.kind != GraphKind::kCustom || options_.phone_books[0].empty(), name,
                     ": node 0 of a one-node graph can have no peers, got ",
                     options_.phone_books[0]);
    phone_books_.assign(1, {});
    return;
  }
  GOSSIP_CHECK_ARG(options_.peers_per_itr < world_size, name, ": peers_per_itr must be < world_size (",
                   world_size, "), got ", options_.peers_per_itr);
  if (is_bipartite()) {
    GOSSIP_CHECK_ARG(world_size % 2 == 0, name,
                     " pairs even nodes with odd ones and needs an even world size, got ",
                     world_size);
  }
  if (options_.kind == GraphKind::kRing) {
    GOSSIP_CHECK_ARG(options_.peers_per_itr <= 2, name,
                     ": peers_per_itr must be 1 (r -> r+1) or 2 (r -> r+-1), got ",
                     options_.peers_per_itr);
  }
  if (options_.kind == GraphKind::kHypercube) {
    GOSSIP_CHECK_ARG((world_size & (world_size - 1)) == 0, name,
                     " needs a world size that is a power of two, got ", world_size);
  }
  build_phone_books();
  validate_and_index();
}

bool Graph::is_bipartite() const {
  return options_.kind == GraphKind::kDynamicBipartiteExponential ||
         options_.kind == GraphKind::kDynamicBipartiteLinear;
}

void Graph::check_schedule_size(int64_t peers) const {
  const int64_t entries = peers * world_size_;
  GOSSIP_CHECK_ARG(entries <= kMaxScheduleEntries, graph_kind_name(options_.kind), ": world_size ",
                   world_size_, " gives each rank up to ", peers, " peers, a schedule of ",
                   entries, " entries, more than the ", kMaxScheduleEntries,
                   " a graph may hold; use an exponential graph for a world this large");
}

void Graph::build_phone_books() {
  const int64_t n = world_size_;
  if (options_.kind == GraphKind::kCustom) {
    check_schedule_size(static_cast<int64_t>(options_.phone_books[0].size()));
    phone_books_ = options_.phone_books;
    return;
  }
  phone_books_.assign(n, {});
  if (options_.kind == GraphKind::kHypercube) {
    for (int r = 0; r < n; ++r) {
      for (int step = 1; step < n; step *= 2) phone_books_[r].push_back(r ^ step);
    }
    return;
  }
  // The offsets bound each phone book's length (duplicates modulo n are dropped below).
  const std::vector<int64_t> offsets = offsets_for(options_.kind, options_.peers_per_itr, n);
  check_schedule_size(static_cast<int64_t>(offsets.size()));
  for (int64_t r = 0; r < n; ++r) {
    // Passive (even) nodes of a bipartite graph walk the offsets backwards, so that the active
    // node r + d and the passive node r pair up in the same slot: a symmetric exchange.
    const int64_t sign = (is_bipartite() && r % 2 == 0) ? -1 : 1;
    std::vector<int>& book = phone_books_[r];
    for (int64_t offset : offsets) {
      const int peer = static_cast<int>(positive_mod(r + sign * offset, n));
      if (peer != r && std::find(book.begin(), book.end(), peer) == book.end()) {
        book.push_back(peer);
      }
    }
  }
}

void Graph::validate_and_index() {
  const int n = world_size_;
  const int p = options_.peers_per_itr;
  const char* name = graph_kind_name(options_.kind);
  phone_book_length_ = static_cast<int>(phone_books_[0].size());
  for (int r = 0; r < n; ++r) {
    const std::vector<int>& book = phone_books_[r];
    GOSSIP_CHECK_ARG(static_cast<int>(book.size()) == phone_book_length_, name,
                     ": every phone book must have the same length; node 0 has ",
                     phone_book_length_, " peers, node ", r, " has ", book.size());
    std::set<int> seen;
    for (int peer : book) {
      GOSSIP_CHECK_ARG(peer >= 0 && peer < n, name, ": node ", r, " lists peer ", peer,
                       ", outside [0, ", n, ")");
      GOSSIP_CHECK_ARG(peer != r, name, ": node ", r, " lists itself as a peer (self edge)");
      GOSSIP_CHECK_ARG(seen.insert(peer).second, name, ": node ", r, " lists peer ", peer,
                       " twice");
    }
  }
  GOSSIP_CHECK_ARG(p <= phone_book_length_, name, ": peers_per_itr (", p,
                   ") exceeds the number of distinct peers of each node (", phone_book_length_,
                   ") at world size ", n);

  const int length = phone_book_length_;
  senders_by_slot_.assign(length, std::vector<std::vector<int>>(n));
  for (int q = 0; q < n; ++q) {
    for (int s = 0; s < length; ++s) senders_by_slot_[s][phone_books_[q][s]].push_back(q);
  }
  period_ = length / std::gcd(length, p);

  for (int64_t t = 0; t < period_; ++t) {
    for (int r = 0; r < n; ++r) {
      std::vector<int> out = out_peers(r, t);
      std::vector<int> in = in_peers(r, t);
      if (in.size() != out.size()) is_regular_ = false;
      std::sort(out.begin(), out.end());
      std::sort(in.begin(), in.end());
      if (in != out) pairs_symmetrically_ = false;
    }
  }
  if (!is_regular_) {
    // Only a custom phone book can get here. Uniform mixing keeps every push-sum weight at 1 only
    // if in-degree equals out-degree, so such a graph is refused, naming the first node at fault.
    GOSSIP_INTERNAL_ASSERT(options_.kind == GraphKind::kCustom);
    for (int64_t t = 0; t < period_; ++t) {
      for (int r = 0; r < n; ++r) {
        const size_t in_degree = in_peers(r, t).size();
        GOSSIP_CHECK_ARG(in_degree == static_cast<size_t>(p), name,
                         ": in-degree must equal out-degree (", p, ") in every round, but node ",
                         r, " has ", in_degree, " in-peers in round ", t);
      }
    }
  }
}

int Graph::slot(int64_t round, int g) const {
  // Reduce the round first: round * peers_per_itr would overflow for rounds near 2^63.
  const int64_t length = phone_book_length_;
  const int64_t p = options_.peers_per_itr;
  return static_cast<int>(positive_mod(g + (round % length) * p, length));
}

const std::vector<int>& Graph::phone_book(int rank) const {
  GOSSIP_CHECK_ARG(rank >= 0 && rank < world_size_, "rank must be in [0, ", world_size_,
                   "), got ", rank);
  return phone_books_[rank];
}

std::vector<int> Graph::out_peers(int rank, int64_t round) const {
  const std::vector<int>& book = phone_book(rank);
  GOSSIP_CHECK_ARG(round >= 0, "round must be >= 0, got ", round);
  std::vector<int> peers;
  if (book.empty()) return peers;
  for (int g = 0; g < options_.peers_per_itr; ++g) peers.push_back(book[slot(round, g)]);
  return peers;
}

std::vector<int> Graph::in_peers(int rank, int64_t round) const {
  phone_book(rank);  // validates rank
  GOSSIP_CHECK_ARG(round >= 0, "round must be >= 0, got ", round);
  std::vector<int> peers;
  if (senders_by_slot_.empty()) return peers;
  for (int g = 0; g < options_.peers_per_itr; ++g) {
    const std::vector<int>& senders = senders_by_slot_[slot(round, g)][rank];
    peers.insert(peers.end(), senders.begin(), senders.end());
  }
  return peers;
}

std::vector<int> Graph::peers(int rank) const {
  std::vector<bool> is_peer(world_size_, false);
  for (const int q : phone_book(rank)) is_peer[q] = true;  // phone_book() validates rank
  for (int q = 0; q < world_size_; ++q) {
    const std::vector<int>& book = phone_books_[q];
    if (std::find(book.begin(), book.end(), rank) != book.end()) is_peer[q] = true;
  }
  std::vector<int> result;
  for (int q = 0; q < world_size_; ++q) {
    if (is_peer[q]) result.push_back(q);
  }
  return result;
}

}  // namespace gossip
