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
    _backward_on_calling_thread()
    logger.debug("tpu device registered: %s", topology)


def _backward_on_calling_thread() -> None:
    """The importing thread's backward passes run on that thread, as CPU ones do, not on
    autograd's tpu device thread. The tpu kernels are host kernels: OpenMP parallel
    regions started from a second thread give it a thread pool of its own, and once libgomp
    manages more threads than there are CPUs it stops spinning between regions for good, so
    every small parallel op in the process then waits for its workers to wake (a 256x256
    matmul 57% slower, an add 8x). Other threads that call backward keep autograd's default
    (``torch.autograd.set_multithreading_enabled``)."""
    import torch

    torch._C._set_multithreading_enabled(False)


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
