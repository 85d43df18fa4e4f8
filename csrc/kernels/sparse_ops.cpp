// The schemas of the sparse top-k ops, their argument checks and their Meta kernels (Note [Sparse
// top-k messages] in sparse_topk.h). One implementation per backend beside this file:
// cpu/sparse_topk_cpu.cpp, cuda/sparse_topk_cuda.cu.
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include "kernels/sparse_topk.h"

namespace gossip {
namespace {

void check_format(int64_t k, int64_t bits, int64_t chunk) {
  TORCH_CHECK_VALUE(bits == 2 || bits == 4, "gossip_ext: bits must be 2 or 4, got ", bits);
  TORCH_CHECK_VALUE(chunk >= 1 && chunk <= kTopKMaxChunk, "gossip_ext: chunk must be in [1, ",
                    kTopKMaxChunk, "] (positions travel as int16), got ", chunk);
  TORCH_CHECK_VALUE(k >= 1 && k <= chunk, "gossip_ext: k must be in [1, chunk=", chunk, "], got ",
                    k);
}

void check_floating(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                   "gossip_ext: ", arg, " must be float32 or float64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), "gossip_ext: ", arg, " must be contiguous");
}

// Bytes of the message of `numel` values, in SymInts: the Meta kernels also see symbolic sizes.
c10::SymInt message_bytes(const c10::SymInt& numel, int64_t k, int64_t bits, int64_t chunk) {
  const c10::SymInt chunks = (numel + chunk - 1) / chunk;
  return chunks * (4 + 2 * k) + (chunks * (k * bits) + 7) / 8;
}

}  // namespace

void check_topk_encode_args(const at::Tensor& values, int64_t k, int64_t bits, int64_t chunk) {
  check_format(k, bits, chunk);
  check_floating(values, "values");
}

void check_topk_add_into_args(const at::Tensor& total, const at::Tensor& message, int64_t k,
                              int64_t bits, int64_t chunk) {
  check_format(k, bits, chunk);
  check_floating(total, "total");
  const c10::SymInt numel = total.sym_numel();
  TORCH_CHECK_VALUE(numel % chunk == 0, "gossip_ext: total has ", numel,
                    " values, not a whole number of chunks of chunk=", chunk);
  TORCH_CHECK_TYPE(message.scalar_type() == at::kByte, "gossip_ext: message must be a uint8 ",
                   "tensor (a top-k message), got ", message.scalar_type());
  TORCH_CHECK_VALUE(message.is_contiguous(), "gossip_ext: message must be contiguous");
  const c10::SymInt bytes = message_bytes(numel, k, bits, chunk);
  TORCH_CHECK_VALUE(message.sym_numel() == bytes, "gossip_ext: message has ", message.sym_numel(),
                    " bytes but a message of ", numel / chunk, " chunks of k=", k,
                    " codes of bits=", bits, " has ", bytes);
  TORCH_CHECK_VALUE(message.device() == total.device(), "gossip_ext: message is on ",
                    message.device(), " but total is on ", total.device());
}

TORCH_LIBRARY_FRAGMENT(gossip_ext, m) {
  m.def("topk_encode(Tensor values, int k, int bits, int chunk) -> Tensor");
  m.def("topk_add_into(Tensor(a!) total, Tensor message, int k, int bits, int chunk) -> ()");
}

TORCH_LIBRARY_IMPL(gossip_ext, Meta, m) {
  m.impl("topk_encode",
         [](const at::Tensor& values, int64_t k, int64_t bits, int64_t chunk) -> at::Tensor {
           check_topk_encode_args(values, k, bits, chunk);
           return at::empty_symint({message_bytes(values.sym_numel(), k, bits, chunk)},
                                   values.options().dtype(at::kByte));
         });
  m.impl("topk_add_into", [](const at::Tensor& total, const at::Tensor& message, int64_t k,
                             int64_t bits, int64_t chunk) {
    check_topk_add_into_args(total, message, k, bits, chunk);
  });
}

}  // namespace gossip
