#pragma once
// oneDNN's matmul inside libtorch_cpu, under a chosen math mode.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>

namespace torch_tpu {

// out = beta * out + alpha * a @ b through oneDNN (2-D or batched 3-D fp32
// operands) with its fp32 math mode set to `mode` for this call: IEEE is
// exact fp32, BF16 multiplies operands as bf16 and accumulates in fp32.
void onednn_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta, float alpha,
                   at::Float32Precision mode);

} // namespace torch_tpu
