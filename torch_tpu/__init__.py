"""torch_tpu: the ``tpu`` device for PyTorch, emulated on host memory.

``import torch`` loads this package through the ``torch.backends`` entry
point, after which ``torch.device("tpu")`` and the ``torch.tpu`` module work.
"""


def _autoload() -> None:
    """Entry point for torch's device-backend autoload: importing did the work."""


# Defined before anything imports torch: `import torch_tpu` first imports
# torch, whose autoload resolves this package's `_autoload` while the package
# is still initializing.
from torch_tpu import _backend  # noqa: E402

_AVAILABLE = _backend.register()


def is_available() -> bool:
    """Whether the tpu device was registered (the compiled core loaded)."""
    return _AVAILABLE


__all__ = ["is_available"]
