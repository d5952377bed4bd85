#include "TpuOnednn.h"

#include <mutex>

namespace at::native {
// Exported by libtorch_cpu (ATen/native/mkldnn/Matmul.h is not shipped).
TORCH_API void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result, float beta, float alpha);
} // namespace at::native

namespace torch_tpu {

void onednn_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta, float alpha,
                   at::Float32Precision mode) {
  // ATen reads the math mode, a process-wide setting, when it builds the
  // primitive: set it for this call only, one call at a time.
  static std::mutex mu;
  using at::Float32Backend, at::Float32Op;
  auto& ctx = at::globalContext();
  std::lock_guard<std::mutex> lock(mu);
  const at::Float32Precision previous = ctx.float32Precision(Float32Backend::MKLDNN, Float32Op::MATMUL);
  if (previous == mode) {
    at::native::mkldnn_matmul(a, b, out, beta, alpha);
    return;
  }
  ctx.setFloat32Precision(Float32Backend::MKLDNN, Float32Op::MATMUL, mode);
  try {
    at::native::mkldnn_matmul(a, b, out, beta, alpha);
  } catch (...) {
    ctx.setFloat32Precision(Float32Backend::MKLDNN, Float32Op::MATMUL, previous);
    throw;
  }
  ctx.setFloat32Precision(Float32Backend::MKLDNN, Float32Op::MATMUL, previous);
}

} // namespace torch_tpu
