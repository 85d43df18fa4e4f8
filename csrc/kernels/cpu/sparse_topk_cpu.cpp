// CPU kernels of the sparse top-k ops (Note [Sparse top-k messages] in ../sparse_topk.h; schemas
// in ../sparse_ops.cpp). They are the oracle of the CUDA twins.
//
// Encoding: chunks in parallel; in each, the k-th largest magnitude t (as the bits of |v|): a
// histogram of the magnitudes' top bits finds its bin, a quickselect (std::nth_element) of that
// bin's few finds t; then one scan of the chunk in position order keeps every magnitude above t
// and the first of those equal to t until k are kept (as the CUDA twin), so the positions come
// out ascending with no sort. The codes go to a scratch row per chunk and are
// packed afterwards, bytes in parallel (a byte may hold two chunks' codes).
// Decoding: every position is checked first, then chunks in parallel, each its row of total.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels/sparse_topk.h"

namespace gossip {
namespace {

constexpr int64_t kGrainValues = 1 << 15;  // values per task: below this, one thread does it all

// The bits of |v|, which order as the magnitudes do (NaN above Inf).
template <typename T>
using magnitude_t = std::conditional_t<std::is_same_v<T, float>, uint32_t, uint64_t>;

template <typename T>
magnitude_t<T> magnitude_of(T v) {
  magnitude_t<T> bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & (~magnitude_t<T>{0} >> 1);
}

template <typename T>
T value_of_magnitude(magnitude_t<T> bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

struct Layout {
  int64_t chunks, k, bits, chunk;

  int64_t positions_offset() const { return 4 * chunks; }
  int64_t codes_offset() const { return positions_offset() + 2 * chunks * k; }
};

// Magnitudes are binned by their top kHistogramBits bits (float32: the exponent and 3 bits of
// mantissa; float64: the exponent).
constexpr int kHistogramBits = 11;

template <typename T>
void encode_chunks(const T* values, int64_t numel, const Layout& l, int64_t first, int64_t last,
                   uint8_t* message, uint8_t* codes) {
  using M = magnitude_t<T>;
  constexpr int kShift = static_cast<int>(sizeof(M)) * 8 - 1 - kHistogramBits;
  const T levels = static_cast<T>((1 << l.bits) - 1);
  const T half_levels = static_cast<T>(static_cast<double>((1 << l.bits) - 1) / 2);
  std::vector<M> magnitudes(l.chunk);
  std::vector<M> candidates;
  candidates.reserve(l.chunk);
  std::vector<int32_t> histogram(size_t{1} << kHistogramBits);
  for (int64_t c = first; c < last; ++c) {
    const T* row = values + c * l.chunk;
    const int64_t present = std::min(l.chunk, numel - c * l.chunk);  // the rest is padding: 0
    std::fill(histogram.begin(), histogram.end(), 0);
    M largest = 0;
    for (int64_t p = 0; p < l.chunk; ++p) {
      const M m = p < present ? magnitude_of(row[p]) : 0;
      magnitudes[p] = m;
      ++histogram[m >> kShift];
      largest = std::max(largest, m);
    }
    // The bin of the k-th largest magnitude, then the k-th largest itself among that bin's
    // (a quickselect over a few), and how many of the magnitudes equal to it are kept: the
    // lowest positions.
    int64_t bin = static_cast<int64_t>(largest >> kShift);
    int64_t rank = l.k;  // of the k-th largest, in its bin
    while (histogram[bin] < rank) rank -= histogram[bin--];
    candidates.clear();
    for (int64_t p = 0; p < l.chunk; ++p) {
      if (static_cast<int64_t>(magnitudes[p] >> kShift) == bin) candidates.push_back(magnitudes[p]);
    }
    const auto kth = candidates.begin() + (rank - 1);
    std::nth_element(candidates.begin(), kth, candidates.end(), std::greater<M>());
    const M threshold = *kth;
    int64_t ties = rank;  // the magnitudes above the threshold in its bin come before it
    for (const M m : candidates) ties -= m > threshold;

    const float scale = static_cast<float>(value_of_magnitude<T>(largest));
    std::memcpy(message + 4 * c, &scale, sizeof(scale));
    const T safe = static_cast<T>(scale > 0 ? scale : 1.0f);
    uint8_t* row_positions = message + l.positions_offset() + 2 * c * l.k;
    uint8_t* row_codes = codes + c * l.k;
    int64_t kept = 0;
    for (int64_t p = 0; p < l.chunk && kept < l.k; ++p) {
      const M m = magnitudes[p];
      if (m < threshold || (m == threshold && ties-- <= 0)) continue;
      const int16_t position = static_cast<int16_t>(p);
      std::memcpy(row_positions + 2 * kept, &position, sizeof(position));
      row_codes[kept] = topk_code<T>(p < present ? row[p] : T(0), safe, half_levels, levels);
      ++kept;
    }
    TORCH_INTERNAL_ASSERT(kept == l.k, "topk_encode kept ", kept, " of k=", l.k);
  }
}

// Bytes [first, last) of the packed codes.
void pack_codes(const uint8_t* codes, int64_t count, int64_t bits, int64_t first, int64_t last,
                uint8_t* packed) {
  const int64_t per_byte = 8 / bits;
  for (int64_t b = first; b < last; ++b) {
    uint32_t byte = 0;
    for (int64_t lane = 0; lane < per_byte; ++lane) {
      const int64_t i = b * per_byte + lane;
      if (i < count) byte |= static_cast<uint32_t>(codes[i]) << (lane * bits);
    }
    packed[b] = static_cast<uint8_t>(byte);
  }
}

at::Tensor topk_encode_cpu(const at::Tensor& values, int64_t k, int64_t bits, int64_t chunk) {
  check_topk_encode_args(values, k, bits, chunk);
  const int64_t numel = values.numel();
  const Layout l{topk_chunks(numel, chunk), k, bits, chunk};
  at::Tensor out = at::empty({topk_message_bytes(l.chunks, k, bits)},
                             values.options().dtype(at::kByte));
  uint8_t* message = out.mutable_data_ptr<uint8_t>();
  std::vector<uint8_t> codes(static_cast<size_t>(l.chunks * k));
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "topk_encode", [&] {
    const scalar_t* data = values.const_data_ptr<scalar_t>();
    at::parallel_for(0, l.chunks, std::max<int64_t>(1, kGrainValues / chunk),
                     [&](int64_t first, int64_t last) {
                       encode_chunks<scalar_t>(data, numel, l, first, last, message, codes.data());
                     });
  });
  const int64_t packed_bytes = out.numel() - l.codes_offset();
  at::parallel_for(0, packed_bytes, kGrainValues, [&](int64_t first, int64_t last) {
    pack_codes(codes.data(), l.chunks * k, bits, first, last, message + l.codes_offset());
  });
  return out;
}

void topk_add_into_cpu(const at::Tensor& total, const at::Tensor& message, int64_t k,
                       int64_t bits, int64_t chunk) {
  check_topk_add_into_args(total, message, k, bits, chunk);
  const Layout l{total.numel() / chunk, k, bits, chunk};
  const uint8_t* bytes = message.const_data_ptr<uint8_t>();
  const uint8_t* positions = bytes + l.positions_offset();
  for (int64_t i = 0; i < l.chunks * k; ++i) {  // a bad message changes nothing
    int16_t p;
    std::memcpy(&p, positions + 2 * i, sizeof(p));
    TORCH_CHECK_VALUE(p >= 0 && p < chunk, "gossip_ext: message holds position ", p, " in chunk ",
                      i / k, ", outside [0, chunk=", chunk, ")");
  }
  const uint8_t* packed = bytes + l.codes_offset();
  const int64_t per_byte = 8 / bits;
  const uint32_t mask = (1u << bits) - 1;
  AT_DISPATCH_FLOATING_TYPES(total.scalar_type(), "topk_add_into", [&] {
    scalar_t* out = total.mutable_data_ptr<scalar_t>();
    const auto step = static_cast<scalar_t>(2.0 / static_cast<double>((1 << bits) - 1));
    const int64_t grain = std::max<int64_t>(1, kGrainValues / (4 * k));
    at::parallel_for(0, l.chunks, grain, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        float scale;
        std::memcpy(&scale, bytes + 4 * c, sizeof(scale));
        const auto s = static_cast<scalar_t>(scale);
        scalar_t* row = out + c * chunk;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t i = c * k + j;
          int16_t p;
          std::memcpy(&p, positions + 2 * i, sizeof(p));
          const uint32_t code = (packed[i / per_byte] >> ((i % per_byte) * bits)) & mask;
          row[p] += topk_value<scalar_t>(code, step, s);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gossip_ext, CPU, m) {
  m.impl("topk_encode", &topk_encode_cpu);
  m.impl("topk_add_into", &topk_add_into_cpu);
}

}  // namespace gossip
