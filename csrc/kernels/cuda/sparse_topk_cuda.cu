// CUDA twins of the sparse top-k ops (topk_encode, topk_add_into; schemas in ../sparse_ops.cpp,
// Note [Sparse top-k messages] in ../sparse_topk.h). The CPU kernels are their oracle, byte for
// byte: the same keys, the same order, the same arithmetic (the build passes --fmad=false).
//
// Encoding is two launches on the current stream:
// - select: one thread block a chunk (grid-stride over chunks). A radix select over the bits of
//   the magnitudes, 8 bits a pass from the top (4 passes for float32, 8 for float64), a histogram
//   in shared memory a pass, finds the k-th largest magnitude t and how many of the values equal
//   to it are kept (the lowest positions). Each thread then owns a contiguous run of positions:
//   two block scans (of its values equal to t, then of its kept values) give each kept value its
//   slot, so positions are written ascending. The scale is the chunk's largest magnitude (a block
//   max). Codes go to a scratch buffer, one byte a code.
// - pack: one thread an output byte, 8 / bits codes each (a byte may hold two chunks' codes).
// Decoding is one launch, one thread a kept value: its chunk's scale, its position and its code,
// one addition into total; the positions of a chunk are distinct, so no two threads meet.
#include <cstdint>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/cuda/grid.cuh"
#include "kernels/sparse_topk.h"

namespace gossip {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kWarps = kSelectThreads / 32;
constexpr int kRadix = 256;
constexpr int kThreads = 256;

template <typename T>
using magnitude_t = std::conditional_t<std::is_same_v<T, float>, uint32_t, unsigned long long>;

__device__ __forceinline__ uint32_t magnitude_of(float v) {
  return __float_as_uint(v) & 0x7FFFFFFFu;
}
__device__ __forceinline__ unsigned long long magnitude_of(double v) {
  return static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7FFFFFFFFFFFFFFFull;
}
__device__ __forceinline__ float value_of_magnitude(uint32_t bits) { return __uint_as_float(bits); }
__device__ __forceinline__ double value_of_magnitude(unsigned long long bits) {
  return __longlong_as_double(static_cast<long long>(bits));
}

// The exclusive prefix sum of v over the block (every thread calls it); `scratch` holds kWarps.
__device__ int block_exclusive_scan(int v, int* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  int inclusive = v;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int n = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
    if (lane >= offset) inclusive += n;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int total = lane < kWarps ? scratch[lane] : 0;
    for (int offset = 1; offset < kWarps; offset *= 2) {
      const int n = __shfl_up_sync(0xFFFFFFFFu, total, offset);
      if (lane >= offset) total += n;
    }
    if (lane < kWarps) scratch[lane] = total;
  }
  __syncthreads();
  const int result = inclusive - v + (warp > 0 ? scratch[warp - 1] : 0);
  __syncthreads();  // scratch is free again
  return result;
}

template <typename M>
__device__ M block_max(M v, M* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const M other = __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    v = other > v ? other : v;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  M result = scratch[0];
  for (int w = 1; w < kWarps; ++w) result = scratch[w] > result ? scratch[w] : result;
  __syncthreads();
  return result;
}

// Warp 0: the digit of the `remaining`-th largest key among those the histogram counts, and how
// many keys of that digit are still to be kept. Lane l sums bins 255 - 8l down to 248 - 8l; a scan
// over the lanes finds the lane that holds the digit, which walks its eight bins.
__device__ void find_digit(const int* histogram, int remaining, int* digit, int* left) {
  constexpr int kBinsPerLane = kRadix / 32;
  const int lane = threadIdx.x;
  const int top = kRadix - 1 - lane * kBinsPerLane;
  int sum = 0;
  for (int j = 0; j < kBinsPerLane; ++j) sum += histogram[top - j];
  int inclusive = sum;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int n = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
    if (lane >= offset) inclusive += n;
  }
  const unsigned hit = __ballot_sync(0xFFFFFFFFu, inclusive >= remaining);
  if (lane == __ffs(hit) - 1) {
    int r = remaining - (inclusive - sum);
    int d = top;
    while (histogram[d] < r) r -= histogram[d--];
    *digit = d;
    *left = r;
  }
}

struct SelectArgs {
  int64_t numel, chunks;
  int chunk, k;
  uint8_t* scales;     // 4 bytes a chunk (the message's start: aligned)
  int16_t* positions;  // k a chunk
  uint8_t* codes;      // k a chunk, one byte a code (scratch)
};

template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const T* __restrict__ values, SelectArgs a, T half_levels, T levels) {
  using M = magnitude_t<T>;
  constexpr int kBits = static_cast<int>(sizeof(M)) * 8;
  __shared__ int histogram[kRadix];
  __shared__ int scan_scratch[kWarps];
  __shared__ M max_scratch[kWarps];
  __shared__ int digit_found, remaining_found;

  const int per_thread = (a.chunk + kSelectThreads - 1) / kSelectThreads;
  const int run_begin = min(a.chunk, static_cast<int>(threadIdx.x) * per_thread);
  const int run_end = min(a.chunk, run_begin + per_thread);
  for (int64_t c = blockIdx.x; c < a.chunks; c += gridDim.x) {
    const T* row = values + c * a.chunk;
    const int64_t left = a.numel - c * a.chunk;
    const int present = left < a.chunk ? static_cast<int>(left) : a.chunk;
    auto key = [&](int p) -> M { return p < present ? magnitude_of(row[p]) : M{0}; };

    // The k-th largest magnitude, a digit at a time; `remaining`: how many of the values equal to
    // the prefix found so far are still to be kept.
    M prefix = 0, mask = 0;
    int remaining = a.k;
    M largest = 0;
    for (int shift = kBits - 8; shift >= 0; shift -= 8) {
      for (int d = threadIdx.x; d < kRadix; d += kSelectThreads) histogram[d] = 0;
      __syncthreads();
      for (int p = threadIdx.x; p < a.chunk; p += kSelectThreads) {
        const M m = key(p);
        if (shift == kBits - 8) largest = m > largest ? m : largest;
        if ((m & mask) == prefix) atomicAdd(&histogram[static_cast<int>((m >> shift) & 0xFF)], 1);
      }
      __syncthreads();
      if (threadIdx.x < 32) find_digit(histogram, remaining, &digit_found, &remaining_found);
      __syncthreads();
      prefix |= static_cast<M>(digit_found) << shift;
      mask |= static_cast<M>(0xFF) << shift;
      remaining = remaining_found;
    }
    const M threshold = prefix;
    largest = block_max(largest, max_scratch);

    const float scale = static_cast<float>(value_of_magnitude(largest));
    if (threadIdx.x == 0) reinterpret_cast<float*>(a.scales)[c] = scale;
    const T safe = static_cast<T>(scale > 0.0f ? scale : 1.0f);

    // Kept: every magnitude above the threshold, and the first `remaining` equal to it.
    int equal = 0, above = 0;
    for (int p = run_begin; p < run_end; ++p) {
      const M m = key(p);
      equal += m == threshold;
      above += m > threshold;
    }
    int equal_before = block_exclusive_scan(equal, scan_scratch);
    const int equal_kept = max(0, min(equal, remaining - equal_before));
    int slot = block_exclusive_scan(above + equal_kept, scan_scratch);
    int16_t* row_positions = a.positions + c * a.k;
    uint8_t* row_codes = a.codes + c * a.k;
    for (int p = run_begin; p < run_end; ++p) {
      const T v = p < present ? row[p] : T(0);
      const M m = magnitude_of(v);
      bool kept = m > threshold;
      if (m == threshold) kept = equal_before++ < remaining;
      if (!kept) continue;
      row_positions[slot] = static_cast<int16_t>(p);
      row_codes[slot] = topk_code<T>(v, safe, half_levels, levels);
      ++slot;
    }
    __syncthreads();  // the shared memory of this chunk is read before the next chunk's
  }
}

__global__ void pack_kernel(const uint8_t* __restrict__ codes, int64_t count, int bits,
                            int64_t bytes, uint8_t* __restrict__ packed) {
  const int per_byte = 8 / bits;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < bytes;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t byte = 0;
    for (int lane = 0; lane < per_byte; ++lane) {
      const int64_t i = b * per_byte + lane;
      if (i < count) byte |= static_cast<uint32_t>(codes[i]) << (lane * bits);
    }
    packed[b] = static_cast<uint8_t>(byte);
  }
}

// A message may start at any byte (another rank's, in a gathered buffer): read it a byte at a time.
template <typename T>
__global__ void add_kernel(T* __restrict__ total, const uint8_t* __restrict__ message,
                           int64_t chunks, int chunk, int k, int bits, T step) {
  const int64_t count = chunks * k;
  const uint8_t* positions = message + 4 * chunks;
  const uint8_t* packed = positions + 2 * count;
  const int per_byte = 8 / bits;
  const uint32_t mask = (1u << bits) - 1;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i / k;
    const uint8_t* s = message + 4 * c;
    const uint32_t scale_bits =
        s[0] | (s[1] << 8) | (s[2] << 16) | (static_cast<uint32_t>(s[3]) << 24);
    const int p = static_cast<int16_t>(positions[2 * i] | (positions[2 * i + 1] << 8));
    if (p < 0 || p >= chunk) continue;  // not a message topk_encode writes (Note [Sparse ...])
    const uint32_t code = (packed[i / per_byte] >> ((i % per_byte) * bits)) & mask;
    total[c * chunk + p] += topk_value<T>(code, step, static_cast<T>(__uint_as_float(scale_bits)));
  }
}

at::Tensor topk_encode_cuda(const at::Tensor& values, int64_t k, int64_t bits, int64_t chunk) {
  check_topk_encode_args(values, k, bits, chunk);
  const c10::cuda::OptionalCUDAGuard guard(values.device());
  const int64_t numel = values.numel();
  const int64_t chunks = topk_chunks(numel, chunk);
  at::Tensor out = at::empty({topk_message_bytes(chunks, k, bits)},
                             values.options().dtype(at::kByte));
  if (chunks == 0) return out;
  at::Tensor codes = at::empty({chunks * k}, values.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  uint8_t* message = out.mutable_data_ptr<uint8_t>();
  const SelectArgs args{numel,
                        chunks,
                        static_cast<int>(chunk),
                        static_cast<int>(k),
                        message,
                        reinterpret_cast<int16_t*>(message + 4 * chunks),
                        codes.mutable_data_ptr<uint8_t>()};
  const int grid = grid_stride_blocks(chunks * kSelectThreads, kSelectThreads);
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "topk_encode", [&] {
    const auto levels = static_cast<scalar_t>((1 << bits) - 1);
    const auto half_levels = static_cast<scalar_t>(static_cast<double>((1 << bits) - 1) / 2);
    select_kernel<scalar_t><<<grid, kSelectThreads, 0, stream>>>(
        values.const_data_ptr<scalar_t>(), args, half_levels, levels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const int64_t codes_offset = 4 * chunks + 2 * chunks * k;
  const int64_t packed_bytes = out.numel() - codes_offset;
  pack_kernel<<<grid_stride_blocks(packed_bytes, kThreads), kThreads, 0, stream>>>(
      codes.const_data_ptr<uint8_t>(), chunks * k, static_cast<int>(bits), packed_bytes,
      message + codes_offset);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;  // `codes` goes back to the caching allocator, ordered on this stream
}

void topk_add_into_cuda(const at::Tensor& total, const at::Tensor& message, int64_t k,
                        int64_t bits, int64_t chunk) {
  check_topk_add_into_args(total, message, k, bits, chunk);
  const int64_t chunks = total.numel() / chunk;
  if (chunks == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(total.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(total.scalar_type(), "topk_add_into", [&] {
    const auto step = static_cast<scalar_t>(2.0 / static_cast<double>((1 << bits) - 1));
    add_kernel<scalar_t><<<grid_stride_blocks(chunks * k, kThreads), kThreads, 0, stream>>>(
        total.mutable_data_ptr<scalar_t>(), message.const_data_ptr<uint8_t>(), chunks,
        static_cast<int>(chunk), static_cast<int>(k), static_cast<int>(bits), step);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gossip_ext, CUDA, m) {
  m.impl("topk_encode", &topk_encode_cuda);
  m.impl("topk_add_into", &topk_add_into_cuda);
}

}  // namespace gossip
