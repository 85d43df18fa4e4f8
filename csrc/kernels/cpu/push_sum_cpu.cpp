// CPU kernels of the push-sum ops (schemas in ../ops.cpp). They are the oracle of the CUDA twins.
//
// Each kernel makes one pass over memory: at::parallel_for splits the buffer across threads and
// hands each range to a range kernel (range_kernels.h), compiled once per instruction set and
// picked at run time; float16/bfloat16 accumulate in float32 and round once when stored.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include "kernels/cpu/range_kernels.h"
#include "kernels/push_sum.h"

namespace gossip {
namespace {

constexpr int64_t kGrainSize = 1 << 15;  // elements per task: below this, one thread does it all

// A weight's value, read in place: check_weight has made it one float32 or float64 element on
// the CPU, and item() would take a trip through the dispatcher for it.
double weight_value(const std::optional<at::Tensor>& weight) {
  if (!weight.has_value()) return 1.0;
  return weight->scalar_type() == at::kFloat ? *weight->const_data_ptr<float>()
                                             : *weight->const_data_ptr<double>();
}

// The range kernels' view of a tensor's elements: c10::BFloat16 and c10::Half are one uint16_t,
// as cpu::BFloat16Bits and cpu::HalfBits.
template <typename scalar_t>
struct Bits {
  using type = scalar_t;
};
template <>
struct Bits<at::BFloat16> {
  using type = cpu::BFloat16Bits;
};
template <>
struct Bits<at::Half> {
  using type = cpu::HalfBits;
};
static_assert(sizeof(at::BFloat16) == sizeof(cpu::BFloat16Bits) &&
              sizeof(at::Half) == sizeof(cpu::HalfBits));

template <typename scalar_t>
using bits_t = typename Bits<scalar_t>::type;

// The range kernels' instruction sets, each needing the instructions of those before it; zen4
// needs avx512_bf16's and is picked only on Zen 4, so capping at avx512_bf16 there runs the set
// other CPUs run.
enum class Isa { kBase, kAvx2, kAvx512, kAvx512Bf16, kZen4 };
constexpr const char* kIsaNames[] = {"base", "avx2", "avx512", "avx512_bf16", "zen4"};
constexpr const char* kMaxIsaVariable = "GOSSIP_EXT_MAX_CPU_ISA";

// The cap the environment sets, as ONEDNN_MAX_CPU_ISA caps oneDNN's kernels: for a comparison, or
// to rule the vector kernels out. Unset or empty, none.
Isa max_isa_from_environment() {
  const char* value = std::getenv(kMaxIsaVariable);
  if (value == nullptr || *value == '\0') return Isa::kZen4;
  for (size_t i = 0; i < std::size(kIsaNames); ++i) {
    if (std::strcmp(value, kIsaNames[i]) == 0) return static_cast<Isa>(i);
  }
  TORCH_CHECK(false, kMaxIsaVariable, "='", value,
              "' is not an instruction set of gossip_ext's CPU kernels: expected base, avx2, "
              "avx512, avx512_bf16 or zen4");
}

// cpu_kernels_isa(), decided once: the best this CPU has that torch's CPU capability allows
// (AVX512 allows the AVX-512 sets), capped by the environment.
Isa range_kernels_isa() {
  static const Isa isa = [] {
    const std::string torch_capability = at::get_cpu_capability();
    const bool torch_avx512 = torch_capability == "AVX512";
    const bool torch_avx2 = torch_avx512 || torch_capability == "AVX2";
    Isa best = Isa::kBase;
    if (torch_avx512 && cpu::cpu_is_zen4()) {
      best = Isa::kZen4;
    } else if (torch_avx512 && cpu::cpu_has_avx512_bf16()) {
      best = Isa::kAvx512Bf16;
    } else if (torch_avx512 && cpu::cpu_has_avx512()) {
      best = Isa::kAvx512;
    } else if (torch_avx2 && cpu::cpu_has_avx2()) {
      best = Isa::kAvx2;
    }
    return std::min(best, max_isa_from_environment());
  }();
  return isa;
}

// The one of a kernel's compilations that this process runs.
template <typename Kernel>
Kernel pick(Kernel base, Kernel avx2, Kernel avx512, Kernel avx512_bf16, Kernel zen4) {
  switch (range_kernels_isa()) {
    case Isa::kZen4:
      return zen4;
    case Isa::kAvx512Bf16:
      return avx512_bf16;
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx2:
      return avx2;
    default:
      return base;
  }
}

// pick() over one range kernel's compilations, named once.
#define GOSSIP_PICK_RANGE_KERNEL(...)                                                              \
  pick(&cpu::base::__VA_ARGS__, &cpu::avx2::__VA_ARGS__, &cpu::avx512::__VA_ARGS__,                \
       &cpu::avx512_bf16::__VA_ARGS__, &cpu::zen4::__VA_ARGS__)

template <typename scalar_t>
const bits_t<scalar_t>* bits(const at::Tensor& t) {
  return reinterpret_cast<const bits_t<scalar_t>*>(t.const_data_ptr<scalar_t>());
}

template <typename scalar_t>
bits_t<scalar_t>* mutable_bits(const at::Tensor& t) {
  return reinterpret_cast<bits_t<scalar_t>*>(t.mutable_data_ptr<scalar_t>());
}

void scale_into_cpu(const at::Tensor& src, const at::Tensor& out, double alpha,
                    const std::optional<at::Tensor>& weight) {
  check_scale_into_args(src, out, weight);
  const double scale = alpha * weight_value(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "scale_into", [&] {
    using T = bits_t<scalar_t>;
    const T* in = bits<scalar_t>(src);
    T* result = mutable_bits<scalar_t>(out);
    const auto s = static_cast<at::opmath_type<scalar_t>>(scale);
    const auto kernel = GOSSIP_PICK_RANGE_KERNEL(scale_into<T>);
    at::parallel_for(0, src.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
      kernel(in, result, begin, end, s);
    });
  });
}

template <typename scalar_t, typename message_t>
void compress_into_typed(const at::Tensor& src, const at::Tensor& out, double scale, double fold) {
  using T = bits_t<scalar_t>;
  using M = bits_t<message_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  T* state = mutable_bits<scalar_t>(src);
  M* message = mutable_bits<message_t>(out);
  const auto s = static_cast<opmath_t>(scale);
  const auto f = static_cast<opmath_t>(fold);
  const auto kernel = GOSSIP_PICK_RANGE_KERNEL(compress_into<T, M>);
  at::parallel_for(0, src.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
    kernel(state, message, begin, end, s, f);
  });
}

// Compressed send: one pass reads src, writes the rounded message and folds what rounding took
// off back into src (see push_sum.h).
void compress_into_cpu(const at::Tensor& src, const at::Tensor& out, double alpha,
                       const std::optional<at::Tensor>& weight, double feedback) {
  check_compress_into_args(src, out, weight);
  const double w = weight_value(weight);
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "compress_into_", [&] {
    if (out.scalar_type() == at::kHalf) {
      compress_into_typed<scalar_t, at::Half>(src, out, alpha * w, feedback / w);
    } else {
      compress_into_typed<scalar_t, at::BFloat16>(src, out, alpha * w, feedback / w);
    }
  });
}

template <typename scalar_t, typename message_t>
void absorb_typed(const at::Tensor& x, at::TensorList received, double self_scale,
                  const std::optional<at::Tensor>& sent, double sent_scale, double out_scale,
                  const std::optional<at::Tensor>& nonfinite) {
  using T = bits_t<scalar_t>;
  using M = bits_t<message_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  std::vector<const M*> pointers;
  pointers.reserve(received.size());
  for (const at::Tensor& r : received) pointers.push_back(bits<message_t>(r));
  const M* own = sent.has_value() ? bits<message_t>(*sent) : nullptr;
  T* state = mutable_bits<scalar_t>(x);
  const auto self = static_cast<opmath_t>(self_scale);
  const auto own_scale = static_cast<opmath_t>(sent_scale);
  const auto scale = static_cast<opmath_t>(out_scale);
  const int count = static_cast<int>(pointers.size());
  const auto kernel = nonfinite.has_value() ? GOSSIP_PICK_RANGE_KERNEL(absorb<T, M, true>)
                                            : GOSSIP_PICK_RANGE_KERNEL(absorb<T, M, false>);
  std::atomic<bool> saw_nonfinite{false};
  at::parallel_for(0, x.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
    if (kernel(state, pointers.data(), count, own, begin, end, self, own_scale, scale)) {
      saw_nonfinite.store(true, std::memory_order_relaxed);
    }
  });
  if (saw_nonfinite.load(std::memory_order_relaxed)) nonfinite->fill_(1);
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

// Quantized kernels run over whole blocks of kQuantBlock values (Note [Quantized messages]), so
// that no two threads share an int4 byte or a block's scale.
template <typename Body>
void parallel_for_blocks(int64_t numel, const Body& body) {
  at::parallel_for(0, quant_blocks(numel), kGrainSize / kQuantBlock,
                   [&](int64_t first, int64_t last) {
                     body(first * kQuantBlock, std::min(last * kQuantBlock, numel));
                   });
}

void quantize_into_cpu(const at::Tensor& src, const at::Tensor& out, c10::string_view format,
                       double alpha, const std::optional<at::Tensor>& weight, double feedback) {
  const std::string name(format);
  check_quantize_into_args(src, out, name, weight);
  const BlockFormat block_format = parse_block_format(name);
  const double w = weight_value(weight);
  const int64_t numel = src.numel();
  uint8_t* message = out.mutable_data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "quantize_into_", [&] {
    scalar_t* state = src.mutable_data_ptr<scalar_t>();
    const auto scale = static_cast<scalar_t>(alpha * w);
    const auto fold = static_cast<scalar_t>(feedback / w);
    const auto kernel = GOSSIP_PICK_RANGE_KERNEL(quantize_into<scalar_t>);
    parallel_for_blocks(numel, [&](int64_t begin, int64_t end) {
      kernel(state, message, numel, block_format, begin, end, scale, fold);
    });
  });
}

void absorb_quantized_cpu(const at::Tensor& x, at::TensorList received, c10::string_view format,
                          double alpha, const std::optional<at::Tensor>& self_weight,
                          const std::optional<at::Tensor>& new_weight,
                          const std::optional<at::Tensor>& nonfinite,
                          const std::optional<at::Tensor>& sent, double sent_scale) {
  const std::string name(format);
  check_absorb_quantized_args(x, received, name, self_weight, new_weight, nonfinite, sent);
  const BlockFormat block_format = parse_block_format(name);
  const int64_t numel = x.numel();
  std::vector<const uint8_t*> messages;
  messages.reserve(received.size());
  for (const at::Tensor& r : received) messages.push_back(r.const_data_ptr<uint8_t>());
  const uint8_t* own = sent.has_value() ? sent->const_data_ptr<uint8_t>() : nullptr;
  const int count = static_cast<int>(messages.size());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "absorb_quantized_", [&] {
    scalar_t* state = x.mutable_data_ptr<scalar_t>();
    const auto self = static_cast<scalar_t>(alpha * weight_value(self_weight));
    const auto own_scale = static_cast<scalar_t>(sent_scale);
    const auto out_scale = static_cast<scalar_t>(1.0 / weight_value(new_weight));
    const auto kernel = nonfinite.has_value()
                            ? GOSSIP_PICK_RANGE_KERNEL(absorb_quantized<scalar_t, true>)
                            : GOSSIP_PICK_RANGE_KERNEL(absorb_quantized<scalar_t, false>);
    std::atomic<bool> saw_nonfinite{false};
    parallel_for_blocks(numel, [&](int64_t begin, int64_t end) {
      if (kernel(state, messages.data(), count, own, numel, block_format, begin, end, self,
                 own_scale, out_scale)) {
        saw_nonfinite.store(true, std::memory_order_relaxed);
      }
    });
    if (saw_nonfinite.load(std::memory_order_relaxed)) nonfinite->fill_(1);
  });
}

}  // namespace

#undef GOSSIP_PICK_RANGE_KERNEL

std::string cpu_kernels_isa() { return kIsaNames[static_cast<int>(range_kernels_isa())]; }

TORCH_LIBRARY_IMPL(gossip_ext, CPU, m) {
  m.impl("scale_into", &scale_into_cpu);
  m.impl("compress_into_", &compress_into_cpu);
  m.impl("absorb_", &absorb_cpu);
  m.impl("quantize_into_", &quantize_into_cpu);
  m.impl("absorb_quantized_", &absorb_quantized_cpu);
}

}  // namespace gossip
