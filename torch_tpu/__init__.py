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


from torch_tpu.debug import get_nan_check, set_nan_check  # noqa: E402
from torch_tpu.eager import EagerMode, eager_mode, get_eager_mode, set_eager_mode  # noqa: E402
from torch_tpu import rnn_cells  # noqa: E402,F401 - the fused LSTM/GRU cells nn.LSTM and nn.GRU call on tpu

if _AVAILABLE:
    try:
        get_eager_mode()  # reads the environment now: Debug's checks start on the importing thread
    except ValueError as _error:  # import torch must not fail: said again at first use
        import warnings

        warnings.warn(f"torch_tpu: {_error}", RuntimeWarning, stacklevel=2)


def __getattr__(name: str):
    # Loaded on first use: the export stack (torch.export) is not needed to run models.
    if name in ("export_stablehlo", "stablehlo"):
        import importlib

        stablehlo = importlib.import_module("torch_tpu.stablehlo")
        return stablehlo if name == "stablehlo" else stablehlo.export_stablehlo
    raise AttributeError(f"module 'torch_tpu' has no attribute {name!r}")


__all__ = ["EagerMode", "eager_mode", "export_stablehlo", "get_eager_mode", "get_nan_check", "is_available",
           "set_eager_mode", "set_nan_check"]
