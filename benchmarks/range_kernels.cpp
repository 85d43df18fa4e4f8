// The CPU range kernels without torch: each instruction set's scale_into and absorb (k=1, with
// and without the non-finite check) on one buffer, side by side with memcpy of the same bytes, so
// that what a kernel costs is seen apart from the op's dispatch and from torch's copy_. Build and
// run from the repository root:
//
//   g++ -O3 -std=c++20 -fopenmp -ffp-contract=off -Icsrc benchmarks/range_kernels.cpp \
//       csrc/kernels/cpu/range_kernels_*.cpp csrc/kernels/cpu/cpu_features.cpp \
//       -o build/range_kernels_bench && build/range_kernels_bench [elements] [threads] [percentile]
//
// The test build (CMakeLists.txt) also builds it, as build/cmake/range_kernels_bench, so that it
// keeps compiling; nothing runs it there.
//
// Defaults: 1M elements, 2 threads (OpenMP, the range split in equal parts as at::parallel_for
// splits it), the 50th percentile (the median) of 1,000 calls' times. On a shared host whose other
// tenants slow some calls, a low percentile (10) compares kernels at the speed they have when left
// alone. "of memcpy" is the bandwidth ratio of benchmarks/kernels.py: bytes the kernel must move
// over its time, against memcpy's.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/range_kernels.h"

namespace {

using gossip::cpu::BFloat16Bits;
using gossip::cpu::HalfBits;

int percentile = 50;  // of the calls' times, the one reported (main's third argument)

template <typename F>
double percentile_us(F f) {
  std::vector<double> times;
  for (int r = 0; r < 1000; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() * percentile / 100];
}

// The time of f(begin, end) run on `threads` equal parts of [0, n), at the chosen percentile.
template <typename F>
double split_time_us(long n, int threads, F f) {
  return percentile_us([&] {
#pragma omp parallel num_threads(threads)
    {
      const long t = omp_get_thread_num();
      f(n * t / threads, n * (t + 1) / threads);
    }
  });
}

template <typename T>
T* buffer(long n, float first) {
  T* p = static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
  for (long i = 0; i < n; ++i) {
    const float v = first + static_cast<float>(i % 1000) * 1e-3f;
    if constexpr (std::is_same_v<T, float>) {
      p[i] = v;
    } else if constexpr (std::is_same_v<T, HalfBits>) {
      p[i].bits = gossip::cpu::float_to_half(v);
    } else {
      p[i].bits = gossip::cpu::float_to_bfloat16(v);
    }
  }
  return p;
}

// One instruction set's kernels on one type, printed as a row.
template <typename T, typename Scale, typename Absorb, typename AbsorbChecked>
void row(const char* isa, const char* type, long n, int threads, Scale scale, Absorb absorb,
         AbsorbChecked absorb_checked) {
  T* src = buffer<T>(n, 1.0f);
  T* out = buffer<T>(n, 0.0f);
  T* x = buffer<T>(n, 2.0f);
  const T* received[] = {src};
  const double copy = split_time_us(
      n, threads, [&](long b, long e) { std::memcpy(out + b, src + b, (e - b) * sizeof(T)); });
  const double s =
      split_time_us(n, threads, [&](long b, long e) { scale(src, out, b, e, 0.375f); });
  const double a = split_time_us(n, threads, [&](long b, long e) {
    absorb(x, received, 1, nullptr, b, e, 0.5f, 0.0f, 1.0f);
  });
  const double c = split_time_us(n, threads, [&](long b, long e) {
    absorb_checked(x, received, 1, nullptr, b, e, 0.5f, 0.0f, 1.0f);
  });
  // memcpy moves 2n elements, scale_into 2n, absorb with one message 3n.
  std::printf("| %s | %s | %.2f | %.2f | %.2fx | %.2f | %.2fx | %.2f | %.2fx |\n", isa, type, copy,
              s, copy / s, a, 1.5 * copy / a, c, 1.5 * copy / c);
  std::free(src);
  std::free(out);
  std::free(x);
}

// A compressed send and receive: compress_into a 16-bit message from a float32 state (with error
// feedback) and absorb of one such message into a float32 state, printed as a row.
template <typename M, typename Compress, typename Absorb>
void compressed_row(const char* isa, const char* type, long n, int threads, Compress compress,
                    Absorb absorb) {
  float* state = buffer<float>(n, 1.0f);
  float* copied = buffer<float>(n, 0.0f);
  M* message = buffer<M>(n, 1.0f);
  const M* received[] = {message};
  const double copy = split_time_us(n, threads, [&](long b, long e) {
    std::memcpy(copied + b, state + b, (e - b) * sizeof(float));
  });
  const double c = split_time_us(
      n, threads, [&](long b, long e) { compress(state, message, b, e, 0.375f, 2.0f); });
  const double a = split_time_us(n, threads, [&](long b, long e) {
    absorb(state, received, 1, nullptr, b, e, 0.5f, 0.0f, 1.0f);
  });
  // Bytes in units of the state's n elements: compress_into reads and writes the state and
  // writes the message (2 + 1/2), absorb reads the state and the message and writes the state.
  std::printf("| %s | %s | %.2f | %.2f (compress_into) | %.2fx | %.2f | %.2fx | | |\n", isa, type,
              copy, c, 1.25 * copy / c, a, 1.25 * copy / a);
  std::free(state);
  std::free(copied);
  std::free(message);
}

// Every row of one instruction set. One statement, so that `if (...) GOSSIP_ROWS(...)` guards
// all of it: a CPU without the set must run none of its kernels.
#define GOSSIP_ROWS(ns, name)                                                                      \
  do {                                                                                             \
    row<float>(name, "float32", n, threads, ns::scale_into<float>,                                 \
               ns::absorb<float, float, false>, ns::absorb<float, float, true>);                   \
    row<BFloat16Bits>(name, "bfloat16", n, threads, ns::scale_into<BFloat16Bits>,                  \
                      ns::absorb<BFloat16Bits, BFloat16Bits, false>,                               \
                      ns::absorb<BFloat16Bits, BFloat16Bits, true>);                               \
    row<HalfBits>(name, "float16", n, threads, ns::scale_into<HalfBits>,                           \
                  ns::absorb<HalfBits, HalfBits, false>, ns::absorb<HalfBits, HalfBits, true>);    \
    compressed_row<BFloat16Bits>(name, "float32 <- bfloat16", n, threads,                          \
                                 ns::compress_into<float, BFloat16Bits>,                           \
                                 ns::absorb<float, BFloat16Bits, false>);                          \
    compressed_row<HalfBits>(name, "float32 <- float16", n, threads,                               \
                             ns::compress_into<float, HalfBits>,                                   \
                             ns::absorb<float, HalfBits, false>);                                  \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 1000000;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  percentile = argc > 3 ? std::atoi(argv[3]) : 50;
  if (n < 1 || threads < 1 || percentile < 0 || percentile > 99) {
    std::fprintf(stderr, "usage: %s [elements >= 1] [threads >= 1] [percentile 0-99]\n", argv[0]);
    return 2;
  }
  std::printf("%ld elements, %d thread%s; times in us, percentile %d of 1000 calls\n\n", n,
              threads, threads > 1 ? "s" : "", percentile);
  std::printf(
      "| kernels | dtype | memcpy | scale_into | of memcpy | absorb k=1 | of memcpy "
      "| absorb k=1 checked | of memcpy |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  GOSSIP_ROWS(gossip::cpu::base, "base");
  if (gossip::cpu::cpu_has_avx2()) GOSSIP_ROWS(gossip::cpu::avx2, "avx2");
  if (gossip::cpu::cpu_has_avx512()) GOSSIP_ROWS(gossip::cpu::avx512, "avx512");
  if (gossip::cpu::cpu_has_avx512_bf16()) GOSSIP_ROWS(gossip::cpu::avx512_bf16, "avx512_bf16");
  // Its instructions are avx512_bf16's, so it runs wherever those do, for a side-by-side.
  if (gossip::cpu::cpu_has_avx512_bf16()) GOSSIP_ROWS(gossip::cpu::zen4, "zen4");
  return 0;
}
