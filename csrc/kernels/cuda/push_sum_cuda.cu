// CUDA kernels of the push-sum ops (schemas in ../ops.cpp); push_sum_cpu.cpp is their oracle.
//
// Launcher and math are split as in ATen's MultiTensorApply: the launchers check arguments, take
// the device guard and launch on the current stream; the kernels do one pass over memory with
// 16-byte vector loads and stores where every pointer is aligned, and a scalar tail. float16 and
// bfloat16 accumulate in float32 and round once when stored. Push-sum weights are read by the
// kernel from device memory, so the hot path never synchronises with the host.
#include <algorithm>
#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

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

template <typename scalar_t>
struct alignas(kVectorBytes) Vector {
  static constexpr int kSize = kVectorBytes / static_cast<int>(sizeof(scalar_t));
  scalar_t values[kSize];
};

bool is_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kVectorBytes == 0; }

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
    const int64_t num_vectors = n / V::kSize;
    for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vectors;
         v += stride) {
      V in = reinterpret_cast<const V*>(src)[v];
      V result;
#pragma unroll
      for (int j = 0; j < V::kSize; ++j) {
        result.values[j] = static_cast<scalar_t>(scale * static_cast<opmath_t>(in.values[j]));
      }
      reinterpret_cast<V*>(out)[v] = result;
    }
    first_scalar = num_vectors * V::kSize;
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
      const int64_t items = std::max<int64_t>(n / Vector<scalar_t>::kSize, 1);
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

template <typename scalar_t>
struct ReceivedBatch {
  const scalar_t* ptrs[kMaxReceivedPerLaunch];
  int count;
};

// One launch folds `batch` into x. The first launch of an absorb scales x by alpha * self_weight;
// the last one divides by new_weight; a single launch does both.
struct AbsorbStep {
  double alpha;
  DeviceWeight self_weight;
  DeviceWeight new_weight;
  bool first;
  bool last;
};

template <typename scalar_t, bool kVectorized>
__global__ void absorb_kernel(scalar_t* __restrict__ x, ReceivedBatch<scalar_t> batch, int64_t n,
                              AbsorbStep step) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t self_scale =
      step.first ? static_cast<opmath_t>(step.alpha) * step.self_weight.load<opmath_t>()
                 : opmath_t(1);
  const opmath_t out_scale =
      step.last ? opmath_t(1) / step.new_weight.load<opmath_t>() : opmath_t(1);
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  int64_t first_scalar = 0;
  if constexpr (kVectorized) {
    using V = Vector<scalar_t>;
    const int64_t num_vectors = n / V::kSize;
    for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vectors;
         v += stride) {
      V xv = reinterpret_cast<const V*>(x)[v];
      opmath_t acc[V::kSize];
#pragma unroll
      for (int j = 0; j < V::kSize; ++j) acc[j] = self_scale * static_cast<opmath_t>(xv.values[j]);
      for (int k = 0; k < batch.count; ++k) {
        const V rv = reinterpret_cast<const V*>(batch.ptrs[k])[v];
#pragma unroll
        for (int j = 0; j < V::kSize; ++j) acc[j] += static_cast<opmath_t>(rv.values[j]);
      }
#pragma unroll
      for (int j = 0; j < V::kSize; ++j) xv.values[j] = static_cast<scalar_t>(acc[j] * out_scale);
      reinterpret_cast<V*>(x)[v] = xv;
    }
    first_scalar = num_vectors * V::kSize;
  }
  for (int64_t i = first_scalar + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += stride) {
    opmath_t acc = self_scale * static_cast<opmath_t>(x[i]);
    for (int k = 0; k < batch.count; ++k) acc += static_cast<opmath_t>(batch.ptrs[k][i]);
    x[i] = static_cast<scalar_t>(acc * out_scale);
  }
}

void absorb_cuda(const at::Tensor& x, at::TensorList received, double alpha,
                 const std::optional<at::Tensor>& self_weight,
                 const std::optional<at::Tensor>& new_weight) {
  check_absorb_args(x, received, self_weight, new_weight);
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "absorb_", [&] {
    scalar_t* out = x.mutable_data_ptr<scalar_t>();
    const size_t total = received.size();
    size_t next = 0;
    bool first = true;
    do {  // at least one launch, even with nothing received: x = alpha * w * x / w_new
      ReceivedBatch<scalar_t> batch{};
      bool aligned = is_aligned(out);
      while (next < total && batch.count < kMaxReceivedPerLaunch) {
        const scalar_t* r = received[next++].const_data_ptr<scalar_t>();
        aligned = aligned && is_aligned(r);
        batch.ptrs[batch.count++] = r;
      }
      const AbsorbStep step{alpha, device_weight(self_weight), device_weight(new_weight), first,
                            /*last=*/next == total};
      first = false;
      if (aligned) {
        const int64_t items = std::max<int64_t>(n / Vector<scalar_t>::kSize, 1);
        absorb_kernel<scalar_t, true><<<blocks_for(items), kThreads, 0, stream>>>(out, batch, n, step);
      } else {
        absorb_kernel<scalar_t, false><<<blocks_for(n), kThreads, 0, stream>>>(out, batch, n, step);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } while (next < total);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gossip_ext, CUDA, m) {
  m.impl("scale_into", &scale_into_cuda);
  m.impl("absorb_", &absorb_cuda);
}

}  // namespace gossip
