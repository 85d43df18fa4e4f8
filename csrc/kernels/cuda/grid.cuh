// The grid of a grid-stride kernel: enough thread blocks to fill every SM of the current device
// once at full occupancy, fewer where the work is smaller. Each thread then strides over several
// passes and pays its set-up (the push-sum weights' loads and divisions) once.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

namespace gossip {

// Threads a device's SMs hold at once; asked of the driver once per device (ATen's CUDAContext.h,
// which caches the whole cudaDeviceProp, includes cuSPARSE's and cuBLAS's headers, which a
// toolkit need not have).
inline int64_t resident_threads(c10::DeviceIndex device) {
  static std::array<std::atomic<int64_t>, 64> cache{};
  std::atomic<int64_t>& slot = cache.at(static_cast<size_t>(device));
  int64_t threads = slot.load(std::memory_order_relaxed);
  if (threads == 0) {
    int sms = 0;
    int per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    threads = static_cast<int64_t>(sms) * per_sm;
    slot.store(threads, std::memory_order_relaxed);  // every writer stores the same value
  }
  return threads;
}

// Blocks of `threads_per_block` for `items` work items of one thread each, at most one full GPU.
inline int grid_stride_blocks(int64_t items, int threads_per_block) {
  const int64_t full = resident_threads(c10::cuda::current_device()) / threads_per_block;
  const int64_t needed = (items + threads_per_block - 1) / threads_per_block;
  return static_cast<int>(std::clamp<int64_t>(needed, 1, std::max<int64_t>(full, 1)));
}

}  // namespace gossip
