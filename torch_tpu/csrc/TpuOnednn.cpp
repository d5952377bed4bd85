#include "TpuOnednn.h"

namespace at::native {
// Exported by libtorch_cpu (ATen/native/mkldnn/Matmul.h is not shipped).
TORCH_API void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result, float beta, float alpha);
} // namespace at::native

namespace torch_tpu {
namespace {

std::mutex& math_mode_mutex() {
  static std::mutex mu;
  return mu;
}

at::Float32Precision current_mode() {
  return at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL);
}

void set_mode(at::Float32Precision mode) {
  at::globalContext().setFloat32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL, mode);
}

} // namespace

OnednnMathMode::OnednnMathMode(at::Float32Precision mode)
    : lock_(math_mode_mutex()), previous_(current_mode()), switched_(previous_ != mode) {
  if (switched_) {
    set_mode(mode);
  }
}

OnednnMathMode::~OnednnMathMode() {
  if (switched_) {
    set_mode(previous_);
  }
}

bool onednn_math_is_inexact() {
  const at::Float32Precision mode = current_mode();
  return mode == at::Float32Precision::BF16 || mode == at::Float32Precision::TF32;
}

void onednn_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta, float alpha,
                   at::Float32Precision mode) {
  OnednnMathMode guard(mode);
  at::native::mkldnn_matmul(a, b, out, beta, alpha);
}

} // namespace torch_tpu
