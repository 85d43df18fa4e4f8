// Error types and checking macros shared by every layer.
//
// User errors (a bad argument) and peer failures (a timeout, a diverged model) are typed so that
// the bindings turn them into the Python exception a user expects: gossip::ValueError ->
// ValueError, gossip::TimeoutError -> TimeoutError, gossip::NonFiniteError -> FloatingPointError. Code that already depends on torch may use TORCH_CHECK
// (RuntimeError), TORCH_CHECK_VALUE (ValueError) and TORCH_CHECK_TYPE (TypeError) instead; the
// topology layer does not depend on torch, so it uses the macros below.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace gossip {

// A bad argument. Derives from std::invalid_argument, which pybind11 maps to ValueError.
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A peer that did not answer within the timeout. The message names the peers and the round.
class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// NaN or Inf arrived in a message or sat in this rank's parameters when a round was absorbed.
// The message names the sending ranks (or this rank) and the round.
class NonFiniteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
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
