// Sparse top-k messages (SparseLoCo's; gossip_ext.sparse_average.TopK), registered as torch ops
// in the `gossip_ext` library beside the push-sum ops (schemas in sparse_ops.cpp):
//
//   topk_encode(Tensor values, int k, int bits, int chunk) -> Tensor
//       The message of `values` (float32 or float64, contiguous, any shape, read flat), a new
//       uint8 tensor on values' device of topk_message_bytes(chunks, k, bits) bytes.
//   topk_add_into(Tensor(a!) total, Tensor message, int k, int bits, int chunk) -> ()
//       total (float32 or float64, contiguous, chunks * chunk values, read flat as chunks rows of
//       `chunk`) += the values `message` carries, each at its position in its chunk's row.
//
// Note [Sparse top-k messages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// n values are cut into chunks = ceil(n / chunk) chunks of `chunk` values, the last padded with
// zeros. In every chunk the k of largest magnitude are kept; among equal magnitudes the lower
// position wins (magnitudes compare as the bits of |v|, so NaN ranks above Inf, as torch.sort
// ranks it). A message is one byte buffer, little-endian:
//
//   [float32 scale, one a chunk | int16 positions, k a chunk, ascending | codes, packed]
//
// A chunk's scale is s = float32(the largest kept magnitude), and a kept value v of dtype T is
// sent as the code
//   c = clamp(round_half_even((v / T(safe) + 1) * T(levels / 2)), 0, levels)
// with levels = 2^bits - 1, safe = s where s > 0 and 1 otherwise, every operation in T (a NaN
// code is 0): the arithmetic of the plain-PyTorch encoding, bit for bit (the tests' reference,
// tests/sparse_reference.py). The chunks * k codes, chunk after chunk, are packed 8 / bits a byte,
// code i of the message in byte i / (8 / bits) at bit (i % (8 / bits)) * bits, the last byte
// padded with zero bits; a byte may hold the codes of two chunks.
//
// The receiver adds (T(c) * T(2 / levels) - 1) * T(s) at the code's position of its chunk, in
// T, one message at a time (torch's scatter_add_ of the reference): the positions of one chunk
// are distinct, so the additions of one message never meet, and every kernel, CPU or CUDA, gives
// the same bits. add_into checks, on the CPU, that every position is in [0, chunk) before it adds
// anything; the CUDA kernel, which cannot report without a host sync, skips a position outside.
#pragma once

#include <cmath>
#include <cstdint>

#include <ATen/core/Tensor.h>

#if defined(__CUDACC__)
#define GOSSIP_TOPK_FN inline __host__ __device__
#else
#define GOSSIP_TOPK_FN inline
#endif

namespace gossip {

// Positions travel as int16.
constexpr int64_t kTopKMaxChunk = 32768;

inline int64_t topk_chunks(int64_t numel, int64_t chunk) { return (numel + chunk - 1) / chunk; }

// Bytes of a message of `chunks` chunks of k codes of `bits` bits.
inline int64_t topk_message_bytes(int64_t chunks, int64_t k, int64_t bits) {
  return chunks * (4 + 2 * k) + (chunks * k * bits + 7) / 8;
}

// The code of a kept value v (Note [Sparse top-k messages]): safe, half_levels and levels in v's
// dtype. Without -ffast-math (the build never uses it) and with no contraction (-ffp-contract=off,
// --fmad=false) every operation rounds as torch's.
template <typename T>
GOSSIP_TOPK_FN uint8_t topk_code(T v, T safe, T half_levels, T levels) {
#if defined(__CUDA_ARCH__)
  const T y = rint((v / safe + T(1)) * half_levels);
#else
  const T y = std::nearbyint((v / safe + T(1)) * half_levels);
#endif
  return !(y > T(0)) ? uint8_t{0} : static_cast<uint8_t>(y > levels ? levels : y);
}

// The value code c adds, in T: step = T(2 / levels), scale = T(the chunk's float32 scale).
template <typename T>
GOSSIP_TOPK_FN T topk_value(uint32_t code, T step, T scale) {
  return (static_cast<T>(code) * step - T(1)) * scale;
}

// Argument checks shared by every backend and the Meta kernels, each error naming the argument
// and its value.
void check_topk_encode_args(const at::Tensor& values, int64_t k, int64_t bits, int64_t chunk);
void check_topk_add_into_args(const at::Tensor& total, const at::Tensor& message, int64_t k,
                              int64_t bits, int64_t chunk);

}  // namespace gossip

#undef GOSSIP_TOPK_FN
