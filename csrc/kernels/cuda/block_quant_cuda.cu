// CUDA twins of the block-quantized message ops (quantize_into_, absorb_quantized_; schemas in
// ../ops.cpp, Note [Quantized messages] in ../block_format.h). The CPU kernels are their oracle,
// bit for bit: the same operations in the same order (the build passes --fmad=false), the
// scalars the host computes in double there computed in double here, once per thread.
//
// One warp works on one quantization block of kQuantBlock = 128 values at a time, four values a
// lane: a block's largest magnitude is a max over the bit patterns of |v| (as on the CPU: NaN
// wins, and integer max needs no NaN rules) reduced by five shuffles, with no shared memory and
// no barrier. What each lane moves is as wide as the data allows: its four state values in one
// 16-byte load and store (two for float64), its four codes in one 4-byte word (2 bytes of int4),
// the block's scale in one 4-byte load shared by the warp. That holds where the state is 16-byte
// aligned and every message 4-byte aligned (a flat buffer's messages are); elsewhere the same
// kernel reads and writes a byte or an element at a time. The grid is sized to fill the GPU once
// and each warp strides over the blocks, so the per-thread set-up (the weights' division in
// double) is paid once per thread, not once per block.
#include <cstdint>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/block_format.h"
#include "kernels/cuda/grid.cuh"
#include "kernels/push_sum.h"

namespace gossip {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kValuesPerLane = static_cast<int>(kQuantBlock) / 32;
static_assert(kValuesPerLane == 4, "a lane's codes are one 4-byte word (int8, float8)");
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

bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// A warp a quantization block: kWarpsPerBlock blocks of 128 values per thread block and pass.
int grid_for(int64_t numel) {
  return grid_stride_blocks(quant_blocks(numel) * 32, kThreads);
}

// ------------------------------------------------------------------ a lane's four values

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T values[N];
};

template <typename T>
struct Four {
  T v[kValuesPerLane];
};

// Values first..first+3 of p, zero past numel: 16-byte loads where kAligned and all four exist.
template <bool kAligned, typename T>
__device__ __forceinline__ Four<T> load_four(const T* p, int64_t first, int64_t numel) {
  Four<T> out;
  if (kAligned && first + kValuesPerLane <= numel) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int h = 0; h < kValuesPerLane / kPer; ++h) {
      const Pack<T, kPer> pack = reinterpret_cast<const Pack<T, kPer>*>(p + first)[h];
#pragma unroll
      for (int j = 0; j < kPer; ++j) out.v[h * kPer + j] = pack.values[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kValuesPerLane; ++j) out.v[j] = first + j < numel ? p[first + j] : T(0);
  }
  return out;
}

template <bool kAligned, typename T>
__device__ __forceinline__ void store_four(T* p, int64_t first, int64_t numel, const Four<T>& in) {
  if (kAligned && first + kValuesPerLane <= numel) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int h = 0; h < kValuesPerLane / kPer; ++h) {
      Pack<T, kPer> pack;
#pragma unroll
      for (int j = 0; j < kPer; ++j) pack.values[j] = in.v[h * kPer + j];
      reinterpret_cast<Pack<T, kPer>*>(p + first)[h] = pack;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kValuesPerLane; ++j) {
      if (first + j < numel) p[first + j] = in.v[j];
    }
  }
}

// The codes of a lane's four values as one word, the first in the low byte (int4: the low 16
// bits, two nibbles a byte, the even value low).
template <BlockFormat kFormat>
constexpr int kCodeBytes = kFormat == BlockFormat::kInt4 ? 2 : 4;

template <BlockFormat kFormat, bool kAligned>
__device__ __forceinline__ uint32_t load_codes(const uint8_t* payload, int64_t first,
                                               int64_t numel) {
  const uint8_t* p = payload + first / (4 / kCodeBytes<kFormat>);
  const int64_t bytes = kFormat == BlockFormat::kInt4 ? (numel + 1) / 2 : numel;
  const int64_t offset = p - payload;
  if (kAligned && offset + kCodeBytes<kFormat> <= bytes) {
    return kFormat == BlockFormat::kInt4 ? *reinterpret_cast<const uint16_t*>(p)
                                         : *reinterpret_cast<const uint32_t*>(p);
  }
  uint32_t word = 0;
#pragma unroll
  for (int b = 0; b < kCodeBytes<kFormat>; ++b) {
    if (offset + b < bytes) word |= static_cast<uint32_t>(p[b]) << (8 * b);
  }
  return word;
}

template <BlockFormat kFormat, bool kAligned>
__device__ __forceinline__ void store_codes(uint8_t* payload, int64_t first, int64_t numel,
                                            uint32_t word) {
  uint8_t* p = payload + first / (4 / kCodeBytes<kFormat>);
  const int64_t bytes = kFormat == BlockFormat::kInt4 ? (numel + 1) / 2 : numel;
  const int64_t offset = p - payload;
  if (kAligned && offset + kCodeBytes<kFormat> <= bytes) {
    if constexpr (kFormat == BlockFormat::kInt4) {
      *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(word);
    } else {
      *reinterpret_cast<uint32_t*>(p) = word;
    }
    return;
  }
#pragma unroll
  for (int b = 0; b < kCodeBytes<kFormat>; ++b) {
    if (offset + b < bytes) p[b] = static_cast<uint8_t>(word >> (8 * b));
  }
}

// The code of value j of a lane's word, unscaled.
template <BlockFormat kFormat>
__device__ __forceinline__ float decode(uint32_t word, int j) {
  if constexpr (kFormat == BlockFormat::kInt4) {
    return quant_int4_value(word >> (4 * j));
  } else if constexpr (kFormat == BlockFormat::kInt8) {
    return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(word >> (8 * j))));
  } else {
    return quant_float8_value(static_cast<uint8_t>(word >> (8 * j)));
  }
}

template <bool kAligned>
__device__ __forceinline__ float load_scale(const uint8_t* message, int64_t block) {
  if (kAligned) return reinterpret_cast<const float*>(message)[block];
  const uint8_t* p = message + block * 4;
  return __uint_as_float(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
}

template <bool kAligned>
__device__ __forceinline__ void store_scale(uint8_t* message, int64_t block, float s) {
  if (kAligned) {
    reinterpret_cast<float*>(message)[block] = s;
    return;
  }
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

// The largest of the warp's `bits`; every lane gets it.
template <typename U>
__device__ __forceinline__ U warp_max(U bits) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const U other = __shfl_xor_sync(0xFFFFFFFFu, bits, offset);
    bits = other > bits ? other : bits;
  }
  return bits;
}

// The code of y (already divided by the scale) and its value, unscaled.
template <BlockFormat kFormat>
__device__ __forceinline__ void encode(float y, uint32_t* code, float* value) {
  constexpr float kQ = kFormat == BlockFormat::kInt8 ? 127.0f
                       : kFormat == BlockFormat::kInt4 ? 7.0f
                                                       : 448.0f;
  float c = y < -kQ ? -kQ : y;
  c = c > kQ ? kQ : c;
  if constexpr (kFormat == BlockFormat::kFloat8E4M3) {
    const uint8_t byte = quant_float8_code(c);
    *code = byte;
    *value = quant_float8_value(byte);
  } else {
    const float level = quant_round_even(c);
    *code = static_cast<uint8_t>(static_cast<int32_t>(level));
    *value = level;
  }
}

struct Lane {
  int64_t first_warp;  // this lane's warp, counted over the grid
  int64_t warps;       // warps in the grid: the stride over quantization blocks
  int lane;
};

__device__ __forceinline__ Lane this_lane() {
  return {(blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32,
          static_cast<int64_t>(gridDim.x) * blockDim.x / 32, static_cast<int>(threadIdx.x % 32)};
}

// ----------------------------------------------------------------------------- quantize_into_

template <BlockFormat kFormat, typename scalar_t, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(scalar_t* __restrict__ src, uint8_t* __restrict__ message, int64_t numel,
                    double alpha, double feedback, Weight weight) {
  using opmath_t = scalar_t;  // float32 or float64
  using Bits = MagnitudeBits<opmath_t>;
  constexpr opmath_t kQ = kFormat == BlockFormat::kInt8 ? 127
                          : kFormat == BlockFormat::kInt4 ? 7
                                                          : 448;
  const double w = weight.load();
  const auto scale = static_cast<opmath_t>(alpha * w);
  const auto fold = static_cast<opmath_t>(feedback / w);
  const int64_t blocks = quant_blocks(numel);
  uint8_t* payload = message + blocks * 4;
  const Lane me = this_lane();
  for (int64_t block = me.first_warp; block < blocks; block += me.warps) {
    const int64_t first = block * kQuantBlock + me.lane * kValuesPerLane;
    const Four<scalar_t> z = load_four<kAligned>(src, first, numel);
    opmath_t v[kValuesPerLane];
    typename Bits::type mine = 0;
#pragma unroll
    for (int j = 0; j < kValuesPerLane; ++j) {
      v[j] = scale * z.v[j];
      const auto bits = first + j < numel ? Bits::of(v[j]) : typename Bits::type(0);
      mine = bits > mine ? bits : mine;
    }
    const typename Bits::type largest = warp_max(mine);
    const bool finite = largest < Bits::kInf;
    // NaN or Inf: the scale is NaN and the codes 0, so the receiver names this sender; the
    // state keeps its values (no feedback).
    const float s = finite ? static_cast<float>(Bits::value(largest) / kQ)
                           : __uint_as_float(0x7FC00000u);
    if (me.lane == 0) store_scale<kAligned>(message, block, s);
    // s is 0 only where every |v| < Q * 2^-150: the codes are 0, the values stay in the residual.
    const opmath_t divisor = s > 0.0f ? static_cast<opmath_t>(s) : opmath_t(1);
    uint32_t word = 0;
    float value[kValuesPerLane];
#pragma unroll
    for (int j = 0; j < kValuesPerLane; ++j) {
      uint32_t code = 0;
      encode<kFormat>(finite && first + j < numel ? static_cast<float>(v[j] / divisor) : 0.0f,
                      &code, &value[j]);
      word |= kFormat == BlockFormat::kInt4 ? (code & 0xFu) << (4 * j) : code << (8 * j);
    }
    store_codes<kFormat, kAligned>(payload, first, numel, word);
    if (finite && fold != opmath_t(0)) {
      Four<scalar_t> out;
#pragma unroll
      for (int j = 0; j < kValuesPerLane; ++j) {
        const opmath_t sent = static_cast<opmath_t>(value[j] * s);
        out.v[j] = z.v[j] + fold * (v[j] - sent);
      }
      store_four<kAligned>(src, first, numel, out);
    }
  }
}

// ----------------------------------------------------------------------------- absorb_quantized_

struct MessageBatch {
  const uint8_t* ptrs[kMaxMessagesPerLaunch];
  int count;
  const uint8_t* sent;  // folded in by the last launch, after every received message; or nullptr
};

// One launch of an absorb: the first scales x by alpha * self_weight, the last adds the sent
// message and divides by new_weight, so that several launches (more than kMaxMessagesPerLaunch
// messages) add in the CPU's order. The state is float32 or float64, its own opmath: the partial
// sum kept in x between launches is not rounded.
struct AbsorbStep {
  double alpha;
  double sent_scale;
  Weight self_weight;
  Weight new_weight;
  bool first;
  bool last;
  int* nonfinite;  // set to 1 when x or a block scale read is NaN or Inf; nullptr: no check
};

__device__ __forceinline__ bool is_nonfinite(float v) {
  return (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u;
}
__device__ __forceinline__ bool is_nonfinite(double v) {
  return (static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7FF0000000000000ull) ==
         0x7FF0000000000000ull;
}

template <BlockFormat kFormat, typename scalar_t, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    absorb_kernel(scalar_t* __restrict__ x, MessageBatch batch, int64_t numel, AbsorbStep step) {
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
  const Lane me = this_lane();
  for (int64_t block = me.first_warp; block < blocks; block += me.warps) {
    const int64_t first = block * kQuantBlock + me.lane * kValuesPerLane;
    // Every message's scale and codes are loaded before any is used: up to 8 loads in flight.
    float scales[kMaxMessagesPerLaunch];
    uint32_t words[kMaxMessagesPerLaunch];
#pragma unroll
    for (int k = 0; k < kMaxMessagesPerLaunch; ++k) {
      if (k < batch.count) {
        scales[k] = load_scale<kAligned>(batch.ptrs[k], block);
        words[k] = load_codes<kFormat, kAligned>(batch.ptrs[k] + payload_offset, first, numel);
      }
    }
    const Four<scalar_t> in = load_four<kAligned>(x, first, numel);
    opmath_t acc[kValuesPerLane];
#pragma unroll
    for (int j = 0; j < kValuesPerLane; ++j) {
      nonfinite |= step.first && is_nonfinite(in.v[j]);
      acc[j] = self_scale * in.v[j];
    }
#pragma unroll
    for (int k = 0; k < kMaxMessagesPerLaunch; ++k) {
      if (k < batch.count) {
        nonfinite |= is_nonfinite(scales[k]);
#pragma unroll
        for (int j = 0; j < kValuesPerLane; ++j) {
          acc[j] += static_cast<opmath_t>(decode<kFormat>(words[k], j) * scales[k]);
        }
      }
    }
    if (batch.sent != nullptr) {
      const float s = load_scale<kAligned>(batch.sent, block);
      const uint32_t word = load_codes<kFormat, kAligned>(batch.sent + payload_offset, first, numel);
      nonfinite |= is_nonfinite(s);
#pragma unroll
      for (int j = 0; j < kValuesPerLane; ++j) {
        acc[j] += sent_scale * static_cast<opmath_t>(decode<kFormat>(word, j) * s);
      }
    }
    Four<scalar_t> out;
#pragma unroll
    for (int j = 0; j < kValuesPerLane; ++j) out.v[j] = acc[j] * out_scale;
    store_four<kAligned>(x, first, numel, out);
  }
  // Every writer stores the same value: racing stores are benign.
  if (nonfinite && step.nonfinite != nullptr) *step.nonfinite = 1;
}

// ----------------------------------------------------------------------------- launchers

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

template <typename Launch>
void with_alignment(bool aligned, const Launch& launch) {
  return aligned ? launch(std::true_type{}) : launch(std::false_type{});
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
    const bool aligned = is_aligned(state, 16) && is_aligned(message, 4);
    with_format(parse_block_format(name), [&](auto f) {
      with_alignment(aligned, [&](auto a) {
        quantize_kernel<decltype(f)::value, scalar_t, decltype(a)::value>
            <<<grid_for(numel), kThreads, 0, stream>>>(state, message, numel, alpha, feedback,
                                                       weight_of(weight));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
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
    bool aligned = is_aligned(state, 16);
    for (const at::Tensor& r : received) aligned = aligned && is_aligned(r.const_data_ptr(), 4);
    if (sent.has_value()) aligned = aligned && is_aligned(sent->const_data_ptr(), 4);
    size_t next = 0;
    bool first = true;
    do {  // at least one launch, even with nothing received
      MessageBatch batch{};
      while (next < received.size() && batch.count < kMaxMessagesPerLaunch) {
        batch.ptrs[batch.count++] = received[next++].const_data_ptr<uint8_t>();
      }
      const bool last = next == received.size();
      if (last && sent.has_value()) batch.sent = sent->const_data_ptr<uint8_t>();
      const AbsorbStep step{alpha,
                            sent_scale,
                            weight_of(self_weight),
                            weight_of(new_weight),
                            first,
                            last,
                            nonfinite.has_value() ? nonfinite->mutable_data_ptr<int>() : nullptr};
      with_format(block_format, [&](auto f) {
        with_alignment(aligned, [&](auto a) {
          absorb_kernel<decltype(f)::value, scalar_t, decltype(a)::value>
              <<<grid_for(numel), kThreads, 0, stream>>>(state, batch, numel, step);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
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
