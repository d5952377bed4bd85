"""What the OpInfo conformance run leaves out, and why.

Whole ops (random, sparse-only, CUDA-only), ops run forward only, samples of
otherwise deterministic ops, sample tensors kept on CPU, and ops whose output
values are undefined (compared on shape, dtype and device only).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.testing._internal.opinfo.core import OpInfo

_RANDOM = "random op: its output depends on the random stream, so it cannot match the CPU run"

EXCLUDED: dict[str, str] = {
    # Random ops (nondeterministic).
    "bernoulli": _RANDOM,
    "cauchy": _RANDOM,
    "exponential": _RANDOM,
    "geometric": _RANDOM,
    "log_normal": _RANDOM,
    "multinomial": _RANDOM,
    "normal": _RANDOM,
    "normal.in_place": _RANDOM,
    "normal.number_mean": _RANDOM,
    "uniform": _RANDOM,
    "rand_like": _RANDOM,
    "randint": _RANDOM,
    "randint_like": _RANDOM,
    "randn": _RANDOM,
    "randn_like": _RANDOM,
    "nn.functional.dropout": _RANDOM,
    "nn.functional.dropout2d": _RANDOM,
    "nn.functional.dropout3d": _RANDOM,
    "nn.functional.alpha_dropout": _RANDOM,
    "nn.functional.feature_alpha_dropout.with_train": _RANDOM,
    "svd_lowrank": "random op: randomized range finder (draws a random projection)",
    "pca_lowrank": "random op: randomized range finder (draws a random projection)",
    # Sparse layouts: the tpu device has dense strided tensors only.
    "to_sparse": "sparse layout: converts to a sparse tensor; tpu has strided tensors only",
    "sparse.sampled_addmm": "sparse layout: takes sparse CSR inputs; tpu has strided tensors only",
    "sparse.mm.reduce": "sparse layout: takes sparse CSR inputs; tpu has strided tensors only",
    # CUDA-only ops (the CPU run raises anyway; listed so they are not counted).
    "jiterator_unary": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_binary": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_binary_return_by_ref": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_2inputs_2outputs": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_4inputs_with_extra_args": "requires CUDA (jiterator compiles CUDA kernels)",
    "bmm.triton_optimized": "requires CUDA (Triton kernel)",
    "torch._scaled_mm": "requires CUDA (fp8 scaled matmul)",
    "torch._scaled_mm_v2": "requires CUDA (fp8 scaled matmul)",
    "torch.ops.aten._flash_attention_forward": "requires CUDA (flash attention kernel)",
    "torch.ops.aten._efficient_attention_forward": "requires CUDA (memory-efficient attention kernel)",
}
"""Ops left out entirely, by full name (``name`` or ``name.variant``), with why.

Ops that merely fail on tpu are never listed here: they count as failures.
"""

EXCLUDED_BACKWARD: dict[str, str] = {}
"""Ops whose forward is checked but whose backward is left out, with why."""

# Any op whose name or alias matches is random too (a backstop for ops added
# to op_db later). ``feature_alpha_dropout.without_train`` is deterministic
# (training=False is the identity) and stays in.
_RANDOM_NAME = re.compile(
    r"rand|normal(?!ize)|bernoulli|multinomial|dropout|uniform|exponential|geometric|cauchy|"
    r"log_normal|poisson(?!_nll)|randperm"
)
_DETERMINISTIC_DESPITE_NAME = {
    "nn.functional.feature_alpha_dropout.without_train",  # training=False: the identity
    "native_dropout_backward",  # the mask is an input
    "__rand__",  # reflected bitwise and
    "signal.windows.exponential",  # the exponential window, a fixed formula
}

SAMPLE_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    # (op full name, predicate on a SampleInput, reason)
    (
        "nn.functional.scaled_dot_product_attention",
        lambda s: float(s.kwargs.get("dropout_p", 0.0) or 0.0) > 0.0,
        "random: dropout_p > 0",
    ),
    (
        "nn.functional.multi_head_attention_forward",
        lambda s: bool(s.kwargs.get("training", False)),
        "random: training=True applies dropout",
    ),
    (
        "nn.functional.rrelu",
        lambda s: bool(s.kwargs.get("training", False)),
        "random: training=True draws random slopes",
    ),
    (
        "nn.functional.fractional_max_pool2d",
        lambda s: s.kwargs.get("_random_samples") is None,
        "random: pooling regions are drawn unless _random_samples is given",
    ),
    (
        "nn.functional.fractional_max_pool3d",
        lambda s: s.kwargs.get("_random_samples") is None,
        "random: pooling regions are drawn unless _random_samples is given",
    ),
]
"""Samples left out of otherwise deterministic ops, with why."""

CPU_RESIDENT_ARGS: dict[str, tuple[Callable[[Any], list[Any]], str]] = {
    "tensor_split": (
        lambda s: [a for a in s.args[:1] if isinstance(a, torch.Tensor)],
        "tensor_indices_or_sections must be a CPU tensor whatever the input's device (documented)",
    ),
}
"""Sample tensors that stay on CPU in the tpu run, by op, with why."""

VALUES_UNDEFINED: dict[str, str] = {
    "empty": "uninitialized memory",
    "empty_like": "uninitialized memory",
    "empty_strided": "uninitialized memory",
    "empty_permuted": "uninitialized memory",
    "new_empty": "uninitialized memory",
    "new_empty_strided": "uninitialized memory",
    "resize_": "growing leaves the new elements uninitialized",
    "resize_as_": "growing leaves the new elements uninitialized",
}
"""Ops whose output values are undefined: only shape, dtype and device are compared."""


def full_name(op: OpInfo) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def exclusion_reason(op: OpInfo) -> str | None:
    """Why the whole op is left out, or None."""
    name = full_name(op)
    if name in EXCLUDED:
        return EXCLUDED[name]
    if name in _DETERMINISTIC_DESPITE_NAME:
        return None
    names = [op.name] + [a.name for a in op.aliases]
    if any(_RANDOM_NAME.search(n.rsplit(".", 1)[-1]) for n in names):
        return _RANDOM
    return None


def sample_exclusion_reason(op: OpInfo, sample: Any) -> str | None:
    name = full_name(op)
    for rule_op, predicate, reason in SAMPLE_RULES:
        if rule_op == name:
            try:
                if predicate(sample):
                    return reason
            except Exception:  # noqa: BLE001 - a rule must never break the run
                pass
    return None
