#pragma once
// oneDNN's matmul inside libtorch_cpu, under a chosen math mode.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>

#include <mutex>

namespace torch_tpu {

// CPU oneDNN's fp32 matmul math mode, a process-wide setting that ATen reads
// when it builds a primitive, set to `mode` while the guard lives and then
// restored; guards are taken one at a time.
class OnednnMathMode {
 public:
  explicit OnednnMathMode(at::Float32Precision mode);
  ~OnednnMathMode();
  OnednnMathMode(const OnednnMathMode&) = delete;
  OnednnMathMode& operator=(const OnednnMathMode&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;
  at::Float32Precision previous_;
  bool switched_;
};

// Whether the user's setting lets ATen's fp32 matmuls lose precision through
// oneDNN (`torch.set_float32_matmul_precision("medium")` or
// `torch.backends.mkldnn.matmul.fp32_precision = "bf16"` / "tf32").
bool onednn_math_is_inexact();

// out = beta * out + alpha * a @ b through oneDNN (2-D or batched 3-D fp32
// operands) under `mode`: IEEE is exact fp32, BF16 multiplies operands as
// bf16 and accumulates in fp32.
void onednn_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta, float alpha,
                   at::Float32Precision mode);

} // namespace torch_tpu
