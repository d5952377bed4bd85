"""Fused optimizers: applied inside the backward, in place, on the touched rows only.

No dense gradient of a table ever exists: the backward turns the pooled
gradient into one gradient per touched row and the optimizer updates those
rows and their state. Math is fp32 whatever the table's storage type.

Each optimizer is a frozen spec (plain data): its hyperparameters, the state
it keeps per physical row, and its code for the one parameterised update
kernel (sparsecore/csrc/Update.cpp). ``from_torch_optim``
accepts ``(torch.optim.SGD | Adagrad | Adam, kwargs)`` as TorchRec's
``apply_optimizer_in_backward`` does, refusing options that need dense updates.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from sparsecore.errors import ConfigError


def _require(spec: object, field: str, ok: bool, allowed: str) -> None:
    """Refuses a hyperparameter torch.optim would refuse, naming it, its value and what is allowed."""
    if not ok:
        raise ConfigError("*", f"{type(spec).__name__}.{field}", getattr(spec, field), allowed)


def _check_lr_eps(spec: object) -> None:
    _require(spec, "lr", spec.lr >= 0, "a learning rate >= 0")
    if hasattr(spec, "eps"):
        _require(spec, "eps", spec.eps >= 0, "an epsilon >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD:
    lr: float = 0.01
    """Learning rate, e.g. ``0.01``."""

    kernel_code = 0

    def __post_init__(self) -> None:
        _check_lr_eps(self)

    def state(self, rows: int, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {}

    def hyper(self, lr: float) -> list[float]:
        return [lr, 0.0, 0.0, 0.0, 0.0, 0.0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad:
    """torch.optim.Adagrad on the touched rows (no lr_decay or weight_decay)."""

    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    kernel_code = 1

    def __post_init__(self) -> None:
        _check_lr_eps(self)
        _require(self, "initial_accumulator_value", self.initial_accumulator_value >= 0, "a value >= 0")

    def state(self, rows: int, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"sum": ((rows, dim), self.initial_accumulator_value)}

    def hyper(self, lr: float) -> list[float]:
        return [lr, self.eps, 0.0, 0.0, 0.0, 0.0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, the mean of the squared gradient."""

    lr: float = 0.01
    eps: float = 1e-8

    kernel_code = 2

    def __post_init__(self) -> None:
        _check_lr_eps(self)

    def state(self, rows: int, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"momentum": ((rows,), 0.0)}

    def hyper(self, lr: float) -> list[float]:
        return [lr, self.eps, 0.0, 0.0, 0.0, 0.0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam:
    """Lazy Adam, as torch.optim.SparseAdam: moments of untouched rows do not decay."""

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    kernel_code = 3

    def __post_init__(self) -> None:
        _check_lr_eps(self)
        _require(self, "betas", len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
                 "two values in [0, 1)")

    def state(self, rows: int, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"exp_avg": ((rows, dim), 0.0), "exp_avg_sq": ((rows, dim), 0.0)}

    def hyper(self, lr: float) -> list[float]:
        return [lr, self.eps, self.betas[0], self.betas[1], 0.0, 0.0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FTRL:
    """FTRL-Proximal (McMahan et al.), as TensorFlow's Ftrl and jax-tpu-embedding's FTRL.

    Per element: accum' = accum + g^2; linear += g - (accum'^-p - accum^-p) / lr * w;
    w = (sign(linear) * l1 - linear) / ((accum'^-p + beta) / lr + 2 * l2) if |linear| > l1 else 0,
    with p = learning_rate_power.
    """

    lr: float = 0.01
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1

    kernel_code = 4

    def __post_init__(self) -> None:
        _require(self, "lr", self.lr > 0, "a learning rate > 0 (FTRL divides by it)")
        _require(self, "l1_regularization_strength", self.l1_regularization_strength >= 0, "a value >= 0")
        _require(self, "l2_regularization_strength", self.l2_regularization_strength >= 0, "a value >= 0")
        if self.learning_rate_power > 0:
            raise ConfigError("*", "FTRL.learning_rate_power", self.learning_rate_power, "a value <= 0")
        if self.initial_accumulator_value <= 0:
            raise ConfigError("*", "FTRL.initial_accumulator_value", self.initial_accumulator_value, "a positive value")

    def state(self, rows: int, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"accumulator": ((rows, dim), self.initial_accumulator_value), "linear": ((rows, dim), 0.0)}

    def hyper(self, lr: float) -> list[float]:
        return [lr, self.l1_regularization_strength, self.l2_regularization_strength, self.beta,
                self.learning_rate_power, 0.0]


Optimizer = SGD | Adagrad | RowWiseAdagrad | Adam | FTRL

# torch.optim options whose meaning needs a dense update of every row.
_DENSE_ONLY = {"momentum", "dampening", "nesterov", "weight_decay", "lr_decay", "amsgrad", "maximize",
               "capturable", "differentiable", "decoupled_weight_decay"}
_IGNORED = {"foreach", "fused"}


def from_torch_optim(optimizer: Any) -> Optimizer:
    """Our spec for a spec, or for ``(torch.optim.X, kwargs)``."""
    if isinstance(optimizer, (SGD, Adagrad, RowWiseAdagrad, Adam, FTRL)):
        return optimizer
    if not (isinstance(optimizer, tuple) and len(optimizer) == 2):
        raise ConfigError("*", "optimizer", optimizer, "a sparsecore.optim spec or (torch.optim.SGD|Adagrad|Adam, kwargs)")
    cls, kwargs = optimizer
    targets = {torch.optim.SGD: SGD, torch.optim.Adagrad: Adagrad, torch.optim.Adam: Adam}
    if cls not in targets:
        raise ConfigError("*", "optimizer", getattr(cls, "__name__", cls), "torch.optim.SGD, Adagrad or Adam")
    for key, value in kwargs.items():
        if key in _DENSE_ONLY and value not in (0, 0.0, False, None):
            raise ConfigError("*", f"{cls.__name__}.{key}", value, "its default: it needs dense updates of every row")
    allowed = {f.name for f in dataclasses.fields(targets[cls])}
    unknown = set(kwargs) - allowed - _DENSE_ONLY - _IGNORED
    if unknown:
        raise ConfigError("*", f"{cls.__name__} kwargs", sorted(unknown), f"a subset of {sorted(allowed)}")
    args = {k: (tuple(v) if k == "betas" else v) for k, v in kwargs.items() if k in allowed}
    # What the tuple leaves out is torch.optim's default, not ours (SGD's lr: 1e-3, not 0.01).
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name in allowed and name not in args and isinstance(parameter.default, (int, float, tuple)):
            args[name] = parameter.default
    return targets[cls](**args)
