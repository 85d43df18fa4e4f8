// SealedTransport: every message of another transport sealed on the wire with AES-256-GCM
// (OpenSSL's libcrypto; built where its headers are found: tools/sources.py), so that a message
// altered, forged or replayed on the way is refused before a byte of it is absorbed.
//
// Note [Sealed messages]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Each direction of each link has a key of its own (the membership derives them per epoch from
// the job's secret: sender, receiver and epoch are in the derivation, so a message of one link or
// epoch opens on no other). The sender numbers its messages on a link with a counter that only
// rises and never restarts under a key: the counter is the GCM nonce, so no nonce is used twice.
// Every message travels as two: its body (as it lies, or encrypted) and a trailer of
// kTrailerBytes, the counter and the 16-byte tag. The receiver verifies the tag (and decrypts)
// inside the Work's wait(), before the caller may read the buffer, and takes only counters above
// the last it accepted from that sender (a replay is refused). A message that fails is the link's
// failure: a TimeoutError naming the peer and the round, kept by the Work and raised again at
// every wait.
//   sealed (the default): the body travels as it lies and the tag authenticates it (GCM with the
//     body as additional data: GMAC); nothing is copied on either side.
//   encrypted: the body travels encrypted; each side goes through a byte buffer of the message's
//     size (the sender's parameters are never written: Note [Sending in place]).
// What is not sealed: anything that does not go through this transport (gloo's collectives, an
// NCCL communicator): docs/elastic.md, Security.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace gossip {

struct LinkKeys {
  std::vector<uint8_t> send;     // this rank -> the peer, kKeyBytes
  std::vector<uint8_t> receive;  // the peer -> this rank, kKeyBytes
};

// Created by std::make_shared only: its works hold it (shared_from_this).
class SealedTransport final : public Transport,
                              public std::enable_shared_from_this<SealedTransport> {
 public:
  static constexpr size_t kKeyBytes = 32;
  static constexpr size_t kTagBytes = 16;
  static constexpr int64_t kTrailerBytes = 8 + kTagBytes;  // the counter, then the tag

  // `keys`: one entry per peer this rank may exchange with. `encrypt`: the body too.
  SealedTransport(std::shared_ptr<Transport> inner, std::map<int, LinkKeys> keys, bool encrypt);

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override;
  void connect_peers(const std::vector<int>& peers) override { inner_->connect_peers(peers); }
  void abandon(const std::string& why) override { inner_->abandon(why); }
  std::string name() const override;
  std::shared_ptr<Work> post_send(int peer, at::Tensor buffer, int64_t tag) override;
  std::shared_ptr<Work> post_recv(int peer, at::Tensor buffer, int64_t tag) override;

  // What a receive needs to open its message once it has arrived; shared by the works.
  struct Opening {
    int peer;
    at::Tensor body;     // as received (the ciphertext where encrypted)
    at::Tensor trailer;  // counter and tag
    at::Tensor buffer;   // where the caller reads the message (== body unless encrypted)
  };
  // Verifies (and decrypts) `opening`, or throws the TimeoutError of a refused message.
  void open(const Opening& opening, std::optional<int64_t> round);

 private:
  // The body and trailer of one message to `peer`: seals `buffer` under the next counter.
  std::pair<at::Tensor, at::Tensor> seal(int peer, const at::Tensor& buffer);
  // The receive's two buffers: the caller's own unless encrypted.
  Opening prepare(int peer, const at::Tensor& buffer) const;
  const LinkKeys& keys_of(int peer) const;

  const std::shared_ptr<Transport> inner_;
  const std::map<int, LinkKeys> keys_;
  const bool encrypt_;
  std::mutex mutex_;  // the counters: the training thread and the channels' threads share them
  std::map<int, uint64_t> sent_;      // per peer: the last counter sent
  std::map<int, uint64_t> accepted_;  // per peer: the last counter accepted
};

}  // namespace gossip
