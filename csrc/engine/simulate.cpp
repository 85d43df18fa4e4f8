#include "engine/simulate.h"

#include <atomic>
#include <exception>
#include <system_error>
#include <thread>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include "transport/inproc/inproc_transport.h"

namespace gossip {

at::Tensor simulate(const at::Tensor& values, int64_t rounds, const EngineOptions& options) {
  TORCH_CHECK_VALUE(values.dim() == 2 && values.size(0) >= 1 && values.size(1) >= 1,
                    "gossip_ext.simulate: values must be a 2-D tensor [n, d] with n, d >= 1, got "
                    "shape ",
                    values.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(values.scalar_type()),
                   "gossip_ext.simulate: values must be floating point, got ",
                   values.scalar_type());
  TORCH_CHECK_VALUE(values.device().is_cpu(), "gossip_ext.simulate: values must be on the CPU, got ",
                    values.device());
  TORCH_CHECK_VALUE(rounds >= 0, "gossip_ext.simulate: rounds must be >= 0, got ", rounds);
  TORCH_CHECK_VALUE(rounds <= kMaxSimulatedRounds, "gossip_ext.simulate: rounds must be <= ",
                    kMaxSimulatedRounds, ", got ", rounds);
  TORCH_CHECK_VALUE(values.size(0) <= kMaxSimulatedRanks, "gossip_ext.simulate: values has ",
                    values.size(0), " rows, one rank each, but simulate runs at most ",
                    kMaxSimulatedRanks, " ranks (a thread each)");
  int64_t elements = 0;  // of the result
  TORCH_CHECK_VALUE(!c10::mul_overflows(rounds + 1, values.numel(), &elements),
                    "gossip_ext.simulate: the result of ", rounds, " rounds over values of shape ",
                    values.sizes(), " would have more than 2^63 elements");

  const int n = static_cast<int>(values.size(0));
  const at::Tensor initial = values.detach();
  at::Tensor result = at::empty({rounds + 1, values.size(0), values.size(1)}, initial.options());
  result[0].copy_(initial);

  // Engines are built here, on the calling thread, so bad options raise before any thread starts.
  auto hub = std::make_shared<InProcHub>(n);
  std::vector<std::unique_ptr<GossipEngine>> engines;
  std::vector<at::Tensor> params;
  for (int i = 0; i < n; ++i) {
    params.push_back(initial[i].clone());
    engines.push_back(std::make_unique<GossipEngine>(
        std::vector<at::Tensor>{params[i]}, std::vector<std::string>{"values[" + std::to_string(i) + "]"},
        std::make_shared<InProcTransport>(hub, i), options));
  }

  std::vector<std::exception_ptr> errors(n);
  // The rank that failed first: the others fail because it aborted the hub, so its error (and its
  // type: TimeoutError, FloatingPointError, ...) is the one that says why.
  std::atomic<int> first_failure{-1};
  std::vector<std::thread> threads;
  threads.reserve(n);
  auto run_rank = [&](int i) {
    try {
      c10::NoGradGuard no_grad;
      for (int64_t t = 0; t < rounds; ++t) {
        engines[i]->start_round();
        engines[i]->finish_round();
        result[t + 1][i].copy_(params[i]);
      }
    } catch (const std::exception& e) {
      errors[i] = std::current_exception();
      int none = -1;
      first_failure.compare_exchange_strong(none, i);
      hub->abort("gossip_ext.simulate: stopped because rank " + std::to_string(i) +
                 " failed: " + e.what());
    }
  };
  for (int i = 0; i < n; ++i) {
    try {
      threads.emplace_back(run_rank, i);
    } catch (const std::system_error& e) {
      // The process may start no more threads. Destroying a joinable thread calls
      // std::terminate, so the started ones are stopped and joined before this raises.
      hub->abort("gossip_ext.simulate: stopped because the thread of rank " + std::to_string(i) +
                 " did not start");
      for (std::thread& thread : threads) thread.join();
      TORCH_CHECK(false, "gossip_ext.simulate: could not start the thread of rank ", i, " of ", n,
                  ": ", e.what());
    }
  }
  for (std::thread& thread : threads) thread.join();
  if (first_failure.load() >= 0) std::rethrow_exception(errors[first_failure.load()]);
  return result;
}

}  // namespace gossip
