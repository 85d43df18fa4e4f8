// CUDA twins of the block-quantized message ops (quantize_into_, absorb_quantized_; schemas in
// ../ops.cpp, Note [Quantized messages] in ../block_format.h). The CPU kernels are their oracle,
// bit for bit: the same operations in the same order (the build passes --fmad=false), the
// scalars the host computes in double there computed in double here.
//
// One thread block of kQuantBlock threads works on one quantization block at a time, a thread a
// value: the block's largest magnitude is a max over the bit patterns of |v| (as on the CPU: NaN
// wins, and integer max needs no NaN rules), reduced by warp shuffles and a word of shared memory
// per warp. The scales are read and written a byte at a time: a message's bytes need not be
// aligned to 4, and a byte access per block costs nothing beside the payload.
#include <cstdint>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/block_format.h"
#include "kernels/push_sum.h"

namespace gossip {
namespace {

constexpr int kThreads = static_cast<int>(kQuantBlock);
constexpr int kWarps = kThreads / 32;
constexpr int kMaxMessagesPerLaunch = 8;

// A one-element float32 or float64 tensor on the device, or none (then the value is 1).
struct Weight {
  const void* ptr = nullptr;
  bool is_double = false;

  __device__ double load() const {
    if (ptr == nullptr) return 1.0;
    return is_double ? *static_cast<const double*>(ptr)
                     : static_cast<double>(*static_cast<const float*>(ptr));
  }
};

Weight weight_of(const std::optional<at::Tensor>& weight) {
  if (!weight.has_value()) return {};
  return {weight->const_data_ptr(), weight->scalar_type() == at::kDouble};
}

int grid_for(int64_t numel) {
  const int64_t blocks = quant_blocks(numel);
  return static_cast<int>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

__device__ float load_scale(const uint8_t* message, int64_t block) {
  const uint8_t* p = message + block * 4;
  return __uint_as_float(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
}

__device__ void store_scale(uint8_t* message, int64_t block, float s) {
  const uint32_t bits = __float_as_uint(s);
  uint8_t* p = message + block * 4;
  for (int b = 0; b < 4; ++b) p[b] = static_cast<uint8_t>(bits >> (8 * b));
}

template <typename opmath_t>
struct MagnitudeBits;
template <>
struct MagnitudeBits<float> {
  using type = uint32_t;
  static constexpr uint32_t kInf = 0x7F800000u;
  __device__ static uint32_t of(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }
  __device__ static float value(uint32_t bits) { return __uint_as_float(bits); }
};
template <>
struct MagnitudeBits<double> {
  using type = unsigned long long;
  static constexpr unsigned long long kInf = 0x7FF0000000000000ull;
  __device__ static unsigned long long of(double v) {
    return static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7FFFFFFFFFFFFFFFull;
  }
  __device__ static double value(unsigned long long bits) {
    return __longlong_as_double(static_cast<long long>(bits));
  }
};

// The largest of every thread's `bits` in the thread block; every thread gets it.
template <typename U>
__device__ U block_max(U bits, U* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const U other = __shfl_down_sync(0xFFFFFFFFu, bits, offset);
    bits = other > bits ? other : bits;
  }
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = bits;
  __syncthreads();
  U largest = shared[0];
  for (int w = 1; w < kWarps; ++w) largest = shared[w] > largest ? shared[w] : largest;
  __syncthreads();  // shared is written again by the next block's reduction
  return largest;
}

// The code of y (already divided by the scale) and its value, unscaled.
template <BlockFormat kFormat>
__device__ void encode(float y, uint8_t* code, float* value) {
  constexpr float kQ = kFormat == BlockFormat::kInt8 ? 127.0f
                       : kFormat == BlockFormat::kInt4 ? 7.0f
                                                       : 448.0f;
  float c = y < -kQ ? -kQ : y;
  c = c > kQ ? kQ : c;
  if constexpr (kFormat == BlockFormat::kFloat8E4M3) {
    *code = quant_float8_code(c);
    *value = quant_float8_value(*code);
  } else {
    const float level = quant_round_even(c);
    *code = static_cast<uint8_t>(static_cast<int32_t>(level));
    *value = level;
  }
}

template <BlockFormat kFormat>
__device__ float decode(const uint8_t* payload, int64_t i) {
  if constexpr (kFormat == BlockFormat::kInt4) {
    return quant_int4_value(static_cast<uint32_t>(payload[i / 2]) >> (4 * (i % 2)));
  } else if constexpr (kFormat == BlockFormat::kInt8) {
    return static_cast<float>(static_cast<int8_t>(payload[i]));
  } else {
    return quant_float8_value(payload[i]);
  }
}

template <BlockFormat kFormat, typename scalar_t>
__global__ void quantize_kernel(scalar_t* __restrict__ src, uint8_t* __restrict__ message,
                                int64_t numel, double alpha, double feedback, Weight weight) {
  using opmath_t = scalar_t;  // float32 or float64
  using Bits = MagnitudeBits<opmath_t>;
  constexpr opmath_t kQ = kFormat == BlockFormat::kInt8 ? 127
                          : kFormat == BlockFormat::kInt4 ? 7
                                                          : 448;
  __shared__ typename Bits::type shared[kWarps];
  const double w = weight.load();
  const auto scale = static_cast<opmath_t>(alpha * w);
  const auto fold = static_cast<opmath_t>(feedback / w);
  uint8_t* payload = message + quant_blocks(numel) * 4;
  for (int64_t block = blockIdx.x; block < quant_blocks(numel); block += gridDim.x) {
    const int64_t i = block * kQuantBlock + threadIdx.x;
    const bool in_range = i < numel;
    const opmath_t z = in_range ? src[i] : opmath_t(0);
    const opmath_t v = scale * z;
    const typename Bits::type largest = block_max(Bits::of(v), shared);
    const bool finite = largest < Bits::kInf;
    const float s = finite ? static_cast<float>(Bits::value(largest) / kQ) : __uint_as_float(0x7FC00000u);
    if (threadIdx.x == 0) store_scale(message, block, s);
    const opmath_t divisor = s > 0.0f ? static_cast<opmath_t>(s) : opmath_t(1);
    uint8_t code = 0;
    float value = 0.0f;
    encode<kFormat>(finite ? static_cast<float>(v / divisor) : 0.0f, &code, &value);
    if constexpr (kFormat == BlockFormat::kInt4) {
      // Lane parity is value parity (blocks start at even values): the even lane writes the byte.
      const uint32_t high = __shfl_down_sync(0xFFFFFFFFu, static_cast<uint32_t>(code), 1);
      const bool has_high = i + 1 < numel;
      if (in_range && i % 2 == 0) {
        payload[i / 2] = static_cast<uint8_t>((code & 0xFu) | (has_high ? (high & 0xFu) << 4 : 0u));
      }
    } else if (in_range) {
      payload[i] = code;
    }
    if (in_range && finite && feedback != 0.0) {
      const opmath_t sent = static_cast<opmath_t>(value * s);
      src[i] = z + fold * (v - sent);
    }
  }
}

struct MessageBatch {
  const uint8_t* ptrs[kMaxMessagesPerLaunch];
  int count;
  const uint8_t* sent;  // folded in by the first launch only; or nullptr
};

struct AbsorbStep {
  double alpha;
  double sent_scale;
  Weight self_weight;
  Weight new_weight;
  bool first;
  bool last;
  int* nonfinite;  // set to 1 when x or a block scale read is NaN or Inf; nullptr: no check
};

__device__ bool is_nonfinite(float v) { return (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u; }
__device__ bool is_nonfinite(double v) {
  return (static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7FF0000000000000ull) ==
         0x7FF0000000000000ull;
}

// The state is float32 or float64, its own opmath: several launches (more than
// kMaxMessagesPerLaunch messages) keep the partial sum in x without rounding anything.
template <BlockFormat kFormat, typename scalar_t>
__global__ void absorb_kernel(scalar_t* x, MessageBatch batch, int64_t numel, AbsorbStep step) {
  using opmath_t = scalar_t;
  const auto self_scale = step.first
                              ? static_cast<opmath_t>(step.alpha * step.self_weight.load())
                              : opmath_t(1);
  const auto out_scale =
      step.last ? static_cast<opmath_t>(1.0 / step.new_weight.load()) : opmath_t(1);
  const auto sent_scale = static_cast<opmath_t>(step.sent_scale);
  const int64_t blocks = quant_blocks(numel);
  const int64_t payload_offset = blocks * 4;
  bool nonfinite = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t block = i / kQuantBlock;
    const opmath_t value = x[i];
    nonfinite |= is_nonfinite(value);
    opmath_t acc = self_scale * value;
    for (int k = 0; k < batch.count; ++k) {
      const float s = load_scale(batch.ptrs[k], block);
      nonfinite |= is_nonfinite(s);
      acc += static_cast<opmath_t>(decode<kFormat>(batch.ptrs[k] + payload_offset, i) * s);
    }
    if (batch.sent != nullptr) {
      const float s = load_scale(batch.sent, block);
      nonfinite |= is_nonfinite(s);
      acc += sent_scale * static_cast<opmath_t>(decode<kFormat>(batch.sent + payload_offset, i) * s);
    }
    x[i] = acc * out_scale;
  }
  // Every writer stores the same value: racing stores are benign.
  if (nonfinite && step.nonfinite != nullptr) *step.nonfinite = 1;
}

template <typename Launch>
void with_format(BlockFormat format, const Launch& launch) {
  switch (format) {
    case BlockFormat::kInt8:
      return launch(std::integral_constant<BlockFormat, BlockFormat::kInt8>{});
    case BlockFormat::kInt4:
      return launch(std::integral_constant<BlockFormat, BlockFormat::kInt4>{});
    case BlockFormat::kFloat8E4M3:
      return launch(std::integral_constant<BlockFormat, BlockFormat::kFloat8E4M3>{});
  }
}

void quantize_into_cuda(const at::Tensor& src, const at::Tensor& out, c10::string_view format,
                        double alpha, const std::optional<at::Tensor>& weight, double feedback) {
  const std::string name(format);
  check_quantize_into_args(src, out, name, weight);
  if (src.numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t numel = src.numel();
  uint8_t* message = out.mutable_data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "quantize_into_", [&] {
    scalar_t* state = src.mutable_data_ptr<scalar_t>();
    with_format(parse_block_format(name), [&](auto f) {
      quantize_kernel<decltype(f)::value, scalar_t><<<grid_for(numel), kThreads, 0, stream>>>(
          state, message, numel, alpha, feedback, weight_of(weight));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void absorb_quantized_cuda(const at::Tensor& x, at::TensorList received, c10::string_view format,
                           double alpha, const std::optional<at::Tensor>& self_weight,
                           const std::optional<at::Tensor>& new_weight,
                           const std::optional<at::Tensor>& nonfinite,
                           const std::optional<at::Tensor>& sent, double sent_scale) {
  const std::string name(format);
  check_absorb_quantized_args(x, received, name, self_weight, new_weight, nonfinite, sent);
  if (x.numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t numel = x.numel();
  const BlockFormat block_format = parse_block_format(name);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "absorb_quantized_", [&] {
    scalar_t* state = x.mutable_data_ptr<scalar_t>();
    size_t next = 0;
    bool first = true;
    do {  // at least one launch, even with nothing received
      MessageBatch batch{};
      if (first && sent.has_value()) batch.sent = sent->const_data_ptr<uint8_t>();
      while (next < received.size() && batch.count < kMaxMessagesPerLaunch) {
        batch.ptrs[batch.count++] = received[next++].const_data_ptr<uint8_t>();
      }
      const AbsorbStep step{alpha,
                            sent_scale,
                            weight_of(self_weight),
                            weight_of(new_weight),
                            first,
                            next == received.size(),
                            nonfinite.has_value() ? nonfinite->mutable_data_ptr<int>() : nullptr};
      with_format(block_format, [&](auto f) {
        absorb_kernel<decltype(f)::value, scalar_t>
            <<<grid_for(numel), kThreads, 0, stream>>>(state, batch, numel, step);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      first = false;
    } while (next < received.size());
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gossip_ext, CUDA, m) {
  m.impl("quantize_into_", &quantize_into_cuda);
  m.impl("absorb_quantized_", &absorb_quantized_cuda);
}

}  // namespace gossip
