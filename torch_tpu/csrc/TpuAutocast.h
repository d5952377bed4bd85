#pragma once

namespace torch_tpu {

// torch.autocast("tpu") without dtype= takes bf16, the TPU's lower precision
// (PyTorch's default for a PrivateUse1 backend is fp16). The setting is per
// thread, as every autocast setting: made for the thread that loads the
// backend and for the backend's worker threads; a stream task inherits its
// submitter's.
void use_bf16_autocast_on_this_thread();

} // namespace torch_tpu
