"""The materialization-hook registry of DeferAndFuse.

Code that reads tpu memory without an aten op - serialization, raw pointers,
printing (which runs with dispatch modes off) - never reaches the recording
dispatch mode, so while DeferAndFuse is on such functions and methods are
wrapped to run the pending graph first. torch_tpu registers its own below;
an extension registers its entry points with ``register_materialization_hook``.
Methods of ``torch.Tensor`` materialize only for a tensor whose memory the
pending graph has yet to write: other threads (a background compile) call
them too.

``Tensor.data``'s setter swaps a tensor's storage without an aten op: a
pending graph that reads the tensor would read the new storage, and a pending
value assigned would be reachable through a tensor the graph does not know.
While DeferAndFuse is on, the setter materializes when either side is
involved in the pending graph (read, written or pending), as Strict would
have computed both by then.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

_hooks: list[tuple[Any, str]] = [
    (torch, "save"),
    (torch.Tensor, "data_ptr"),
    (torch.Tensor, "untyped_storage"),
    (torch.Tensor, "numpy"),
    (torch._tensor_str, "_str"),
]
_originals: dict[tuple[int, str], Callable] = {}
# While installed: (materialize(reason), touches(tensor) -> bool, involves(tensor) -> bool).
_active: tuple[Callable[[str], None], Callable[[torch.Tensor], bool], Callable[[torch.Tensor], bool]] | None = None
_DATA = "Tensor.data (set)"


def register_materialization_hook(owner: Any, name: str) -> None:
    """Makes ``owner.name`` (a function or method) materialize the pending graph
    before it runs while DeferAndFuse is on."""
    _hooks.append((owner, name))
    if _active is not None:
        _install(owner, name)


def install(materialize: Callable[[str], None], touches: Callable[[torch.Tensor], bool],
            involves: Callable[[torch.Tensor], bool] | None = None) -> None:
    """``touches``: whether a tensor's memory is pending or has a pending write;
    ``involves``: that, or the pending graph reads it (default: ``touches``)."""
    global _active
    _active = (materialize, touches, involves or touches)
    for owner, name in _hooks:
        _install(owner, name)
    _install_data_setter()


def uninstall() -> None:
    global _active
    _active = None
    for owner, name in _hooks:
        original = _originals.pop((id(owner), name), None)
        if original is not None:
            setattr(owner, name, original)
    if _originals.pop((id(torch.Tensor), "data"), None) is not None:
        del torch.Tensor.data  # torch.Tensor had none of its own: TensorBase's shows again


def _install_data_setter() -> None:
    """``Tensor.data = value`` materializes first when the pending graph involves either
    side (see the module docstring); the getter stays TensorBase's C one."""
    key = (id(torch.Tensor), "data")
    if key in _originals or "data" in vars(torch.Tensor):
        return
    original = torch._C.TensorBase.data
    _originals[key] = original

    def set_data(self, value):
        active = _active
        if active is not None:
            # The checks are DeferAndFuse's own: a subclass's __torch_function__ sees the
            # assignment only, as in Strict, not the get_device and storage calls they make.
            with torch._C.DisableTorchFunctionSubclass():
                involved = active[2](self) or (isinstance(value, torch.Tensor) and active[2](value))
            if involved:
                active[0](_DATA)
        original.__set__(self, value)

    torch.Tensor.data = property(original.__get__, set_data, None, original.__doc__)


def wrapper_codes() -> list[types.CodeType]:
    """The code of the wrappers ``_install`` makes (for torch_tpu.defer to keep Dynamo out of them)."""
    return [c for f in (_install, _install_data_setter) for c in f.__code__.co_consts if isinstance(c, types.CodeType)]


def _install(owner: Any, name: str) -> None:
    key = (id(owner), name)
    if key in _originals:
        return
    original = getattr(owner, name)
    _originals[key] = original
    where = f"{getattr(owner, '__name__', owner)}.{name}"

    if owner is torch.Tensor:
        def materialized(self, *args, **kwargs):
            active = _active
            if active is not None and active[1](self):
                active[0](where)
            return original(self, *args, **kwargs)
    else:
        def materialized(*args, **kwargs):
            active = _active
            if active is not None:
                active[0](where)
            return original(*args, **kwargs)

    materialized.__wrapped__ = original
    setattr(owner, name, materialized)
