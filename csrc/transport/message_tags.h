#pragma once

#include <cstdint>

// Every tag gossip_ext's point-to-point messages carry on a process group, in one registry.
// c10d matches a send to a receive by (peer, tag) alone, so two kinds of message that share a
// group and a tag could be taken for one another: each kind owns a range here, and the Python
// layer reads the ranges from the module (gossip_ext._C.MESSAGE_TAGS, through
// gossip_ext.gossip.transport) instead of keeping numbers of its own. c10d's tags are ints, so
// the ranges stay below 2^31.
namespace gossip::tags {

// The engine's rounds (process_group_transport.cpp): round * messages-per-peer + k, wrapped.
constexpr int64_t kRoundBase = 0;
constexpr int64_t kRoundSpan = int64_t{1} << 30;
// An outer step's exchange by gossip, dense or sparse (averagings/gossip_exchange.py,
// averagings/sparse_gossip.py): one tag per round and bucket, wrapped.
constexpr int64_t kOuterExchangeBase = kRoundBase + kRoundSpan;
constexpr int64_t kOuterExchangeSpan = int64_t{1} << 28;
// An elastic epoch's liveness checks (process_group/liveness.h): a ping and its answer.
constexpr int64_t kLivenessBase = kOuterExchangeBase + kOuterExchangeSpan;
constexpr int64_t kLivenessSpan = int64_t{1} << 28;
constexpr int64_t kPingTag = kLivenessBase;
constexpr int64_t kPongTag = kLivenessBase + 1;
// Asynchronous gossip's messages (transport/mailbox): a generation (an engine on these ranks, or
// one of its restores) above a sequence number per pair of workers.
constexpr int64_t kMailboxBase = kLivenessBase + kLivenessSpan;
constexpr int64_t kMailboxGenerationBits = 6;
constexpr int64_t kMailboxSequenceBits = 23;
constexpr int64_t kMailboxSpan = int64_t{1} << (kMailboxGenerationBits + kMailboxSequenceBits);

static_assert(kMailboxBase + kMailboxSpan <= (int64_t{1} << 31), "tags must fit in an int");

// The tag of the `sequence`-th asynchronous message from one worker to another in `generation`
// of their gossip. Both wrap: a few messages to one peer are in flight at most, and generations
// tell apart only the engines of a few restores or epochs in a row.
constexpr int64_t mailbox_tag(int64_t generation, int64_t sequence) {
  constexpr int64_t generations = int64_t{1} << kMailboxGenerationBits;
  constexpr int64_t sequences = int64_t{1} << kMailboxSequenceBits;
  const int64_t wrapped_generation = ((generation % generations) + generations) % generations;
  const int64_t wrapped_sequence = ((sequence % sequences) + sequences) % sequences;
  return kMailboxBase + (wrapped_generation << kMailboxSequenceBits) + wrapped_sequence;
}

}  // namespace gossip::tags
