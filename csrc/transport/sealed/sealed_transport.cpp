#include "transport/sealed/sealed_transport.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <utility>

#include <ATen/ATen.h>

#include "common/error.h"

namespace gossip {
namespace {

constexpr size_t kNonceBytes = 12;
// EVP takes int lengths: a body is fed in pieces of at most this many bytes.
constexpr int64_t kPiece = int64_t{1} << 30;

struct ContextFree {
  void operator()(EVP_CIPHER_CTX* context) const { EVP_CIPHER_CTX_free(context); }
};
using Context = std::unique_ptr<EVP_CIPHER_CTX, ContextFree>;

// Every libcrypto call goes through this: one that fails (out of memory) throws, naming it.
void check(int ok, const char* what) {
  TORCH_CHECK(ok == 1, "gossip_ext: libcrypto's AES-256-GCM ", what, " failed");
}

std::array<uint8_t, kNonceBytes> nonce_of(uint64_t counter) {
  std::array<uint8_t, kNonceBytes> nonce{};
  std::memcpy(nonce.data(), &counter, sizeof(counter));
  return nonce;
}

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

at::Tensor byte_buffer(int64_t nbytes) { return at::empty({nbytes}, at::kByte); }

// GCM over `in` (nbytes) under `key` and `counter`: encrypted into `out` (nullptr: `in` is only
// authenticated, as additional data), its tag into `tag`.
void gcm_seal(const std::vector<uint8_t>& key, uint64_t counter, const uint8_t* in,
              int64_t nbytes, uint8_t* out, uint8_t* tag) {
  Context context(EVP_CIPHER_CTX_new());
  GOSSIP_INTERNAL_ASSERT(context != nullptr);
  const auto nonce = nonce_of(counter);
  check(EVP_EncryptInit_ex(context.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr), "init");
  check(EVP_CIPHER_CTX_ctrl(context.get(), EVP_CTRL_GCM_SET_IVLEN, kNonceBytes, nullptr), "iv");
  check(EVP_EncryptInit_ex(context.get(), nullptr, nullptr, key.data(), nonce.data()), "key");
  for (int64_t at = 0; at < nbytes; at += kPiece) {
    const int piece = static_cast<int>(std::min(kPiece, nbytes - at));
    int written = 0;
    check(EVP_EncryptUpdate(context.get(), out ? out + at : nullptr, &written, in + at, piece),
          "update");
  }
  int written = 0;
  uint8_t none[16];
  check(EVP_EncryptFinal_ex(context.get(), none, &written), "final");
  check(EVP_CIPHER_CTX_ctrl(context.get(), EVP_CTRL_GCM_GET_TAG, SealedTransport::kTagBytes, tag),
        "tag");
}

// The twin of gcm_seal: false where the tag does not match (`out` then holds nothing to use).
bool gcm_open(const std::vector<uint8_t>& key, uint64_t counter, const uint8_t* in,
              int64_t nbytes, uint8_t* out, const uint8_t* tag) {
  Context context(EVP_CIPHER_CTX_new());
  GOSSIP_INTERNAL_ASSERT(context != nullptr);
  const auto nonce = nonce_of(counter);
  check(EVP_DecryptInit_ex(context.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr), "init");
  check(EVP_CIPHER_CTX_ctrl(context.get(), EVP_CTRL_GCM_SET_IVLEN, kNonceBytes, nullptr), "iv");
  check(EVP_DecryptInit_ex(context.get(), nullptr, nullptr, key.data(), nonce.data()), "key");
  for (int64_t at = 0; at < nbytes; at += kPiece) {
    const int piece = static_cast<int>(std::min(kPiece, nbytes - at));
    int written = 0;
    check(EVP_DecryptUpdate(context.get(), out ? out + at : nullptr, &written, in + at, piece),
          "update");
  }
  std::array<uint8_t, SealedTransport::kTagBytes> expected;
  std::memcpy(expected.data(), tag, expected.size());
  check(EVP_CIPHER_CTX_ctrl(context.get(), EVP_CTRL_GCM_SET_TAG, expected.size(), expected.data()),
        "tag");
  int written = 0;
  uint8_t none[16];
  return EVP_DecryptFinal_ex(context.get(), none, &written) == 1;
}

// A round's work with its receives opened once the inner round completed.
class SealedRoundWork final : public Work {
 public:
  SealedRoundWork(std::shared_ptr<SealedTransport> transport, std::shared_ptr<Work> inner,
                  std::vector<SealedTransport::Opening> openings, int64_t round)
      : transport_(transport),
        inner_(std::move(inner)),
        openings_(std::move(openings)),
        round_(round) {}

  bool is_completed() override { return inner_->is_completed(); }

  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    open_once();
  }

  void synchronize(std::chrono::milliseconds timeout) override {
    inner_->synchronize(timeout);
    open_once();
  }

  void cancel() override { inner_->cancel(); }

 private:
  void open_once() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!opened_) {
      opened_ = true;
      try {
        for (const auto& opening : openings_) transport_->open(opening, round_);
      } catch (const TimeoutError&) {
        failure_ = std::current_exception();
      }
    }
    if (failure_) std::rethrow_exception(failure_);
  }

  const std::shared_ptr<SealedTransport> transport_;
  const std::shared_ptr<Work> inner_;
  const std::vector<SealedTransport::Opening> openings_;
  const int64_t round_;
  std::mutex mutex_;
  bool opened_ = false;
  std::exception_ptr failure_;
};

// One asynchronous message: its body's work and its trailer's, opened once both moved.
class SealedMessageWork final : public Work {
 public:
  SealedMessageWork(std::shared_ptr<SealedTransport> transport, std::shared_ptr<Work> body,
                    std::shared_ptr<Work> trailer,
                    std::optional<SealedTransport::Opening> opening)
      : transport_(std::move(transport)),
        body_(std::move(body)),
        trailer_(std::move(trailer)),
        opening_(std::move(opening)) {}

  bool is_completed() override { return body_->is_completed() && trailer_->is_completed(); }

  void wait(std::chrono::milliseconds timeout) override {
    body_->wait(timeout);
    trailer_->wait(timeout);
    if (!opening_) return;  // a send
    std::lock_guard<std::mutex> lock(mutex_);
    if (!opened_) {
      opened_ = true;
      try {
        transport_->open(*opening_, std::nullopt);
      } catch (const TimeoutError&) {
        failure_ = std::current_exception();
      }
    }
    if (failure_) std::rethrow_exception(failure_);
  }

  void cancel() override {
    body_->cancel();
    trailer_->cancel();
  }

 private:
  const std::shared_ptr<SealedTransport> transport_;
  const std::shared_ptr<Work> body_, trailer_;
  const std::optional<SealedTransport::Opening> opening_;
  std::mutex mutex_;
  bool opened_ = false;
  std::exception_ptr failure_;
};

}  // namespace

SealedTransport::SealedTransport(std::shared_ptr<Transport> inner, std::map<int, LinkKeys> keys,
                                 bool encrypt)
    : inner_(std::move(inner)), keys_(std::move(keys)), encrypt_(encrypt) {
  GOSSIP_CHECK_ARG(inner_ != nullptr, "SealedTransport: inner must be a transport, got None");
  for (const auto& [peer, link] : keys_) {
    GOSSIP_CHECK_ARG(peer >= 0 && peer < inner_->world_size() && peer != inner_->rank(),
                     "SealedTransport: keys names peer ", peer, ", not another rank of [0, ",
                     inner_->world_size(), ")");
    GOSSIP_CHECK_ARG(link.send.size() == kKeyBytes && link.receive.size() == kKeyBytes,
                     "SealedTransport: the keys of peer ", peer, " must be ", kKeyBytes,
                     " bytes each, got ", link.send.size(), " and ", link.receive.size());
  }
}

std::string SealedTransport::name() const {
  return std::string(encrypt_ ? "encrypted(" : "sealed(") + inner_->name() + ")";
}

const LinkKeys& SealedTransport::keys_of(int peer) const {
  const auto found = keys_.find(peer);
  TORCH_CHECK(found != keys_.end(), "gossip_ext: the sealed transport has no key for peer ",
              peer);
  return found->second;
}

std::pair<at::Tensor, at::Tensor> SealedTransport::seal(int peer, const at::Tensor& buffer) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(),
              "gossip_ext: the sealed transport seals contiguous CPU buffers");
  const LinkKeys& link = keys_of(peer);
  uint64_t counter = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    counter = ++sent_[peer];
  }
  const auto nbytes = static_cast<int64_t>(buffer.nbytes());
  at::Tensor trailer = byte_buffer(kTrailerBytes);
  std::memcpy(bytes_of(trailer), &counter, sizeof(counter));
  at::Tensor body = buffer;
  if (encrypt_) body = byte_buffer(nbytes);
  gcm_seal(link.send, counter, bytes_of(buffer), nbytes, encrypt_ ? bytes_of(body) : nullptr,
           bytes_of(trailer) + sizeof(counter));
  return {body, trailer};
}

SealedTransport::Opening SealedTransport::prepare(int peer, const at::Tensor& buffer) const {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(),
              "gossip_ext: the sealed transport receives into contiguous CPU buffers");
  keys_of(peer);  // a receive from a peer without a key is refused as it is posted
  at::Tensor body = encrypt_ ? byte_buffer(static_cast<int64_t>(buffer.nbytes())) : buffer;
  return {peer, body, byte_buffer(kTrailerBytes), buffer};
}

void SealedTransport::open(const Opening& opening, std::optional<int64_t> round) {
  uint64_t counter = 0;
  std::memcpy(&counter, bytes_of(opening.trailer), sizeof(counter));
  const auto nbytes = static_cast<int64_t>(opening.buffer.nbytes());
  const bool genuine = gcm_open(keys_of(opening.peer).receive, counter, bytes_of(opening.body),
                                nbytes, encrypt_ ? bytes_of(opening.buffer) : nullptr,
                                bytes_of(opening.trailer) + sizeof(counter));
  std::string why;
  if (!genuine) {
    why = "its tag does not match (altered or forged on the way, or sealed with another key)";
  } else {
    std::lock_guard<std::mutex> lock(mutex_);
    uint64_t& last = accepted_[opening.peer];
    if (counter <= last) {
      why = detail::str_cat("its counter ", counter, " is not above the last accepted, ", last,
                            " (a replayed message)");
    } else {
      last = counter;
    }
  }
  if (why.empty()) return;
  if (encrypt_) opening.buffer.zero_();  // nothing of a refused message is left to read
  throw TimeoutError(
      detail::str_cat("gossip_ext: rank ", rank(), " refused a message from peer ", opening.peer,
                      round ? detail::str_cat(" in gossip round ", *round) : std::string(),
                      ": ", why, "; it was not absorbed"),
      {{opening.peer}, round, name(), std::nullopt});
}

std::shared_ptr<Work> SealedTransport::exchange(std::vector<PeerMessage> sends,
                                                std::vector<PeerMessage> recvs, int64_t round) {
  std::vector<PeerMessage> inner_sends, inner_recvs;
  for (const PeerMessage& m : sends) {
    auto [body, trailer] = seal(m.peer, m.buffer);
    inner_sends.push_back({m.peer, body});
    inner_sends.push_back({m.peer, trailer});
  }
  std::vector<Opening> openings;
  for (const PeerMessage& m : recvs) {
    Opening opening = prepare(m.peer, m.buffer);
    inner_recvs.push_back({m.peer, opening.body});
    inner_recvs.push_back({m.peer, opening.trailer});
    openings.push_back(std::move(opening));
  }
  auto inner = inner_->exchange(std::move(inner_sends), std::move(inner_recvs), round);
  return std::make_shared<SealedRoundWork>(shared_from_this(), std::move(inner),
                                           std::move(openings), round);
}

std::shared_ptr<Work> SealedTransport::post_send(int peer, at::Tensor buffer, int64_t tag) {
  auto [body, trailer] = seal(peer, buffer);
  // Both under the message's tag: messages of one tag between two ranks arrive in order.
  auto body_work = inner_->post_send(peer, body, tag);
  auto trailer_work = inner_->post_send(peer, trailer, tag);
  return std::make_shared<SealedMessageWork>(nullptr, std::move(body_work),
                                             std::move(trailer_work), std::nullopt);
}

std::shared_ptr<Work> SealedTransport::post_recv(int peer, at::Tensor buffer, int64_t tag) {
  Opening opening = prepare(peer, buffer);
  auto body_work = inner_->post_recv(peer, opening.body, tag);
  auto trailer_work = inner_->post_recv(peer, opening.trailer, tag);
  // The work holds the transport: a mailbox's thread may open its message after the engine
  // let the transport go.
  return std::make_shared<SealedMessageWork>(shared_from_this(), std::move(body_work),
                                             std::move(trailer_work), std::move(opening));
}

}  // namespace gossip
