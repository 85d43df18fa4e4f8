// The sealed transport (transport/sealed, Note [Sealed messages]) over the in-process transport,
// two ranks as threads: a round's messages arrive as sent, sealed or encrypted; a byte changed on
// the way, a message sealed with another key, and a message replayed are each refused before the
// receiver reads it, naming the peer; asynchronous messages are sealed alike. The reference for
// "as sent" is the buffer the sender posted.
#include <chrono>
#include <functional>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/sealed/sealed_transport.h"

namespace gossip {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kWait{5000};

std::vector<uint8_t> key(uint8_t seed) { return std::vector<uint8_t>(32, seed); }

// Rank r's keys for its one peer: its own sends under 10 + r, the peer's under 10 + peer.
std::map<int, LinkKeys> keys_of(int rank, uint8_t forge = 0) {
  const int peer = 1 - rank;
  const auto own = static_cast<uint8_t>(10 + rank + forge);
  return {{peer, {key(own), key(static_cast<uint8_t>(10 + peer))}}};
}

// A transport between the two ranks that lets a test change the bytes on the wire: an inner
// transport whose sends go through `tamper` first (rank 0's only).
class TamperingTransport final : public Transport {
 public:
  TamperingTransport(std::shared_ptr<Transport> inner, std::function<void(at::Tensor&)> tamper)
      : inner_(std::move(inner)), tamper_(std::move(tamper)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::shared_ptr<Work> exchange(std::vector<PeerMessage> sends, std::vector<PeerMessage> recvs,
                                 int64_t round) override {
    for (PeerMessage& m : sends) {
      m.buffer = m.buffer.clone();
      tamper_(m.buffer);
    }
    return inner_->exchange(std::move(sends), std::move(recvs), round);
  }
  std::shared_ptr<Work> post_send(int peer, at::Tensor buffer, int64_t tag) override {
    return inner_->post_send(peer, buffer, tag);
  }
  std::shared_ptr<Work> post_recv(int peer, at::Tensor buffer, int64_t tag) override {
    return inner_->post_recv(peer, buffer, tag);
  }
  std::string name() const override { return "tampering"; }

 private:
  std::shared_ptr<Transport> inner_;
  std::function<void(at::Tensor&)> tamper_;
};

struct Pair {
  explicit Pair(bool encrypt, std::function<void(at::Tensor&)> tamper = nullptr,
                uint8_t forge = 0) {
    auto hub = std::make_shared<InProcHub>(2);
    std::shared_ptr<Transport> wire0 = std::make_shared<InProcTransport>(hub, 0);
    if (tamper) wire0 = std::make_shared<TamperingTransport>(wire0, tamper);
    t0 = std::make_shared<SealedTransport>(wire0, keys_of(0, forge), encrypt);
    t1 = std::make_shared<SealedTransport>(std::make_shared<InProcTransport>(hub, 1), keys_of(1),
                                           encrypt);
  }
  std::shared_ptr<SealedTransport> t0, t1;
};

// One round: rank 0 sends `sent` to rank 1; returns what rank 1 received (or throws its error).
at::Tensor one_round(Pair& pair, const at::Tensor& sent, int64_t round) {
  at::Tensor received = at::zeros_like(sent);
  auto sending = pair.t0->exchange({{1, sent}}, {}, round);
  auto receiving = pair.t1->exchange({}, {{0, received}}, round);
  sending->wait(kWait);
  receiving->wait(kWait);
  return received;
}

TEST(SealedTransport, ARoundArrivesAsSentSealedOrEncrypted) {
  for (bool encrypt : {false, true}) {
    Pair pair(encrypt);
    const at::Tensor sent = at::arange(1000, at::kFloat);
    const at::Tensor kept = sent.clone();
    for (int64_t round = 0; round < 3; ++round) {
      EXPECT_TRUE(at::equal(one_round(pair, sent, round), kept)) << "encrypt " << encrypt;
    }
    EXPECT_TRUE(at::equal(sent, kept)) << "the sender's buffer was written";
    EXPECT_EQ(pair.t0->name(), std::string(encrypt ? "encrypted(" : "sealed(") + "inproc)");
  }
}

void expect_refused(Pair& pair, const std::string& words) {
  const at::Tensor sent = at::arange(256, at::kFloat);
  try {
    one_round(pair, sent, 4);
    FAIL() << "a message that should be refused was taken";
  } catch (const TimeoutError& e) {
    EXPECT_EQ(e.failure().peers, std::vector<int>{0});
    EXPECT_EQ(e.failure().round, 4);
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not absorbed"), std::string::npos) << e.what();
  }
}

TEST(SealedTransport, AByteChangedOnTheWayIsRefusedNamingThePeer) {
  for (bool encrypt : {false, true}) {
    // The body is the first message of each pair, the trailer the second: change the body.
    int message = 0;
    Pair pair(encrypt, [&](at::Tensor& buffer) {
      if (message++ % 2 == 0) static_cast<uint8_t*>(buffer.data_ptr())[17] ^= 0x01;
    });
    expect_refused(pair, "tag does not match");
  }
}

TEST(SealedTransport, AMessageSealedWithAnotherKeyIsRefused) {
  Pair pair(false, nullptr, /*forge=*/7);
  expect_refused(pair, "tag does not match");
}

TEST(SealedTransport, AReplayedMessageIsRefused) {
  // The wire repeats rank 0's first message (body and trailer) in place of its second.
  std::vector<at::Tensor> first;
  int message = 0;
  Pair pair(false, [&](at::Tensor& buffer) {
    if (message < 2) first.push_back(buffer.clone());
    if (message >= 2) buffer.copy_(first[message % 2]);
    ++message;
  });
  const at::Tensor sent = at::arange(256, at::kFloat);
  EXPECT_TRUE(at::equal(one_round(pair, sent, 0), sent));
  try {
    one_round(pair, sent, 1);
    FAIL() << "a replayed message was taken";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("replayed"), std::string::npos) << e.what();
  }
}

TEST(SealedTransport, AsynchronousMessagesAreSealedAlike) {
  for (bool encrypt : {false, true}) {
    Pair pair(encrypt);
    const at::Tensor sent = at::arange(64, at::kDouble);
    at::Tensor received = at::zeros_like(sent);
    auto receiving = pair.t1->post_recv(0, received, 77);
    auto sending = pair.t0->post_send(1, sent, 77);
    sending->wait(kWait);
    receiving->wait(kWait);
    EXPECT_TRUE(at::equal(received, sent)) << "encrypt " << encrypt;
  }
}

TEST(SealedTransport, KeysOfTheWrongSizeOrForAStrangerAreRefused) {
  auto hub = std::make_shared<InProcHub>(2);
  auto wire = std::make_shared<InProcTransport>(hub, 0);
  EXPECT_THROW(SealedTransport(wire, {{1, {key(1), std::vector<uint8_t>(5)}}}, false),
               ValueError);
  EXPECT_THROW(SealedTransport(wire, {{0, {key(1), key(2)}}}, false), ValueError);
  EXPECT_THROW(SealedTransport(nullptr, {}, false), ValueError);
}

}  // namespace
}  // namespace gossip
