// Error types and checking macros shared by every layer.
//
// User errors (a bad argument) and peer failures (a timeout, a diverged model) are typed so that
// the bindings turn them into the Python exception a user expects: gossip::ValueError ->
// ValueError, gossip::TimeoutError -> gossip_ext.PeerTimeoutError (a TimeoutError),
// gossip::NonFiniteError -> gossip_ext.NonFiniteError (a FloatingPointError). A peer failure
// carries what it is about as data (PeerFailure), which the bindings set as the Python
// exception's attributes: no caller reads the peers out of the message. Code that already
// depends on torch may use TORCH_CHECK (RuntimeError), TORCH_CHECK_VALUE (ValueError) and
// TORCH_CHECK_TYPE (TypeError) instead; the topology layer does not depend on torch, so it uses
// the macros below.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gossip {

// A bad argument. Derives from std::invalid_argument, which pybind11 maps to ValueError.
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

// Each element once, in the order first seen.
inline std::vector<int> each_once(const std::vector<int>& values) {
  std::vector<int> once;
  for (int value : values) {
    if (std::find(once.begin(), once.end(), value) == once.end()) once.push_back(value);
  }
  return once;
}

}  // namespace detail

// What a peer failure is about, as data (the message says the same in words).
struct PeerFailure {
  // The ranks (of the gossip's process group) at fault, each once; empty where none is known
  // (a round given up from outside, this rank's own parameters diverged).
  std::vector<int> peers;
  // The gossip round; none where the failure is not a round's (a check-in).
  std::optional<int64_t> round;
  // The transport's name (Transport::name()); empty where unknown.
  std::string transport;
  // The timeout that passed; none where the failure did not wait one out (a closed connection).
  std::optional<std::chrono::milliseconds> timeout;
};

// A peer that did not answer within the timeout, died, or was given up on. The message names
// the peers and the round; failure() holds them.
class TimeoutError : public std::runtime_error {
 public:
  explicit TimeoutError(const std::string& message) : std::runtime_error(message) {}
  TimeoutError(const std::string& message, PeerFailure failure)
      : std::runtime_error(message), failure_(std::move(failure)) {
    failure_.peers = detail::each_once(failure_.peers);
  }
  const PeerFailure& failure() const { return failure_; }

 private:
  PeerFailure failure_;
};

// NaN or Inf arrived in a message or sat in this rank's parameters when a round was absorbed.
// The message names the sending ranks (or this rank) and the round; failure() holds the senders
// (none: this rank's own parameters) and the round.
class NonFiniteError : public std::runtime_error {
 public:
  explicit NonFiniteError(const std::string& message) : std::runtime_error(message) {}
  NonFiniteError(const std::string& message, PeerFailure failure)
      : std::runtime_error(message), failure_(std::move(failure)) {
    failure_.peers = detail::each_once(failure_.peers);
  }
  const PeerFailure& failure() const { return failure_; }

 private:
  PeerFailure failure_;
};

namespace detail {

template <typename T>
void append(std::ostringstream& os, const T& value) {
  os << value;
}

template <typename T>
void append(std::ostringstream& os, const std::vector<T>& values) {
  os << '[';
  for (size_t i = 0; i < values.size(); ++i) {
    os << (i ? ", " : "") << values[i];
  }
  os << ']';
}

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (append(os, args), ...);
  return os.str();
}

[[noreturn]] inline void internal_assert_fail(const char* expr, const char* file, int line) {
  throw std::logic_error(str_cat("gossip_ext internal assertion failed: ", expr, " at ", file, ":",
                                 line, ". This is a bug in gossip_ext; please report it."));
}

}  // namespace detail
}  // namespace gossip

// Validates a user argument; the message must name the argument and its value.
#define GOSSIP_CHECK_ARG(cond, ...)                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      throw ::gossip::ValueError(::gossip::detail::str_cat(__VA_ARGS__)); \
    }                                                                    \
  } while (0)

// Checks one of our own invariants (never a user error).
#define GOSSIP_INTERNAL_ASSERT(cond)                                     \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ::gossip::detail::internal_assert_fail(#cond, __FILE__, __LINE__); \
    }                                                                    \
  } while (0)
