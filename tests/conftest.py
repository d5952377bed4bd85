"""Test configuration: two emulated devices, exact fp32 by default.

Set before torch is imported, so the autoloaded backend sees it.
"""

import os

os.environ.setdefault("TORCH_TPU_NUM_DEVICES", "2")

import pytest  # noqa: E402
import torch  # noqa: E402

assert torch.tpu.is_available(), "the tpu device did not load: run `make setup`"


@pytest.fixture(autouse=True)
def exact_fp32():
    """Tests compare with CPU PyTorch at exact fp32 unless they test precision."""
    with torch.tpu.precision("highest"):
        yield
