"""The export registry: which function lowers which op to StableHLO.

ATen's lowerings are in ``torch_tpu.stablehlo.lowerings``; other libraries
register their custom ops here (SparseCore's lookup becomes a ``custom_call``)
without torch_tpu knowing them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu.stablehlo.builder import Builder, TensorType, Value, literal

_LOWERINGS: dict[str, Callable[..., Any]] = {}


class UnsupportedOpsError(NotImplementedError):
    """The captured graph has ops that cannot be lowered to StableHLO: ops without a lowering,
    and ops whose lowering refuses the arguments it got (a transposed convolution, say).
    ``ops`` counts them by name; ``reasons`` says, where known, why a lowering refused."""

    def __init__(self, ops: dict[str, int], detail: str = "", *, reasons: dict[str, str] | None = None) -> None:
        self.ops = dict(ops)
        self.reasons = dict(reasons or {})
        if detail:
            for name in self.ops:
                self.reasons.setdefault(name, detail)
        listed = ", ".join(f"{name} (x{count}" + (f": {self.reasons[name]}" if name in self.reasons else "") + ")"
                           for name, count in sorted(self.ops.items()))
        super().__init__(f"StableHLO export: no lowering for {len(self.ops)} op(s): {listed}"
                         "; register one with torch_tpu.stablehlo.register_lowering")


def op_name(target: Any) -> str:
    """``aten::add.Tensor`` for an OpOverload (``aten::view.default``: OpOverload.name() leaves
    ``.default`` out, which would make a default's lowering every overload's), ``aten::add``
    for a packet, else the callable's name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", repr(target))


def register_lowering(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn(cx: LoweringContext, *args, **kwargs)`` lowers ``ops`` (OpOverloads, packets
    for all their overloads, or names such as ``"sparsecore::lookup"``). ``args`` are the op's,
    with tensors replaced by builder Values; ``fn`` returns the result Value (or a list). A lowering
    that cannot lower the arguments it got raises ``UnsupportedOpsError({op: 1}, reason)``: export
    goes on through the graph and lists it in one error with every other op it cannot lower."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _LOWERINGS[op_name(op)] = fn
        return fn
    return decorate


def lowering_for(target: Any) -> Callable[..., Any] | None:
    name = op_name(target)
    fn = _LOWERINGS.get(name)
    if fn is None and "." in name.rsplit("::", 1)[-1]:
        fn = _LOWERINGS.get(name.rsplit(".", 1)[0])  # the packet's lowering covers every overload
    return fn


@dataclass
class LoweringContext:
    """What a lowering sees besides its arguments: the builder, the result type(s) the
    captured graph recorded, the node's argument metadata and the export's matmul precision."""

    builder: Builder
    out: TensorType | tuple[TensorType | None, ...] | None
    arg_values: Sequence[Any]
    precision: str

    @property
    def out_type(self) -> TensorType:
        assert isinstance(self.out, TensorType), self.out
        return self.out

    def promoted_dtype(self, *operands: Any) -> torch.dtype:
        """torch's type promotion over the node's tensor and scalar arguments (as recorded)."""
        examples = [a for a in (operands or self.arg_values)
                    if isinstance(a, (torch.Tensor, bool, int, float))]
        return torch.result_type(*examples) if len(examples) > 1 else examples[0].dtype

    def custom_call(self, target: str, operands: Iterable[Value], config: dict[str, int | float | bool] | None = None,
                    has_side_effect: bool = False) -> Value | list[Value]:
        """``stablehlo.custom_call @target`` (typed-FFI API: attributes in ``backend_config``) with
        this node's result type(s)."""
        attributes = {"call_target_name": f'"{target}"', "api_version": "4 : i32",
                      "has_side_effect": "true" if has_side_effect else "false"}
        if config:
            attributes["backend_config"] = "{" + ", ".join(
                f"{k} = {_attribute(v)}" for k, v in sorted(config.items())) + "}"
        out = self.out if isinstance(self.out, TensorType) else list(self.out or ())
        return self.builder.op("stablehlo.custom_call", list(operands), out, attributes)


def _attribute(value: int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value} : i64"
    return f"{literal(value, torch.float64)} : f64"
