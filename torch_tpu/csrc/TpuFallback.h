#pragma once
// The boxed fallback (TpuFallback.cpp) and the routing of composite ops to
// their CPU kernels, which must run after every kernel of this library is
// registered: torch.ops.torch_tpu._configure calls it at load.

namespace torch_tpu {

void route_composites_to_cpu();

} // namespace torch_tpu
