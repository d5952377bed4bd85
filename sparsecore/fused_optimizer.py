"""The optimizer of fused tables as TorchRec sees it: a ``KeyedOptimizer``.

Updates happen inside the backward, so ``step()`` and ``zero_grad()`` do
nothing; what the object is for is the state (``state_dict`` /
``load_state_dict``, one entry per table under TorchRec's parameter keys) and
``param_groups``, whose ``lr`` the next backward reads, so standard LR
schedulers drive the fused update.

State lives in the stacks' physical (mod-sharded) layout; the entries here are
views that gather a table's rows in logical order on ``state_dict`` and
scatter them back on ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchrec.optim.keyed import KeyedOptimizer


class TableState:
    """One table's rows of one physical state tensor, in logical row order."""

    def __init__(self, tensor: torch.Tensor, rows: Callable[[], torch.Tensor]):
        self._tensor, self._rows = tensor, rows

    def state_dict(self) -> torch.Tensor:
        return self._tensor.index_select(0, self._rows()).cpu()

    def load_state_dict(self, value: torch.Tensor) -> None:
        rows = self._rows()
        if tuple(value.shape) != (rows.numel(), *self._tensor.shape[1:]):
            raise ValueError(f"optimizer state of shape {tuple(value.shape)} does not fit "
                             f"{(rows.numel(), *self._tensor.shape[1:])}")
        self._tensor.index_copy_(0, rows, value.to(self._tensor))


class StepCount:
    """A stack's optimizer step count (Adam's bias correction), saved per table."""

    def __init__(self, step: torch.Tensor):
        self._step = step

    def state_dict(self) -> torch.Tensor:
        return self._step[0].clone()

    def load_state_dict(self, value: torch.Tensor) -> None:
        self._step.fill_(int(value))


class _ParamGroup(dict):
    """A param group whose ``lr`` is mirrored into the kernels' hyperparameter tensor,
    so an LR scheduler's ``group["lr"] = x`` reaches the next fused update."""

    def __init__(self, lr_tensor: torch.Tensor, **entries):
        super().__init__(**entries)
        self._lr_tensor = lr_tensor

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        # Unpickling sets the items before the attributes: the tensor, pickled with
        # the group, already holds that lr.
        lr_tensor = self.__dict__.get("_lr_tensor")
        if key == "lr" and lr_tensor is not None:
            # Through .data: a lookup saved the tensor for its backward, and a version
            # bump would fail that backward. The backward reads the lr of its own time,
            # as a scheduler stepping between forward and backward expects.
            lr_tensor.data[0] = float(value)


class FusedOptimizer(KeyedOptimizer):
    """``module.fused_optimizer``: state and learning rate of the fused update."""

    def __init__(self, *, params: dict[str, torch.Tensor], state: dict, lr_tensor: torch.Tensor, hyper: dict,
                 before_state_access: Callable[[], None] = lambda: None):
        group = _ParamGroup(lr_tensor, params=list(params.values()), lr=float(lr_tensor[0]), **hyper)
        super().__init__(params=params, state=state, param_groups=[group])
        self._before_state_access = before_state_access  # waits for deferred updates

    def state_dict(self) -> dict:
        self._before_state_access()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._before_state_access()
        super().load_state_dict(state_dict)

    @property
    def lr(self) -> float:
        return float(next(iter(self.param_groups))["lr"])

    def step(self, closure=None):  # noqa: D102 - the update ran in the backward
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102 - no gradients exist
        return None
