// torch.autocast("tpu"): matmul-family ops in the lower precision (bf16 by
// default), the fp32 list in fp32, everything else untouched.

#include "TpuAutocast.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace torch_tpu {

void use_bf16_autocast_on_this_thread() {
  at::autocast::set_autocast_dtype(at::kPrivateUse1, at::kBFloat16);
}

namespace {

const bool kLoadingThreadDefault = (use_bf16_autocast_on_this_thread(), true);

using at::autocast::CastPolicy;

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TPU_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_LOWER_PRECISION_FP(TPU_LOWER)
  AT_FORALL_FP32(TPU_FP32)
#undef TPU_LOWER
#undef TPU_FP32
}

} // namespace
} // namespace torch_tpu
