"""MLIR text for StableHLO: typed SSA values and the ops that make them.

Ops are written in MLIR's generic form (``%v = "stablehlo.add"(%a, %b) :
(types) -> type``), which every StableHLO op shares, so the printer needs no
per-op syntax. The builder also knows the helpers every lowering needs:
splat constants, conversions, NumPy-style broadcasts and reduction regions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ELEMENT_TYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "ui8",
    torch.bool: "i1",
}


def element_type(dtype: torch.dtype) -> str:
    try:
        return _ELEMENT_TYPES[dtype]
    except KeyError:
        raise TypeError(f"StableHLO export: no element type for {dtype}; supported: "
                        f"{', '.join(str(d) for d in _ELEMENT_TYPES)}") from None


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return "tensor<" + "".join(f"{d}x" for d in self.shape) + element_type(self.dtype) + ">"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Value:
    """An SSA value of the module being built."""

    name: str
    type: TensorType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.type.dtype


def array(values: Sequence[int]) -> str:
    """A dense i64 array attribute, e.g. ``array<i64: 1, 0>``."""
    return "array<i64" + (": " + ", ".join(str(int(v)) for v in values) if len(values) else "") + ">"


def ints(values: Sequence[int]) -> str:
    """An integer list inside a StableHLO attribute, e.g. ``[0, 2]``."""
    return "[" + ", ".join(str(int(v)) for v in values) + "]"


def literal(value: float | int | bool, dtype: torch.dtype) -> str:
    """``value`` as an MLIR literal of ``dtype``'s element type."""
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            return "0x7FC00000" if dtype == torch.float32 else "0x7FF8000000000000" if dtype == torch.float64 \
                else "0x7E00" if dtype == torch.float16 else "0x7FC0"
        if math.isinf(value):
            bits = {torch.float32: ("0x7F800000", "0xFF800000"), torch.float64: ("0x7FF0000000000000",
                    "0xFFF0000000000000"), torch.float16: ("0x7C00", "0xFC00"), torch.bfloat16: ("0x7F80", "0xFF80")}
            return bits[dtype][value < 0]
        mantissa, _, exponent = repr(value).partition("e")
        if "." not in mantissa:  # MLIR's float literals need the point: 1e-05 -> 1.0e-05
            mantissa += ".0"
        return mantissa + (f"e{exponent}" if exponent else "")
    return str(int(value))


class Builder:
    """The op lines of one function body (and of the regions inside it); value names are
    unique across the function because nested regions may not redefine outer names."""

    def __init__(self, counter: list[int] | None = None, indent: str = "    ") -> None:
        self.lines: list[str] = []
        self._counter = counter if counter is not None else [0]
        self._indent = indent

    def fresh(self, prefix: str = "v") -> str:
        self._counter[0] += 1
        return f"%{prefix}{self._counter[0]}"

    def op(self, name: str, operands: Sequence[Value], results: TensorType | Sequence[TensorType],
           attributes: dict[str, str] | None = None, regions: Sequence[str] = ()) -> Value | list[Value]:
        """Emits ``name`` in generic form; one result type gives a Value, a list gives a list."""
        single = isinstance(results, TensorType)
        types = [results] if single else list(results)
        names = [self.fresh() for _ in types]
        attrs = ""
        if attributes:
            attrs = " {" + ", ".join(f"{k} = {v}" for k, v in attributes.items()) + "}"
        region_text = " (" + ", ".join(regions) + ")" if regions else ""
        lhs = f"{', '.join(names)} = " if types else ""
        self.lines.append(f'{self._indent}{lhs}"{name}"({", ".join(v.name for v in operands)}){region_text}{attrs}'
                          f' : ({", ".join(str(v.type) for v in operands)}) -> {_result_types(types)}')
        values = [Value(n, t) for n, t in zip(names, types)]
        return values[0] if single else values

    def constant(self, value: float | int | bool, dtype: torch.dtype, shape: Sequence[int] = ()) -> Value:
        """A splat constant."""
        t = TensorType(tuple(shape), dtype)
        return self.op("stablehlo.constant", [], t, {"value": f"dense<{literal(value, dtype)}> : {t}"})

    def convert(self, value: Value, dtype: torch.dtype) -> Value:
        if value.dtype == dtype:
            return value
        return self.op("stablehlo.convert", [value], TensorType(value.shape, dtype))

    def reshape(self, value: Value, shape: Sequence[int]) -> Value:
        if tuple(shape) == value.shape:
            return value
        return self.op("stablehlo.reshape", [value], TensorType(tuple(shape), value.dtype))

    def transpose(self, value: Value, permutation: Sequence[int]) -> Value:
        if list(permutation) == list(range(value.type.rank)):
            return value
        shape = tuple(value.shape[p] for p in permutation)
        return self.op("stablehlo.transpose", [value], TensorType(shape, value.dtype),
                       {"permutation": array(permutation)})

    def broadcast_in_dim(self, value: Value, shape: Sequence[int], dimensions: Sequence[int]) -> Value:
        return self.op("stablehlo.broadcast_in_dim", [value], TensorType(tuple(shape), value.dtype),
                       {"broadcast_dimensions": array(dimensions)})

    def broadcast(self, value: Value, shape: Sequence[int]) -> Value:
        """NumPy broadcasting: ``value``'s dims align with the trailing dims of ``shape``."""
        shape = tuple(shape)
        if value.shape == shape:
            return value
        offset = len(shape) - value.type.rank
        if offset < 0 or any(d not in (1, shape[offset + i]) for i, d in enumerate(value.shape)):
            raise ValueError(f"cannot broadcast {value.shape} to {shape}")
        # Size-1 dims that grow are dropped first: broadcast_in_dim needs equal or 1, and
        # a dropped dim is simply a new one.
        keep = [i for i, d in enumerate(value.shape) if d == shape[offset + i]]
        squeezed = self.reshape(value, [value.shape[i] for i in keep])
        return self.broadcast_in_dim(squeezed, shape, [offset + i for i in keep])

    def region(self, argument_types: Sequence[TensorType], body) -> str:
        """A one-block region: ``body(builder, *arguments)`` returns the values it yields."""
        inner = Builder(self._counter, self._indent + "    ")
        arguments = [Value(inner.fresh("a"), t) for t in argument_types]
        results = body(inner, *arguments)
        results = results if isinstance(results, (list, tuple)) else [results]
        inner.op("stablehlo.return", results, [])
        block_args = ", ".join(f"{a.name}: {a.type}" for a in arguments)
        return "{\n" + f"{self._indent}  ^bb0({block_args}):\n" + "\n".join(inner.lines) + f"\n{self._indent}}}"

    def binary_region(self, op_name: str, dtype: torch.dtype) -> str:
        """The region ``(a, b) -> op(a, b)`` on scalars: the combiner of reduce and scatter."""
        scalar = TensorType((), dtype)
        return self.region([scalar, scalar], lambda b, x, y: b.op(op_name, [x, y], scalar))


def _result_types(types: Sequence[TensorType]) -> str:
    if len(types) == 1:
        return str(types[0])
    return "(" + ", ".join(str(t) for t in types) + ")"
