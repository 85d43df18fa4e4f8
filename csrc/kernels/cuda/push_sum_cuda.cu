// CUDA kernels of the push-sum ops (schemas in ../ops.cpp); push_sum_cpu.cpp is their oracle.
//
// Launcher and math are split as in ATen's MultiTensorApply: the launchers check arguments, take
// the device guard and launch on the current stream; the kernels do one pass over memory with
// 16-byte vector loads and stores where every pointer is aligned, and a scalar tail. float16 and
// bfloat16 accumulate in float32 and round once when stored. Push-sum weights are read by the
// kernel from device memory, so the hot path never synchronises with the host.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/cuda/grid.cuh"
#include "kernels/push_sum.h"

namespace gossip {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorBytes = 16;
// Received buffers handled by one launch; more are folded in by further launches.
constexpr int kMaxReceivedPerLaunch = 8;

// A one-element float32 or float64 tensor on the device, or none (then the value is 1).
struct DeviceWeight {
  const void* ptr = nullptr;
  bool is_double = false;

  template <typename opmath_t>
  __device__ opmath_t load() const {
    if (ptr == nullptr) return opmath_t(1);
    return is_double ? static_cast<opmath_t>(*static_cast<const double*>(ptr))
                     : static_cast<opmath_t>(*static_cast<const float*>(ptr));
  }
};

DeviceWeight device_weight(const std::optional<at::Tensor>& weight) {
  if (!weight.has_value()) return {};
  return {weight->const_data_ptr(), weight->scalar_type() == at::kDouble};
}

// N elements loaded or stored as one aligned access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T values[N];
};

// Elements of the state's dtype in 16 bytes: what one thread handles per vector access.
template <typename scalar_t>
constexpr int kVectorSize = kVectorBytes / static_cast<int>(sizeof(scalar_t));

// 16 bytes of the state's dtype; messages in a 16-bit dtype are loaded as Packs of as many
// elements (8 bytes for a float32 state), so one thread handles the same elements of both.
template <typename scalar_t>
using Vector = Pack<scalar_t, kVectorSize<scalar_t>>;

template <typename scalar_t, typename message_t>
using MessageVector = Pack<message_t, kVectorSize<scalar_t>>;

bool is_aligned(const void* p, size_t bytes = kVectorBytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

int blocks_for(int64_t work_items) {
  const int64_t blocks = (work_items + kThreads - 1) / kThreads;
  return static_cast<int>(std::clamp<int64_t>(blocks, 1, 65535));
}

// ----------------------------------------------------------------------------- scale_into

template <typename scalar_t, bool kVectorized>
__global__ void scale_into_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ out,
                                  int64_t n, double alpha, DeviceWeight weight) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t scale = static_cast<opmath_t>(alpha) * weight.load<opmath_t>();
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  int64_t first_scalar = 0;
  if constexpr (kVectorized) {
    using V = Vector<scalar_t>;
    const int64_t num_vectors = n / kVectorSize<scalar_t>;
    for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vectors;
         v += stride) {
      V in = reinterpret_cast<const V*>(src)[v];
      V result;
#pragma unroll
      for (int j = 0; j < kVectorSize<scalar_t>; ++j) {
        result.values[j] = static_cast<scalar_t>(scale * static_cast<opmath_t>(in.values[j]));
      }
      reinterpret_cast<V*>(out)[v] = result;
    }
    first_scalar = num_vectors * kVectorSize<scalar_t>;
  }
  for (int64_t i = first_scalar + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += stride) {
    out[i] = static_cast<scalar_t>(scale * static_cast<opmath_t>(src[i]));
  }
}

void scale_into_cuda(const at::Tensor& src, const at::Tensor& out, double alpha,
                     const std::optional<at::Tensor>& weight) {
  check_scale_into_args(src, out, weight);
  const int64_t n = src.numel();
  if (n == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DeviceWeight w = device_weight(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "scale_into", [&] {
    const scalar_t* in = src.const_data_ptr<scalar_t>();
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    if (is_aligned(in) && is_aligned(result)) {
      const int64_t items = std::max<int64_t>(n / kVectorSize<scalar_t>, 1);
      scale_into_kernel<scalar_t, true>
          <<<blocks_for(items), kThreads, 0, stream>>>(in, result, n, alpha, w);
    } else {
      scale_into_kernel<scalar_t, false>
          <<<blocks_for(n), kThreads, 0, stream>>>(in, result, n, alpha, w);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ----------------------------------------------------------------------------- absorb_

template <typename message_t>
struct ReceivedBatch {
  const message_t* ptrs[kMaxReceivedPerLaunch];
  int count;
  const message_t* sent;  // absorb_'s `sent`, folded in by the last launch only; or nullptr
};

// One launch folds `batch` into x. The first launch of an absorb scales x by alpha * self_weight;
// the last one adds `sent` and divides by new_weight; a single launch does all three. So several
// launches add in the CPU twin's order: x, the received messages in turn, then sent.
struct AbsorbStep {
  double alpha;
  double sent_scale;
  DeviceWeight self_weight;
  DeviceWeight new_weight;
  bool first;
  bool last;
  int* nonfinite;  // set to 1 when a value read is NaN or Inf; nullptr: no check
};

// NaN or Inf: an all-ones exponent. Tested on the bits, because --use_fast_math lets the compiler
// assume finite values in floating-point comparisons.
__device__ __forceinline__ bool is_nonfinite(float v) {
  return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool is_nonfinite(double v) {
  return (static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7ff0000000000000ull) ==
         0x7ff0000000000000ull;
}

// Vectors a thread works on at once in absorb_: its loads of the state, then of each message,
// are issued together, kUnroll in flight per thread. With one vector a thread (measured on an
// H100 at 25M float32 values) each warp spent 49 of its 68 cycles between instructions waiting
// on a load, and the kernel moved 0.58x a copy's bytes per second.
constexpr int kUnroll = 4;

// One launch: out = (self_scale * in + sum of the batch + sent_scale * sent) * out_scale, with
// in and out the state (in place) or, between the launches of an absorb of many messages into a
// 16-bit state, a float32 scratch buffer (see launch_absorb). `in` and `out` may alias.
template <typename scalar_t, typename in_t, typename out_t, typename message_t, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    absorb_kernel(const in_t* in, out_t* out, ReceivedBatch<message_t> batch, int64_t n,
                  AbsorbStep step) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t self_scale =
      step.first ? static_cast<opmath_t>(step.alpha) * step.self_weight.load<opmath_t>()
                 : opmath_t(1);
  const opmath_t out_scale =
      step.last ? opmath_t(1) / step.new_weight.load<opmath_t>() : opmath_t(1);
  const opmath_t sent_scale = static_cast<opmath_t>(step.sent_scale);
  const int64_t threads = static_cast<int64_t>(blockDim.x) * gridDim.x;
  const int64_t me = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  // Per-thread, in a register: the values are checked as they pass, at no extra memory traffic.
  bool nonfinite = false;
  int64_t first_scalar = 0;
  if constexpr (kVectorized) {
    constexpr int kSize = kVectorSize<scalar_t>;  // whatever the in and out types
    using In = Pack<in_t, kSize>;
    using Out = Pack<out_t, kSize>;
    using M = MessageVector<scalar_t, message_t>;
    const int64_t num_vectors = n / kSize;
    // Vector u of a pass is base + u * threads: each of the kUnroll loads is coalesced.
    for (int64_t base = me; base < num_vectors; base += threads * kUnroll) {
      opmath_t acc[kUnroll][kSize];
      In xv[kUnroll] = {};  // zeros past the end: finite, and never stored
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * threads < num_vectors) xv[u] = reinterpret_cast<const In*>(in)[base + u * threads];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kSize; ++j) {
          const opmath_t value = static_cast<opmath_t>(xv[u].values[j]);
          nonfinite |= is_nonfinite(value);
          acc[u][j] = self_scale * value;
        }
      }
      const auto add = [&](const message_t* message, opmath_t scale, bool scaled) {
        M rv[kUnroll] = {};
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (base + u * threads < num_vectors) rv[u] = reinterpret_cast<const M*>(message)[base + u * threads];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
          for (int j = 0; j < kSize; ++j) {
            const opmath_t value = static_cast<opmath_t>(rv[u].values[j]);
            nonfinite |= is_nonfinite(value);
            acc[u][j] += scaled ? scale * value : value;
          }
        }
      };
      for (int k = 0; k < batch.count; ++k) add(batch.ptrs[k], opmath_t(1), false);
      if (batch.sent != nullptr) add(batch.sent, sent_scale, true);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        Out ov;
#pragma unroll
        for (int j = 0; j < kSize; ++j) ov.values[j] = static_cast<out_t>(acc[u][j] * out_scale);
        if (base + u * threads < num_vectors) reinterpret_cast<Out*>(out)[base + u * threads] = ov;
      }
    }
    first_scalar = num_vectors * kSize;
  }
  for (int64_t i = first_scalar + me; i < n; i += threads) {
    const opmath_t value = static_cast<opmath_t>(in[i]);
    nonfinite |= is_nonfinite(value);
    opmath_t acc = self_scale * value;
    for (int k = 0; k < batch.count; ++k) {
      const opmath_t received = static_cast<opmath_t>(batch.ptrs[k][i]);
      nonfinite |= is_nonfinite(received);
      acc += received;
    }
    if (batch.sent != nullptr) {
      const opmath_t sent = static_cast<opmath_t>(batch.sent[i]);
      nonfinite |= is_nonfinite(sent);
      acc += sent_scale * sent;
    }
    out[i] = static_cast<out_t>(acc * out_scale);
  }
  // Every writer stores the same value, so racing stores are benign; no atomics needed.
  if (nonfinite && step.nonfinite != nullptr) *step.nonfinite = 1;
}

template <typename scalar_t, typename in_t, typename out_t, typename message_t>
void launch_absorb_step(const in_t* in, out_t* out, const ReceivedBatch<message_t>& batch,
                        int64_t n, const AbsorbStep& step, bool aligned, cudaStream_t stream) {
  if (aligned) {
    const int64_t items = (n / kVectorSize<scalar_t> + kUnroll - 1) / kUnroll;
    absorb_kernel<scalar_t, in_t, out_t, message_t, true>
        <<<grid_stride_blocks(items, kThreads), kThreads, 0, stream>>>(in, out, batch, n, step);
  } else {
    absorb_kernel<scalar_t, in_t, out_t, message_t, false>
        <<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(in, out, batch, n, step);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// More than kMaxReceivedPerLaunch messages take several launches. A float32/float64 state holds
// the partial sum in its own dtype, which is its opmath: nothing is rounded in between. A 16-bit
// state would round the partial sum at every launch (and float16 can overflow where the final
// average would not), so the partial sums live in a float32 scratch buffer and the state is read
// by the first launch and written by the last one only.
template <typename scalar_t, typename message_t>
void launch_absorb(const at::Tensor& x, at::TensorList received, double alpha,
                   const std::optional<at::Tensor>& self_weight,
                   const std::optional<at::Tensor>& new_weight,
                   const std::optional<at::Tensor>& nonfinite,
                   const std::optional<at::Tensor>& sent, double sent_scale,
                   cudaStream_t stream) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr bool kNarrowState = !std::is_same_v<scalar_t, opmath_t>;
  const int64_t n = x.numel();
  constexpr size_t kMessageVectorBytes = sizeof(MessageVector<scalar_t, message_t>);
  scalar_t* state = x.mutable_data_ptr<scalar_t>();
  const size_t total = received.size();
  at::Tensor scratch;
  if (kNarrowState && total > static_cast<size_t>(kMaxReceivedPerLaunch)) {
    scratch = at::empty({n}, x.options().dtype(c10::CppTypeToScalarType<opmath_t>::value));
  }
  opmath_t* partial = scratch.defined() ? scratch.mutable_data_ptr<opmath_t>() : nullptr;
  size_t next = 0;
  bool first = true;
  do {  // at least one launch, even with nothing received: x = alpha * w * x / w_new
    ReceivedBatch<message_t> batch{};
    bool aligned = is_aligned(state) && (partial == nullptr || is_aligned(partial, 32));
    while (next < total && batch.count < kMaxReceivedPerLaunch) {
      const message_t* r = received[next++].const_data_ptr<message_t>();
      aligned = aligned && is_aligned(r, kMessageVectorBytes);
      batch.ptrs[batch.count++] = r;
    }
    const bool last = next == total;
    if (last && sent.has_value()) {
      batch.sent = sent->const_data_ptr<message_t>();
      aligned = aligned && is_aligned(batch.sent, kMessageVectorBytes);
    }
    const AbsorbStep step{alpha,
                          sent_scale,
                          device_weight(self_weight),
                          device_weight(new_weight),
                          first,
                          last,
                          nonfinite.has_value() ? nonfinite->mutable_data_ptr<int>() : nullptr};
    if (partial == nullptr) {
      launch_absorb_step<scalar_t>(state, state, batch, n, step, aligned, stream);
    } else if (first) {
      launch_absorb_step<scalar_t>(state, partial, batch, n, step, aligned, stream);
    } else if (!last) {
      launch_absorb_step<scalar_t>(partial, partial, batch, n, step, aligned, stream);
    } else {
      launch_absorb_step<scalar_t>(partial, state, batch, n, step, aligned, stream);
    }
    first = false;
  } while (next < total);
}

void absorb_cuda(const at::Tensor& x, at::TensorList received, double alpha,
                 const std::optional<at::Tensor>& self_weight,
                 const std::optional<at::Tensor>& new_weight,
                 const std::optional<at::Tensor>& nonfinite,
                 const std::optional<at::Tensor>& sent, double sent_scale) {
  check_absorb_args(x, received, self_weight, new_weight, nonfinite, sent);
  if (x.numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::ScalarType message = absorb_message_dtype(x, received, sent);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "absorb_", [&] {
    if (message == x.scalar_type()) {
      launch_absorb<scalar_t, scalar_t>(x, received, alpha, self_weight, new_weight, nonfinite,
                                        sent, sent_scale, stream);
    } else if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      // Compressed messages (checked: float16 or bfloat16 under a float32/64 state).
      if (message == at::kHalf) {
        launch_absorb<scalar_t, at::Half>(x, received, alpha, self_weight, new_weight, nonfinite,
                                          sent, sent_scale, stream);
      } else {
        launch_absorb<scalar_t, at::BFloat16>(x, received, alpha, self_weight, new_weight,
                                              nonfinite, sent, sent_scale, stream);
      }
    }
  });
}

// ----------------------------------------------------------------------------- compress_into_

template <typename scalar_t, typename message_t, bool kVectorized>
__global__ void compress_into_kernel(scalar_t* __restrict__ src, message_t* __restrict__ out,
                                     int64_t n, double alpha, double feedback,
                                     DeviceWeight weight) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t w = weight.load<opmath_t>();
  const opmath_t scale = static_cast<opmath_t>(alpha) * w;
  const opmath_t fold = static_cast<opmath_t>(feedback) / w;
  // Without feedback src is only read (see the CPU twin): no store back.
  const bool write_back = feedback != 0.0;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  int64_t first_scalar = 0;
  if constexpr (kVectorized) {
    using V = Vector<scalar_t>;
    using M = MessageVector<scalar_t, message_t>;
    const int64_t num_vectors = n / kVectorSize<scalar_t>;
    for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vectors;
         v += stride) {
      V zv = reinterpret_cast<const V*>(src)[v];
      M qv;
#pragma unroll
      for (int j = 0; j < kVectorSize<scalar_t>; ++j) {
        const opmath_t z = static_cast<opmath_t>(zv.values[j]);
        const opmath_t value = scale * z;
        qv.values[j] = static_cast<message_t>(value);
        zv.values[j] =
            static_cast<scalar_t>(z + fold * (value - static_cast<opmath_t>(qv.values[j])));
      }
      reinterpret_cast<M*>(out)[v] = qv;
      if (write_back) reinterpret_cast<V*>(src)[v] = zv;
    }
    first_scalar = num_vectors * kVectorSize<scalar_t>;
  }
  for (int64_t i = first_scalar + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += stride) {
    const opmath_t z = static_cast<opmath_t>(src[i]);
    const opmath_t value = scale * z;
    const message_t q = static_cast<message_t>(value);
    out[i] = q;
    if (write_back) src[i] = static_cast<scalar_t>(z + fold * (value - static_cast<opmath_t>(q)));
  }
}

template <typename scalar_t, typename message_t>
void launch_compress_into(const at::Tensor& src, const at::Tensor& out, double alpha,
                          double feedback, const DeviceWeight& w, cudaStream_t stream) {
  const int64_t n = src.numel();
  scalar_t* state = src.mutable_data_ptr<scalar_t>();
  message_t* message = out.mutable_data_ptr<message_t>();
  if (is_aligned(state) && is_aligned(message, sizeof(MessageVector<scalar_t, message_t>))) {
    const int64_t items = std::max<int64_t>(n / kVectorSize<scalar_t>, 1);
    compress_into_kernel<scalar_t, message_t, true>
        <<<blocks_for(items), kThreads, 0, stream>>>(state, message, n, alpha, feedback, w);
  } else {
    compress_into_kernel<scalar_t, message_t, false>
        <<<blocks_for(n), kThreads, 0, stream>>>(state, message, n, alpha, feedback, w);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void compress_into_cuda(const at::Tensor& src, const at::Tensor& out, double alpha,
                        const std::optional<at::Tensor>& weight, double feedback) {
  check_compress_into_args(src, out, weight);
  if (src.numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DeviceWeight w = device_weight(weight);
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "compress_into_", [&] {
    if (out.scalar_type() == at::kHalf) {
      launch_compress_into<scalar_t, at::Half>(src, out, alpha, feedback, w, stream);
    } else {
      launch_compress_into<scalar_t, at::BFloat16>(src, out, alpha, feedback, w, stream);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gossip_ext, CUDA, m) {
  m.impl("scale_into", &scale_into_cuda);
  m.impl("compress_into_", &compress_into_cuda);
  m.impl("absorb_", &absorb_cuda);
}

}  // namespace gossip
