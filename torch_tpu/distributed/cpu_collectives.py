"""The collectives shared memory never carries, on cpu tensors of a ``tpu_dist`` group.

The core's kernel for collectives on tpu tensors (``TpuCollectives.cpp``,
registered for the PrivateUse1 key of every ``c10d`` op) builds
``PREMUL_SUM`` from SUM, which gloo lacks, and records the async works gloo
takes, so that a later collective over the group's shared memory waits for
them (a group's collectives complete in issue order, as on gloo). The same
call on cpu tensors reached torch's CPU kernel, gloo directly: its
``PREMUL_SUM`` was refused and its works were not waited for. Only the
carried collectives have a CPU kernel of the core's own, so the others are
sent here, from their BackendSelect key, to the tpu kernel: it passes cpu
tensors through unchanged and calls the CPU kernel after doing both.
Groups of other backends keep torch's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Their own CPU kernels in the core already lower PREMUL_SUM and record gloo's works.
_CARRIED = frozenset({"allreduce_", "broadcast_", "_allgather_base_", "_reduce_scatter_base_", "alltoall_base_"})
# Not in a group's order (a send completes when its peer receives) and never reduce: torch's path.
_POINT_TO_POINT = frozenset({"send", "recv_", "recv_any_source_"})

_AFTER_BACKEND_SELECT = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_TPU_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)

_library: torch.library.Library | None = None


def _is_tpu_dist(boxed_group: torch.ScriptObject) -> bool:
    try:
        return dist.get_backend(dist.ProcessGroup.unbox(boxed_group)) == "tpu_dist"  # backend.BACKEND
    except (ValueError, RuntimeError):  # a group torch's registry does not know
        return False


def _kernel(op: torch._ops.OpOverload, group_index: int) -> Callable[..., Any]:
    """The BackendSelect kernel of ``op``: dense cpu calls on tpu_dist groups take the tpu kernel."""
    def kernel(keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        below = keyset & _AFTER_BACKEND_SELECT
        if below.highestPriorityTypeId() == torch._C.DispatchKey.CPU and _is_tpu_dist(args[group_index]):
            # PREMUL_SUM's scaling writes the caller's tensors; it is not differentiated. Grad
            # mode off, not ADInplaceOrView: the copies gloo makes into the outputs (list
            # all_gather, gather, all_to_all...) must bump their versions as on torch's path, or
            # autograd misses a saved tensor a collective overwrote and computes wrong gradients.
            # Inference tensors keep no versions, and ADInplaceOrView refuses their scaling
            # outside inference mode: below it for them.
            below_views = _has_inference_tensor(args) and not torch.is_inference_mode_enabled()
            with torch._C._AutoDispatchBelowADInplaceOrView() if below_views else torch.no_grad():
                return op.redispatch(_TPU_KERNEL, *args)
        return op.redispatch(below, *args)

    return kernel


def _has_inference_tensor(args: tuple) -> bool:
    """Whether a tensor of the arguments (c10d nests them in lists twice at most) is an inference tensor."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_inference():
                return True
        elif isinstance(a, (list, tuple)) and _has_inference_tensor(a):
            return True
    return False


def _uncarried_collectives() -> dict[str, int]:
    """The c10d collectives shared memory does not carry: name -> index of the process_group argument."""
    ops = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace != "c10d" or name in _CARRIED or name in _POINT_TO_POINT:
            continue
        arguments = [a.name for a in getattr(torch.ops.c10d, name).default._schema.arguments]
        if "process_group" in arguments:
            ops[name] = arguments.index("process_group")
    return ops


def register() -> None:
    """Routes the uncarried collectives on cpu tensors of tpu_dist groups (once per process)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("c10d", "IMPL")
    for name, group_index in _uncarried_collectives().items():
        op = getattr(torch.ops.c10d, name).default
        library.impl(name, _kernel(op, group_index), "BackendSelect", with_keyset=True)
    _library = library
