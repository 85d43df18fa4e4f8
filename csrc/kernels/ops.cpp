// The op schemas of the gossip_ext library, their argument checks and their Meta kernels.
// One implementation per backend lives beside this file: push_sum_cpu.cpp, cuda/push_sum_cuda.cu.
#include <string>

#include <c10/core/ScalarType.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels/push_sum.h"

namespace gossip {
namespace {

bool is_supported_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
         dtype == at::kBFloat16;
}

void check_buffer(const at::Tensor& t, const std::string& arg, const at::Tensor& like) {
  TORCH_CHECK_TYPE(is_supported_dtype(t.scalar_type()), "gossip_ext: ", arg,
                   " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), "gossip_ext: ", arg, " must be contiguous");
  TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type(), "gossip_ext: ", arg, " has dtype ",
                    t.scalar_type(), " but expected ", like.scalar_type());
  // sym_numel: the Meta kernels also run on fake tensors with symbolic sizes (torch.compile).
  TORCH_CHECK_VALUE(t.sym_numel() == like.sym_numel(), "gossip_ext: ", arg, " has ",
                    t.sym_numel(), " elements but expected ", like.sym_numel());
  TORCH_CHECK_VALUE(t.device() == like.device(), "gossip_ext: ", arg, " is on ", t.device(),
                    " but expected ", like.device());
}

bool is_message_dtype_for(at::ScalarType message, at::ScalarType state) {
  return message == state || ((message == at::kHalf || message == at::kBFloat16) &&
                              (state == at::kFloat || state == at::kDouble));
}

// A message buffer: the state's dtype, or a 16-bit dtype standing in for float32/float64.
// `message_dtype` is the dtype every message of the call must share.
void check_message(const at::Tensor& t, const std::string& arg, const at::Tensor& state,
                   at::ScalarType message_dtype) {
  const bool state_is_wide = state.scalar_type() == at::kFloat || state.scalar_type() == at::kDouble;
  TORCH_CHECK_VALUE(is_message_dtype_for(t.scalar_type(), state.scalar_type()), "gossip_ext: ",
                    arg, " has dtype ", t.scalar_type(), " but expected ", state.scalar_type(),
                    state_is_wide ? " (or a float16 or bfloat16 message)" : "");
  TORCH_CHECK_VALUE(t.scalar_type() == message_dtype, "gossip_ext: ", arg, " has dtype ",
                    t.scalar_type(), " but the other messages have ", message_dtype);
  TORCH_CHECK_VALUE(t.is_contiguous(), "gossip_ext: ", arg, " must be contiguous");
  TORCH_CHECK_VALUE(t.sym_numel() == state.sym_numel(), "gossip_ext: ", arg, " has ",
                    t.sym_numel(), " elements but expected ", state.sym_numel());
  TORCH_CHECK_VALUE(t.device() == state.device(), "gossip_ext: ", arg, " is on ", t.device(),
                    " but expected ", state.device());
}

void check_weight(const std::optional<at::Tensor>& weight, const char* arg,
                  const at::Tensor& like) {
  if (!weight.has_value()) return;
  const at::Tensor& w = *weight;
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble,
                   "gossip_ext: ", arg, " must be float32 or float64, got ", w.scalar_type());
  TORCH_CHECK_VALUE(w.sym_numel() == 1, "gossip_ext: ", arg, " must have one element, got ",
                    w.sym_numel());
  TORCH_CHECK_VALUE(w.device() == like.device(), "gossip_ext: ", arg, " is on ", w.device(),
                    " but the buffers are on ", like.device());
}

// A quantized message: uint8, contiguous, exactly the bytes of `numel` values in `format`.
void check_quantized_message(const at::Tensor& t, const std::string& arg, const at::Tensor& state,
                             BlockFormat format) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte, "gossip_ext: ", arg,
                   " must be a uint8 tensor (a quantized message), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), "gossip_ext: ", arg, " must be contiguous");
  // quant_message_bytes in SymInts: the Meta kernels also see symbolic sizes (torch.compile).
  const c10::SymInt numel = state.sym_numel();
  const c10::SymInt payload = format == BlockFormat::kInt4 ? (numel + 1) / 2 : numel;
  const c10::SymInt bytes =
      (numel + kQuantBlock - 1) / kQuantBlock * static_cast<int64_t>(sizeof(float)) + payload;
  TORCH_CHECK_VALUE(t.sym_numel() == bytes, "gossip_ext: ", arg, " has ", t.sym_numel(),
                    " bytes but a ", block_format_name(format), " message of ", numel,
                    " values has ", bytes);
  TORCH_CHECK_VALUE(t.device() == state.device(), "gossip_ext: ", arg, " is on ", t.device(),
                    " but expected ", state.device());
}

void check_wide_state(const at::Tensor& t, const char* arg) {
  check_buffer(t, arg, t);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                   "gossip_ext: ", arg,
                   " must be float32 or float64 to travel in a quantized message, got ",
                   t.scalar_type());
}

void check_nonfinite_flag(const std::optional<at::Tensor>& nonfinite, const at::Tensor& x) {
  if (!nonfinite.has_value()) return;
  const at::Tensor& flag = *nonfinite;
  TORCH_CHECK_TYPE(flag.scalar_type() == at::kInt, "gossip_ext: nonfinite must be int32, got ",
                   flag.scalar_type());
  TORCH_CHECK_VALUE(flag.sym_numel() == 1, "gossip_ext: nonfinite must have one element, got ",
                    flag.sym_numel());
  TORCH_CHECK_VALUE(flag.device() == x.device(), "gossip_ext: nonfinite is on ", flag.device(),
                    " but the buffers are on ", x.device());
}

}  // namespace

BlockFormat parse_block_format(const std::string& format, const char* arg) {
  if (format == "int8") return BlockFormat::kInt8;
  if (format == "int4") return BlockFormat::kInt4;
  if (format == "float8_e4m3fn") return BlockFormat::kFloat8E4M3;
  TORCH_CHECK_VALUE(false, "gossip_ext: ", arg,
                    " must be 'int8', 'int4' or 'float8_e4m3fn' (a block-quantized message), got '",
                    format, "'");
}

const char* block_format_name(BlockFormat format) {
  switch (format) {
    case BlockFormat::kInt8:
      return "int8";
    case BlockFormat::kInt4:
      return "int4";
    default:
      return "float8_e4m3fn";
  }
}

int64_t quantized_message_bytes(int64_t numel, const std::string& format) {
  TORCH_CHECK_VALUE(numel >= 0, "gossip_ext: numel must be >= 0, got ", numel);
  // Scales and codes together take at most 1.04 bytes a value: 2^62 values keep it in an int64.
  constexpr int64_t kMaxNumel = int64_t{1} << 62;
  TORCH_CHECK_VALUE(numel <= kMaxNumel, "gossip_ext: numel must be <= 2^62, got ", numel);
  return quant_message_bytes(numel, parse_block_format(format));
}

void check_quantize_into_args(const at::Tensor& src, const at::Tensor& out,
                              const std::string& format, const std::optional<at::Tensor>& weight) {
  check_wide_state(src, "src");
  check_quantized_message(out, "out", src, parse_block_format(format));
  check_weight(weight, "weight", src);
}

void check_absorb_quantized_args(const at::Tensor& x, at::TensorList received,
                                 const std::string& format,
                                 const std::optional<at::Tensor>& self_weight,
                                 const std::optional<at::Tensor>& new_weight,
                                 const std::optional<at::Tensor>& nonfinite,
                                 const std::optional<at::Tensor>& sent) {
  check_wide_state(x, "x");
  const BlockFormat block_format = parse_block_format(format);
  for (size_t i = 0; i < received.size(); ++i) {
    check_quantized_message(received[i], "received[" + std::to_string(i) + "]", x, block_format);
  }
  if (sent.has_value()) check_quantized_message(*sent, "sent", x, block_format);
  check_weight(self_weight, "self_weight", x);
  check_weight(new_weight, "new_weight", x);
  check_nonfinite_flag(nonfinite, x);
}

void check_scale_into_args(const at::Tensor& src, const at::Tensor& out,
                           const std::optional<at::Tensor>& weight) {
  check_buffer(src, "src", src);
  check_buffer(out, "out", src);
  check_weight(weight, "weight", src);
}

void check_compress_into_args(const at::Tensor& src, const at::Tensor& out,
                              const std::optional<at::Tensor>& weight) {
  check_buffer(src, "src", src);
  TORCH_CHECK_TYPE(out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16,
                   "gossip_ext: out must be float16 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK_TYPE(src.scalar_type() == at::kFloat || src.scalar_type() == at::kDouble,
                   "gossip_ext: src must be float32 or float64 to be compressed, got ",
                   src.scalar_type());
  check_message(out, "out", src, out.scalar_type());
  check_weight(weight, "weight", src);
}

void check_absorb_args(const at::Tensor& x, at::TensorList received,
                       const std::optional<at::Tensor>& self_weight,
                       const std::optional<at::Tensor>& new_weight,
                       const std::optional<at::Tensor>& nonfinite,
                       const std::optional<at::Tensor>& sent) {
  check_buffer(x, "x", x);
  const at::ScalarType message = absorb_message_dtype(x, received, sent);
  for (size_t i = 0; i < received.size(); ++i) {
    check_message(received[i], "received[" + std::to_string(i) + "]", x, message);
  }
  if (sent.has_value()) check_message(*sent, "sent", x, message);
  check_weight(self_weight, "self_weight", x);
  check_weight(new_weight, "new_weight", x);
  check_nonfinite_flag(nonfinite, x);
}

at::ScalarType absorb_message_dtype(const at::Tensor& x, at::TensorList received,
                                    const std::optional<at::Tensor>& sent) {
  if (!received.empty()) return received[0].scalar_type();
  return sent.has_value() ? sent->scalar_type() : x.scalar_type();
}

namespace ops {

void scale_into(const at::Tensor& src, const at::Tensor& out, double alpha,
                const std::optional<at::Tensor>& weight) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gossip_ext::scale_into", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, double,
                                   const std::optional<at::Tensor>&)>();
  op.call(src, out, alpha, weight);
}

void compress_into_(const at::Tensor& src, const at::Tensor& out, double alpha,
                    const std::optional<at::Tensor>& weight, double feedback) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gossip_ext::compress_into_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, double,
                                   const std::optional<at::Tensor>&, double)>();
  op.call(src, out, alpha, weight, feedback);
}

void absorb_(const at::Tensor& x, at::TensorList received, double alpha,
             const std::optional<at::Tensor>& self_weight,
             const std::optional<at::Tensor>& new_weight,
             const std::optional<at::Tensor>& nonfinite, const std::optional<at::Tensor>& sent,
             double sent_scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gossip_ext::absorb_", "")
                       .typed<void(const at::Tensor&, at::TensorList, double,
                                   const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, double)>();
  op.call(x, received, alpha, self_weight, new_weight, nonfinite, sent, sent_scale);
}

void quantize_into_(const at::Tensor& src, const at::Tensor& out, const std::string& format,
                    double alpha, const std::optional<at::Tensor>& weight, double feedback) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gossip_ext::quantize_into_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, c10::string_view, double,
                                   const std::optional<at::Tensor>&, double)>();
  op.call(src, out, format, alpha, weight, feedback);
}

void absorb_quantized_(const at::Tensor& x, at::TensorList received, const std::string& format,
                       double alpha, const std::optional<at::Tensor>& self_weight,
                       const std::optional<at::Tensor>& new_weight,
                       const std::optional<at::Tensor>& nonfinite,
                       const std::optional<at::Tensor>& sent, double sent_scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gossip_ext::absorb_quantized_", "")
                       .typed<void(const at::Tensor&, at::TensorList, c10::string_view, double,
                                   const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, double)>();
  op.call(x, received, format, alpha, self_weight, new_weight, nonfinite, sent, sent_scale);
}

}  // namespace ops

TORCH_LIBRARY(gossip_ext, m) {
  m.def("scale_into(Tensor src, Tensor(a!) out, float alpha, Tensor? weight=None) -> ()");
  m.def(
      "compress_into_(Tensor(a!) src, Tensor(b!) out, float alpha, Tensor? weight=None, "
      "float feedback=0.) -> ()");
  m.def(
      "absorb_(Tensor(a!) x, Tensor[] received, float alpha, Tensor? self_weight=None, "
      "Tensor? new_weight=None, Tensor(b!)? nonfinite=None, Tensor? sent=None, "
      "float sent_scale=0.) -> ()");
  m.def(
      "quantize_into_(Tensor(a!) src, Tensor(b!) out, str format, float alpha, "
      "Tensor? weight=None, float feedback=0.) -> ()");
  m.def(
      "absorb_quantized_(Tensor(a!) x, Tensor[] received, str format, float alpha, "
      "Tensor? self_weight=None, Tensor? new_weight=None, Tensor(b!)? nonfinite=None, "
      "Tensor? sent=None, float sent_scale=0.) -> ()");
}

// Fake-tensor kernels: the ops return nothing and mutate in place, so checking is all there is.
TORCH_LIBRARY_IMPL(gossip_ext, Meta, m) {
  m.impl("scale_into", [](const at::Tensor& src, const at::Tensor& out, double,
                          const std::optional<at::Tensor>& weight) {
    check_scale_into_args(src, out, weight);
  });
  m.impl("compress_into_", [](const at::Tensor& src, const at::Tensor& out, double,
                              const std::optional<at::Tensor>& weight, double) {
    check_compress_into_args(src, out, weight);
  });
  m.impl("absorb_", [](const at::Tensor& x, at::TensorList received, double,
                       const std::optional<at::Tensor>& self_weight,
                       const std::optional<at::Tensor>& new_weight,
                       const std::optional<at::Tensor>& nonfinite,
                       const std::optional<at::Tensor>& sent, double) {
    check_absorb_args(x, received, self_weight, new_weight, nonfinite, sent);
  });
  m.impl("quantize_into_", [](const at::Tensor& src, const at::Tensor& out,
                              c10::string_view format, double,
                              const std::optional<at::Tensor>& weight, double) {
    check_quantize_into_args(src, out, std::string(format), weight);
  });
  m.impl("absorb_quantized_", [](const at::Tensor& x, at::TensorList received,
                                 c10::string_view format, double,
                                 const std::optional<at::Tensor>& self_weight,
                                 const std::optional<at::Tensor>& new_weight,
                                 const std::optional<at::Tensor>& nonfinite,
                                 const std::optional<at::Tensor>& sent, double) {
    check_absorb_quantized_args(x, received, std::string(format), self_weight, new_weight,
                                nonfinite, sent);
  });
}

}  // namespace gossip
