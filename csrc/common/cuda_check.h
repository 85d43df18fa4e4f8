// Throwing checks for CUDA runtime and NCCL calls (CUDA builds only). Every cuda*/nccl* call goes
// through one of these: a failure throws with the expression, file:line and the library's own
// error string; nothing calls exit().
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <stdexcept>

#include "common/error.h"

#define GOSSIP_CUDA_CHECK(expr)                                                             \
  do {                                                                                      \
    const cudaError_t gossip_cuda_result = (expr);                                          \
    if (gossip_cuda_result != cudaSuccess) {                                                \
      throw std::runtime_error(::gossip::detail::str_cat(                                   \
          "gossip_ext: CUDA error in ", #expr, " at ", __FILE__, ":", __LINE__, ": ",       \
          cudaGetErrorString(gossip_cuda_result)));                                         \
    }                                                                                       \
  } while (0)

// The transport's communicator is blocking: ncclInProgress would be an error too.
#define GOSSIP_NCCL_CHECK(expr)                                                             \
  do {                                                                                      \
    const ncclResult_t gossip_nccl_result = (expr);                                         \
    if (gossip_nccl_result != ncclSuccess) {                                                \
      throw std::runtime_error(::gossip::detail::str_cat(                                   \
          "gossip_ext: NCCL error in ", #expr, " at ", __FILE__, ":", __LINE__, ": ",       \
          ncclGetErrorString(gossip_nccl_result)));                                         \
    }                                                                                       \
  } while (0)
