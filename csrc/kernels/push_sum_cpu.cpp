// CPU kernels of the push-sum ops (schemas in ops.cpp). They are the oracle of the CUDA twins.
//
// Each kernel makes one pass over memory: at::parallel_for splits the buffer across threads, and
// each thread walks its range in cache-sized blocks, accumulating in a small opmath array that the
// compiler vectorizes. float16/bfloat16 accumulate in float32 and round once when stored.
#include <algorithm>
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

template <typename scalar_t>
void absorb_kernel(scalar_t* __restrict x, const std::vector<const scalar_t*>& received,
                   int64_t n, at::opmath_type<scalar_t> self_scale,
                   at::opmath_type<scalar_t> out_scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    opmath_t acc[kBlock];
    for (int64_t start = begin; start < end; start += kBlock) {
      const int64_t len = std::min(kBlock, end - start);
      scalar_t* __restrict xb = x + start;
      for (int64_t j = 0; j < len; ++j) acc[j] = self_scale * static_cast<opmath_t>(xb[j]);
      for (const scalar_t* r : received) {
        const scalar_t* __restrict rb = r + start;
        for (int64_t j = 0; j < len; ++j) acc[j] += static_cast<opmath_t>(rb[j]);
      }
      for (int64_t j = 0; j < len; ++j) xb[j] = static_cast<scalar_t>(acc[j] * out_scale);
    }
  });
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

void absorb_cpu(const at::Tensor& x, at::TensorList received, double alpha,
                const std::optional<at::Tensor>& self_weight,
                const std::optional<at::Tensor>& new_weight) {
  check_absorb_args(x, received, self_weight, new_weight);
  const double self_scale = alpha * weight_value(self_weight);
  const double out_scale = 1.0 / weight_value(new_weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "absorb_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<const scalar_t*> pointers;
    pointers.reserve(received.size());
    for (const at::Tensor& r : received) pointers.push_back(r.const_data_ptr<scalar_t>());
    absorb_kernel<scalar_t>(x.mutable_data_ptr<scalar_t>(), pointers, x.numel(),
                            static_cast<opmath_t>(self_scale), static_cast<opmath_t>(out_scale));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gossip_ext, CPU, m) {
  m.impl("scale_into", &scale_into_cpu);
  m.impl("absorb_", &absorb_cpu);
}

}  // namespace gossip
