"""Loading the compiled core and registering the ``tpu`` device with torch.

Runs when torch_tpu is imported, which ``import torch`` does through the
``torch.backends`` entry point. It must never raise: torch imports every such
entry point and a failure here would break ``import torch`` itself. On failure
it warns and leaves torch usable without the device.
"""

from __future__ import annotations

import ctypes
import logging
import warnings
from pathlib import Path

from torch_tpu import chips

logger = logging.getLogger(__name__)

_LIBRARY = Path(__file__).with_name("_core.so")

topology: chips.Topology | None = None
library: ctypes.CDLL | None = None


def _register() -> None:
    global topology, library
    import torch

    if not _LIBRARY.exists():
        raise RuntimeError(f"the compiled core {_LIBRARY} is missing; run `make setup`")
    topology = chips.topology_from_env()
    torch.ops.load_library(str(_LIBRARY))
    library = ctypes.CDLL(str(_LIBRARY))
    torch.ops.torch_tpu._configure(topology.num_devices, topology.hbm_bytes)

    torch.utils.rename_privateuse1_backend("tpu")
    from torch_tpu import tpu as device_module

    torch._register_device_module("tpu", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    from torch_tpu.distributed import backend as distributed_backend

    distributed_backend.register()
    logger.debug("tpu device registered: %s", topology)


def register() -> bool:
    """Registers the device once; returns whether it is available."""
    if topology is not None:
        return True
    try:
        _register()
        return True
    except Exception as error:  # noqa: BLE001 - see module docstring
        warnings.warn(f"torch_tpu: the tpu device is unavailable: {error}", RuntimeWarning, stacklevel=2)
        return False
