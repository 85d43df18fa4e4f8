// GossipEngine: one rank's side of push-sum gossip over a Transport (docs/design.md section 1).
//
// The engine owns the flat parameter buffers (the model's parameters become views of them) and
// runs the round state machine:
//
//   idle --start_round()--> in flight --finish_round() / try_finish_round()--> idle, round + 1
//
// Note [The parameters are the model]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Outside the engine's own calls every parameter holds a valid model: the de-biased z of the last
// absorbed round, or z after the latest optimizer step. A user reads the parameters at any time
// between steps (model.module, its state_dict(), an evaluation, an error handler), and none of
// them may see a share in flight, a scaled buffer or a half-absorbed round. So:
//   - start_round() never scales the parameters, and changes nothing a caller can see (weight,
//     round, bytes sent) before the round is posted; a round that fails to post changes nothing
//     at all. The one exception is overlap/bounded asynchrony with compressed messages, whose
//     error feedback is folded in at the send (Note [Compressed messages]): there the parameters
//     hold the de-biased kept share, within one message rounding of z.
//   - The push-sum weight w (ps_weight()) is the weight of the model the parameters hold; the
//     share kept while a round is in flight is kept_ps_weight(), applied when the round is
//     absorbed.
//   - A round that fails (a peer timed out or died, a non-finite message) fails the engine for
//     good: every later call that would absorb or read the round rethrows the same error. Every
//     transport's Work::wait() returns only for a round that completed, so a failed round is
//     never absorbed: the CPU transports block until the messages are in, and the NCCL transport
//     blocks until the round's end event and then checks that the watchdog did not abort it
//     (an abort completes the event with partial buffers; Note [Gossip stream ordering]).
//     synchronize() checks the last absorbed round once more before the parameters are handed
//     out as final (sync_comms(), state_dict()).
//   - A non-finite round is the exception to "changes nothing": the flag is raised by the absorb
//     itself (Note [Non-finite messages]), so the values are in the parameters when it raises.
//
// Note [Push-sum state]
// ~~~~~~~~~~~~~~~~~~~~~
// The parameters always hold the de-biased value z = x / w, which is what forward, backward and
// the optimizer use; the numerator x = w * z is never stored. A round with mixing weights
// (self, peer) then is:
//   start:   send peer * w * z (and peer * w when the weight travels) to every out-peer;
//            the node keeps w_kept = self * w, applied when the round is absorbed.
//   finish:  w_new = w_kept + sum of received weights;
//            z <- (w_kept * z + sum of received numerators) / w_new   (one fused kernel pass)
// If the optimizer changes z while a round is in flight (overlap, bounded asynchrony), the kept
// share is w_kept * z_current: the local update lands in the numerator, as in SGP.
// Lazy mixing: with uniform mixing on a regular graph every w stays exactly 1, so the weight is
// neither sent nor stored and finish is z <- self * z + sum of received.
// Push-pull (push_sum = false, D-PSGD): the same arithmetic without a weight on a graph that
// pairs nodes symmetrically, which makes the mixing doubly stochastic.
//
// Note [Sending in place]
// ~~~~~~~~~~~~~~~~~~~~~~~
// With EngineOptions::synchronous under lazy uniform mixing, every node shares z equally among
// itself and its k out-peers, and every node receives from as many in-peers as it sends to. The
// engine then posts the flat buffer itself, unscaled, to every out-peer (no send buffer: one
// model copy less), and the absorb applies the share to the sum:
//   z <- (z + sum of received z_j) / (k + 1)                         (one fused kernel pass)
// The parameters stay z while the round is in flight (Note [The parameters are the model]); the
// transport reads them until the round completes, so they must not be written until
// finish_round(), which the synchronous training loop guarantees: the next forward finishes it.
//
// Note [Non-finite messages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A worker whose training diverged sends NaN or Inf, and push-sum would spread it to every worker
// within a few rounds, silently. With EngineOptions::check_finite the absorb kernel raises a
// device-side flag when any value it reads is non-finite (it reads every value anyway). Only when
// the flag is set does the engine scan the received buffers, to name the senders, and fail with
// gossip::NonFiniteError. On the CPU the flag is read right after absorbing. On a GPU, reading it
// there would stall the host on every round, so it is copied to pinned memory behind an event
// and read at the next start_round() or finish_round(), before the receive buffers are reused:
// the error arrives one step late, but the hot path never synchronises.
//
// Note [Compressed messages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With EngineOptions::message_dtype (float16 or bfloat16), float32/float64 groups send their
// numerators in 16 bits; the state, the absorb and the push-sum weight stay in full precision.
// Rounding a message loses mass unless someone keeps it, so the sender does (error feedback into
// its own state): it sends q = round(peer * w * z) to each of its k out-peers and keeps
// w * z - k * q as its numerator, so that the sum of all numerators is conserved to the state's
// rounding and the error rides along in later rounds' messages. Where the fold happens:
//   - synchronous: at the absorb, which reads its own message as well (absorb_'s `sent`):
//       z <- (w * z - k * q + sum of received) / w_new
//     The parameters are untouched until then (Note [The parameters are the model]).
//   - overlap and bounded asynchrony: at the send, in the same pass that writes q
//     (compress_into_): z <- z + (k / self) * (peer * w * z - q) / w, the kept share's de-biased
//     value. The optimizer updates z while the round is in flight, and the fold must use the z
//     the message was made of, which is gone by the absorb.
// Compressed groups are never sent in place (the message has another dtype), and the weight
// travels in full precision. Block-quantized messages (int8, int4, float8 e4m3fn with a scale per
// block; EngineOptions::message_format) are compressed messages like the 16-bit ones: the same
// folds, through quantize_into_ and absorb_quantized_; a NaN or Inf travels as a NaN block scale.
//
// Messages: one per out-peer and dtype group, laid out as [numerators | padding | weight], the
// weight (when it travels) in the engine's weight dtype at an 8-byte-aligned tail.
//
// Thread-safety: an engine is used by one thread at a time.
//
// Usage:
//   gossip::GossipEngine engine(params, names, transport, options);
//   for (...) {
//     engine.finish_round();   // before the forward reads the parameters
//     ... forward, backward, optimizer step ...
//     engine.start_round();    // after the step
//   }
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include "engine/flat_parameters.h"
#include "kernels/block_format.h"
#include "topology/graph.h"
#include "topology/mixing.h"
#include "transport/transport.h"

namespace gossip {

struct EngineOptions {
  GraphOptions graph;
  MixingOptions mixing;
  // true: push-sum (SGP). false: push-pull averaging (D-PSGD); needs a symmetric pairing graph.
  bool push_sum = true;
  // Skip the weight when it provably stays 1 (uniform mixing on a regular graph). This holds under
  // overlap and bounded asynchrony too: one round at most is in flight, and the kept share
  // w * z_current (Note [Push-sum state]) needs no weight other than the known mixing share.
  // false forces the weight onto the wire, e.g. to test the non-lazy path with uniform mixing.
  bool allow_lazy_mixing = true;
  // Synchronous modes: nothing touches the parameters between start_round() and finish_round().
  // The engine then sends them in place under lazy uniform mixing (Note [Sending in place]) and
  // folds the error feedback of compressed messages in at the absorb (Note [Compressed messages]).
  bool synchronous = false;
  // How long finish_round() waits for a peer before raising gossip::TimeoutError.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // Fail with gossip::NonFiniteError, naming the senders, when an absorbed round holds NaN or Inf
  // (Note [Non-finite messages]).
  bool check_finite = true;
  // float16 or bfloat16: send float32/float64 groups in 16 bits (Note [Compressed messages]).
  // Groups already in 16 bits, and every group when unset, travel in their own dtype.
  std::optional<at::ScalarType> message_dtype;
  // int8, int4 or float8 e4m3fn blocks: send float32/float64 groups block-quantized (Note
  // [Quantized messages] in kernels/block_format.h) with the same error feedback. Exclusive with
  // message_dtype.
  std::optional<BlockFormat> message_format;
};

class GossipEngine {
 public:
  // Flattens `params` (see flatten_parameters) and validates the options against the transport's
  // world size; throws ValueError/TypeError naming the bad argument.
  GossipEngine(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
               std::shared_ptr<Transport> transport, EngineOptions options);

  // Posts the messages of the current round and returns its Work. Throws if a round is already in
  // flight or a parameter no longer views its flat buffer.
  std::shared_ptr<Work> start_round();
  // Waits for the round in flight (at most the timeout) and absorbs it; a no-op when idle.
  // A round that fails (to post or to complete) leaves the engine failed: every later call raises
  // the same error (Note [The parameters are the model]).
  void finish_round();
  // Absorbs the round in flight if all its messages have arrived. Never blocks. Returns true when
  // no round is in flight afterwards.
  bool try_finish_round();
  // finish_round(), then blocks the host until the last absorbed round has really completed and
  // raises if it failed: on a GPU, wait() only orders streams (Note [The parameters are the
  // model]). Call it before handing the parameters to anything that reads them as final.
  void synchronize();
  // Rethrows the error of a failed round, if any; otherwise does nothing.
  void raise_if_failed() const;
  // Fails the round in flight, if any, with a TimeoutError saying `why` (Transport::abandon): a
  // thread that learned a peer is gone releases the one waiting for it. Callable from any thread;
  // the waiting thread then raises as for any failed round.
  void abandon(const std::string& why) { transport_->abandon(why); }

  bool in_flight() const { return work_ != nullptr; }
  // Rounds completed so far; the round in flight, if any, has this number.
  int64_t round() const { return round_; }
  bool lazy_mixing() const { return lazy_; }
  // Bytes this rank has posted to its peers so far, every message counted once per peer.
  int64_t bytes_sent() const { return bytes_sent_; }
  // Bytes of the message a round sends to one out-peer, every dtype group's together: what
  // bytes_sent() grows by per out-peer and round (padding and any weight slot included).
  int64_t message_bytes() const;
  const Graph& graph() const { return graph_; }
  int rank() const { return transport_->rank(); }
  int world_size() const { return transport_->world_size(); }
  const std::vector<FlatParameterGroup>& groups() const { return groups_; }

  // The push-sum weight w of the model the parameters hold (always 1 under lazy mixing), a
  // one-element tensor; and the numerators x = w * z, one tensor per dtype group.
  at::Tensor ps_weight() const;
  std::vector<at::Tensor> ps_numerators() const;
  // The weight this node keeps of the round in flight (w_kept = self * w), which the absorb
  // applies; ps_weight() when idle.
  at::Tensor kept_ps_weight() const;

  // Restores the state a checkpoint saved (round() and ps_weight()); the engine must be idle and
  // the parameters already hold the checkpoint's de-biased values.
  void restore(int64_t round, double ps_weight);

  // Changes the out-peers per round from the next round on (SGP's peers schedule); the engine
  // must be idle. Every rank must make the same change before the same round: the schedule stays
  // a pure function of (graph, round), so no rank needs to ask another. Throws ValueError if the
  // graph does not admit `peers_per_itr` at this world size, or if the change would alter what
  // the engine was built for (lazy mixing, the symmetric pairing push-pull needs).
  void set_peers_per_itr(int peers_per_itr);

 private:
  void absorb();
  // Runs `body`; an exception leaves the engine failed for good with it.
  void fail_on_error(const std::function<void()>& body);
  // Note [Non-finite messages]: reads the flag of the last absorb (waiting for a GPU's copy if
  // one is pending) and fails with NonFiniteError if it is set.
  void check_last_absorb_finite();
  [[noreturn]] void raise_nonfinite(int64_t round, const std::vector<int>& in_peers) const;
  at::Tensor weight_slot(const at::Tensor& message) const;
  // The numerators of group g's message (all of it but the padding and the weight).
  at::Tensor message_body(size_t g, const at::Tensor& message) const;
  bool quantized(size_t g) const { return compressed_[g] && options_.message_format.has_value(); }

  std::vector<FlatParameterGroup> groups_;
  std::shared_ptr<Transport> transport_;
  EngineOptions options_;
  Graph graph_;
  bool lazy_ = true;
  bool in_place_ = false;
  bool fold_at_absorb_ = false;                  // compressed groups: Note [Compressed messages]
  int64_t round_ = 0;
  int64_t bytes_sent_ = 0;

  at::ScalarType weight_dtype_ = at::kFloat;
  at::Tensor weight_;                            // [1] w; unused under lazy mixing
  at::Tensor kept_weight_;                       // [1] w_kept of the round in flight
  at::Tensor in_place_divisor_;                  // [1] k + 1 of Note [Sending in place]
  std::vector<at::Tensor> send_;                 // one message buffer per group
  std::vector<bool> compressed_;                 // per group: messages in message_dtype
  std::vector<std::vector<at::Tensor>> recv_;    // [group][in-peer] message buffers
  std::vector<int> in_peers_;                    // of the round in flight
  double self_scale_ = 1.0;                      // lazy mixing: applied to z when absorbing
  double kept_share_ = 1.0;                      // self: the mixing share kept this round
  double sent_scale_ = 0.0;                      // -k: the own message's share at the absorb
  std::shared_ptr<Work> work_;                   // of the round in flight
  std::shared_ptr<Work> last_absorbed_;          // until synchronize() has seen it complete
  std::exception_ptr failure_;                   // set once a round fails; sticky

  // Note [Non-finite messages]. The flag lives on the parameters' device; on a GPU its pinned
  // host copy is valid once `nonfinite_copied_` has completed.
  at::Tensor nonfinite_;
  at::Tensor nonfinite_host_;
  std::optional<c10::Event> nonfinite_copied_;
  bool nonfinite_check_pending_ = false;
  int64_t checked_round_ = 0;                    // the absorbed round the pending flag covers
  std::vector<int> checked_in_peers_;            // and its senders
};

}  // namespace gossip
