// CPU kernels of the push-sum ops (schemas in ops.cpp). They are the oracle of the CUDA twins.
//
// Each kernel makes one pass over memory: at::parallel_for splits the buffer across threads, and
// each thread walks its range in cache-sized blocks, accumulating in a small opmath array that the
// compiler vectorizes. float16/bfloat16 accumulate in float32 and round once when stored.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/push_sum.h"

namespace gossip {
namespace {

constexpr int64_t kGrainSize = 1 << 15;  // elements per task: below this, one thread does it all
constexpr int64_t kBlock = 512;          // elements per accumulation block (fits L1)

double weight_value(const std::optional<at::Tensor>& weight) {
  return weight.has_value() ? weight->item<double>() : 1.0;
}

template <typename scalar_t>
void scale_into_kernel(const scalar_t* __restrict src, scalar_t* __restrict out, int64_t n,
                       at::opmath_type<scalar_t> scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i] = static_cast<scalar_t>(scale * static_cast<opmath_t>(src[i]));
    }
  });
}

// The non-finite check of absorb_. Every value read also feeds a probe lane: lane += v * 0 stays
// 0 while every v is finite and turns NaN for good at the first NaN or Inf (IEEE: Inf * 0 and
// NaN * 0 are NaN). It is one more vectorized multiply-add on data already in registers, and the
// lanes are reduced once per thread range, not per element. Disabled, it is empty: the unchecked
// kernel is the same code as before the check existed.
template <typename opmath_t, bool kEnabled>
struct FiniteProbe {
  void add(int64_t, opmath_t) {}
  bool saw_nonfinite() const { return false; }
};

template <typename opmath_t>
struct FiniteProbe<opmath_t, true> {
  opmath_t lanes[kBlock] = {};
  void add(int64_t j, opmath_t v) { lanes[j] += v * opmath_t(0); }
  bool saw_nonfinite() const {
    opmath_t total = 0;
    for (int64_t j = 0; j < kBlock; ++j) total += lanes[j];
    return std::isnan(total);
  }
};

// Returns whether a non-finite value was read (always false unless kCheckFinite).
template <typename scalar_t, typename message_t, bool kCheckFinite>
bool absorb_kernel(scalar_t* __restrict x, const std::vector<const message_t*>& received,
                   const message_t* sent, int64_t n, at::opmath_type<scalar_t> self_scale,
                   at::opmath_type<scalar_t> sent_scale, at::opmath_type<scalar_t> out_scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    opmath_t acc[kBlock];
    FiniteProbe<opmath_t, kCheckFinite> probe;
    for (int64_t start = begin; start < end; start += kBlock) {
      const int64_t len = std::min(kBlock, end - start);
      scalar_t* __restrict xb = x + start;
      for (int64_t j = 0; j < len; ++j) {
        const opmath_t v = static_cast<opmath_t>(xb[j]);
        acc[j] = self_scale * v;
        probe.add(j, v);
      }
      for (const message_t* r : received) {
        const message_t* __restrict rb = r + start;
        for (int64_t j = 0; j < len; ++j) {
          const opmath_t v = static_cast<opmath_t>(rb[j]);
          acc[j] += v;
          probe.add(j, v);
        }
      }
      if (sent != nullptr) {
        const message_t* __restrict sb = sent + start;
        for (int64_t j = 0; j < len; ++j) {
          const opmath_t v = static_cast<opmath_t>(sb[j]);
          acc[j] += sent_scale * v;
          probe.add(j, v);
        }
      }
      for (int64_t j = 0; j < len; ++j) xb[j] = static_cast<scalar_t>(acc[j] * out_scale);
    }
    if (probe.saw_nonfinite()) nonfinite.store(true, std::memory_order_relaxed);
  });
  return nonfinite.load(std::memory_order_relaxed);
}

void scale_into_cpu(const at::Tensor& src, const at::Tensor& out, double alpha,
                    const std::optional<at::Tensor>& weight) {
  check_scale_into_args(src, out, weight);
  const double scale = alpha * weight_value(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "scale_into", [&] {
    scale_into_kernel<scalar_t>(src.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                                src.numel(), static_cast<at::opmath_type<scalar_t>>(scale));
  });
}

// Compressed send: one pass reads src, writes the rounded message and folds what rounding took
// off back into src (see push_sum.h).
// Without feedback (fold == 0) src is only read: the synchronous engine folds the rounding error
// in at absorb time instead (absorb_'s `sent`), and a round that fails leaves src untouched.
template <typename scalar_t, typename message_t>
void compress_into_kernel(scalar_t* __restrict src, message_t* __restrict out, int64_t n,
                          at::opmath_type<scalar_t> scale, at::opmath_type<scalar_t> fold) {
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    if (fold == opmath_t(0)) {
      for (int64_t i = begin; i < end; ++i) {
        out[i] = static_cast<message_t>(scale * static_cast<opmath_t>(src[i]));
      }
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      const opmath_t z = static_cast<opmath_t>(src[i]);
      const opmath_t v = scale * z;
      const message_t q = static_cast<message_t>(v);
      out[i] = q;
      src[i] = static_cast<scalar_t>(z + fold * (v - static_cast<opmath_t>(q)));
    }
  });
}

void compress_into_cpu(const at::Tensor& src, const at::Tensor& out, double alpha,
                       const std::optional<at::Tensor>& weight, double feedback) {
  check_compress_into_args(src, out, weight);
  const double w = weight_value(weight);
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "compress_into_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto scale = static_cast<opmath_t>(alpha * w);
    const auto fold = static_cast<opmath_t>(feedback / w);
    if (out.scalar_type() == at::kHalf) {
      compress_into_kernel(src.mutable_data_ptr<scalar_t>(), out.mutable_data_ptr<at::Half>(),
                           src.numel(), scale, fold);
    } else {
      compress_into_kernel(src.mutable_data_ptr<scalar_t>(),
                           out.mutable_data_ptr<at::BFloat16>(), src.numel(), scale, fold);
    }
  });
}

template <typename scalar_t, typename message_t>
void absorb_typed(const at::Tensor& x, at::TensorList received, double self_scale,
                  const std::optional<at::Tensor>& sent, double sent_scale, double out_scale,
                  const std::optional<at::Tensor>& nonfinite) {
  using opmath_t = at::opmath_type<scalar_t>;
  std::vector<const message_t*> pointers;
  pointers.reserve(received.size());
  for (const at::Tensor& r : received) pointers.push_back(r.const_data_ptr<message_t>());
  const message_t* own = sent.has_value() ? sent->const_data_ptr<message_t>() : nullptr;
  scalar_t* out = x.mutable_data_ptr<scalar_t>();
  const auto self = static_cast<opmath_t>(self_scale);
  const auto own_scale = static_cast<opmath_t>(sent_scale);
  const auto scale = static_cast<opmath_t>(out_scale);
  if (!nonfinite.has_value()) {
    absorb_kernel<scalar_t, message_t, false>(out, pointers, own, x.numel(), self, own_scale,
                                              scale);
  } else if (absorb_kernel<scalar_t, message_t, true>(out, pointers, own, x.numel(), self,
                                                      own_scale, scale)) {
    nonfinite->fill_(1);
  }
}

void absorb_cpu(const at::Tensor& x, at::TensorList received, double alpha,
                const std::optional<at::Tensor>& self_weight,
                const std::optional<at::Tensor>& new_weight,
                const std::optional<at::Tensor>& nonfinite, const std::optional<at::Tensor>& sent,
                double sent_scale) {
  check_absorb_args(x, received, self_weight, new_weight, nonfinite, sent);
  const double self_scale = alpha * weight_value(self_weight);
  const double out_scale = 1.0 / weight_value(new_weight);
  const at::ScalarType message = absorb_message_dtype(x, received, sent);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "absorb_", [&] {
    if (message == x.scalar_type()) {
      absorb_typed<scalar_t, scalar_t>(x, received, self_scale, sent, sent_scale, out_scale,
                                       nonfinite);
    } else if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      // Compressed messages (checked above: float16 or bfloat16 under a float32/64 state).
      if (message == at::kHalf) {
        absorb_typed<scalar_t, at::Half>(x, received, self_scale, sent, sent_scale, out_scale,
                                         nonfinite);
      } else {
        absorb_typed<scalar_t, at::BFloat16>(x, received, self_scale, sent, sent_scale,
                                             out_scale, nonfinite);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gossip_ext, CPU, m) {
  m.impl("scale_into", &scale_into_cpu);
  m.impl("compress_into_", &compress_into_cpu);
  m.impl("absorb_", &absorb_cpu);
}

}  // namespace gossip
