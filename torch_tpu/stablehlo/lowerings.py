"""Core ATen ops lowered to StableHLO.

The captured graph is core ATen after decomposition (``torch_tpu.stablehlo.export``),
so this table covers the primitives: elementwise math with torch's implicit
broadcasting and type promotion made explicit, matmuls as ``dot_general`` with
the tpu's precision, reductions, shape ops, convolution, batch norm, gather and scatter.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from torch_tpu.stablehlo.builder import Builder, TensorType, Value, array, ints, literal
from torch_tpu.stablehlo.registry import LoweringContext, UnsupportedOpsError, register_lowering

aten = torch.ops.aten

# torch_tpu's float32 matmul precision -> StableHLO's precision config.
PRECISION = {"highest": "HIGHEST", "high": "HIGH", "medium": "DEFAULT"}


def _dims(dim: int | Sequence[int] | None, rank: int) -> list[int]:
    """Normalized reduction dims; None or [] is every dim (a 0-d tensor has none)."""
    if rank == 0:
        return []
    if dim is None or (isinstance(dim, Sequence) and len(dim) == 0):
        return list(range(rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % rank for d in dims})


def _operand(b: Builder, x: Value | float | int | bool, dtype: torch.dtype, shape: Sequence[int]) -> Value:
    """A tensor or Python scalar as a ``dtype`` tensor of ``shape`` (broadcast)."""
    if isinstance(x, Value):
        return b.broadcast(b.convert(x, dtype), shape)
    return b.constant(x, dtype, shape)


def _scaled(b: Builder, x: Value, factor: float | int) -> Value:
    """``x * factor`` (``x`` itself for 1): the alpha and beta of add, addmm and index_add."""
    if factor == 1:
        return x
    return b.op("stablehlo.multiply", [x, b.constant(factor, x.dtype, x.shape)], x.type)


def _compare_type(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "FLOAT"
    return "UNSIGNED" if dtype in (torch.bool, torch.uint8) else "SIGNED"


def compare(b: Builder, direction: str, x: Value, y: Value) -> Value:
    return b.op("stablehlo.compare", [x, y], TensorType(x.shape, torch.bool),
                {"comparison_direction": f"#stablehlo<comparison_direction {direction}>",
                 "compare_type": f"#stablehlo<comparison_type {_compare_type(x.dtype)}>"})


def truth(b: Builder, x: Value) -> Value:
    """``x != 0`` as bool (``x`` itself when it is bool)."""
    return x if x.dtype == torch.bool else compare(b, "NE", x, b.constant(0, x.dtype, x.shape))


# -- elementwise --------------------------------------------------------------------------------

_UNARY = {
    aten.neg: "stablehlo.negate", aten.exp: "stablehlo.exponential", aten.log: "stablehlo.log",
    aten.log1p: "stablehlo.log_plus_one", aten.expm1: "stablehlo.exponential_minus_one",
    aten.tanh: "stablehlo.tanh", aten.sqrt: "stablehlo.sqrt", aten.rsqrt: "stablehlo.rsqrt",
    aten.sigmoid: "stablehlo.logistic", aten.sin: "stablehlo.sine", aten.cos: "stablehlo.cosine",
    aten.erf: "chlo.erf", aten.bitwise_not: "stablehlo.not",
}
# On integers (and bool) torch's rounding is the identity, while StableHLO's is float-only.
_ROUNDING = {aten.floor: "stablehlo.floor", aten.ceil: "stablehlo.ceil", aten.round: "stablehlo.round_nearest_even"}


def _unary(name: str):
    def lower(cx: LoweringContext, x: Value) -> Value:
        return cx.builder.op(name, [cx.builder.convert(x, cx.out_type.dtype)], cx.out_type)
    return lower


def _rounding(name: str):
    def lower(cx: LoweringContext, x: Value) -> Value:
        b, out = cx.builder, cx.out_type
        x = b.convert(x, out.dtype)
        return b.op(name, [x], out) if out.dtype.is_floating_point else x
    return lower


for _op, _name in _UNARY.items():
    register_lowering(_op.default)(_unary(_name))
for _op, _name in _ROUNDING.items():
    register_lowering(_op.default)(_rounding(_name))


@register_lowering(aten.trunc.default)
def _trunc(cx: LoweringContext, x: Value) -> Value:
    """Towards zero: ceil below zero, floor elsewhere (NaN and -0.0 kept); integers unchanged."""
    b, out = cx.builder, cx.out_type
    x = b.convert(x, out.dtype)
    if not out.dtype.is_floating_point:
        return x
    negative = compare(b, "LT", x, b.constant(0, x.dtype, x.shape))
    return b.op("stablehlo.select", [negative, b.op("stablehlo.ceil", [x], out), b.op("stablehlo.floor", [x], out)],
                out)


def _unsigned(dtype: torch.dtype) -> bool:
    return dtype in (torch.bool, torch.uint8)


@register_lowering(aten.abs.default)
def _abs(cx: LoweringContext, x: Value) -> Value:
    b, out = cx.builder, cx.out_type
    x = b.convert(x, out.dtype)
    return x if _unsigned(out.dtype) else b.op("stablehlo.abs", [x], out)  # StableHLO's is signed-only


@register_lowering(aten.sign.default)
def _sign(cx: LoweringContext, x: Value) -> Value:
    b, out = cx.builder, cx.out_type
    x = b.convert(x, out.dtype)
    if _unsigned(out.dtype):  # StableHLO's is signed-only; unsigned: 0 or 1
        return b.convert(truth(b, x), out.dtype)
    return b.op("stablehlo.sign", [x], out)


@register_lowering(aten.logical_not.default)
def _logical_not(cx: LoweringContext, x: Value) -> Value:
    b = cx.builder
    value = truth(b, x)
    return b.convert(b.op("stablehlo.not", [value], value.type), cx.out_type.dtype)


@register_lowering(aten.reciprocal.default)
def _reciprocal(cx: LoweringContext, x: Value) -> Value:
    b, out = cx.builder, cx.out_type
    return b.op("stablehlo.divide", [b.constant(1, out.dtype, out.shape), b.convert(x, out.dtype)], out)


@register_lowering(aten.relu.default)
def _relu(cx: LoweringContext, x: Value) -> Value:
    return cx.builder.op("stablehlo.maximum", [x, cx.builder.constant(0, x.dtype, x.shape)], cx.out_type)


_BINARY = {
    aten.mul: "stablehlo.multiply", aten.div: "stablehlo.divide", aten.pow: "stablehlo.power",
    aten.maximum: "stablehlo.maximum", aten.minimum: "stablehlo.minimum",
    aten.bitwise_and: "stablehlo.and", aten.bitwise_or: "stablehlo.or", aten.bitwise_xor: "stablehlo.xor",
}


def _binary(name: str):
    def lower(cx: LoweringContext, x, y) -> Value:
        b, out = cx.builder, cx.out_type
        return b.op(name, [_operand(b, x, out.dtype, out.shape), _operand(b, y, out.dtype, out.shape)], out)
    return lower


for _op, _name in _BINARY.items():
    for _overload in ("default", "Tensor", "Scalar", "Tensor_Tensor", "Tensor_Scalar"):
        if hasattr(_op, _overload):
            register_lowering(getattr(_op, _overload))(_binary(_name))


def _with_alpha(name: str):
    def lower(cx: LoweringContext, x, y, alpha=1) -> Value:
        b, out = cx.builder, cx.out_type
        y = _scaled(b, _operand(b, y, out.dtype, out.shape), alpha)
        return b.op(name, [_operand(b, x, out.dtype, out.shape), y], out)
    return lower


register_lowering(aten.add.Tensor, aten.add.Scalar)(_with_alpha("stablehlo.add"))
register_lowering(aten.sub.Tensor, aten.sub.Scalar)(_with_alpha("stablehlo.subtract"))
register_lowering(aten.rsub.Scalar)(lambda cx, x, y, alpha=1: _with_alpha("stablehlo.subtract")(cx, y, x, alpha))

_COMPARISONS = {aten.eq: "EQ", aten.ne: "NE", aten.lt: "LT", aten.le: "LE", aten.gt: "GT", aten.ge: "GE"}


def _comparison(direction: str):
    def lower(cx: LoweringContext, x, y) -> Value:
        b, shape = cx.builder, cx.out_type.shape
        dtype = cx.promoted_dtype()
        return compare(b, direction, _operand(b, x, dtype, shape), _operand(b, y, dtype, shape))
    return lower


for _op, _direction in _COMPARISONS.items():
    register_lowering(_op.Tensor, _op.Scalar)(_comparison(_direction))


def _logical(name: str):
    def lower(cx: LoweringContext, x: Value, y: Value) -> Value:
        b = cx.builder
        both = [b.broadcast(truth(b, v), cx.out_type.shape) for v in (x, y)]
        return b.convert(b.op(name, both, TensorType(cx.out_type.shape, torch.bool)), cx.out_type.dtype)
    return lower


register_lowering(aten.logical_and.default)(_logical("stablehlo.and"))
register_lowering(aten.logical_or.default)(_logical("stablehlo.or"))
register_lowering(aten.logical_xor.default)(_logical("stablehlo.xor"))


@register_lowering(aten.where.self)
def _where(cx: LoweringContext, condition: Value, x, y) -> Value:
    b, out = cx.builder, cx.out_type
    truth = b.broadcast(b.convert(condition, torch.bool), out.shape)
    return b.op("stablehlo.select", [truth, _operand(b, x, out.dtype, out.shape),
                                     _operand(b, y, out.dtype, out.shape)], out)


@register_lowering(aten.clamp.default, aten.clamp.Tensor)
def _clamp(cx: LoweringContext, x: Value, low=None, high=None) -> Value:
    b, out = cx.builder, cx.out_type
    result = _operand(b, x, out.dtype, out.shape)
    if low is not None:
        result = b.op("stablehlo.maximum", [result, _operand(b, low, out.dtype, out.shape)], out)
    if high is not None:
        result = b.op("stablehlo.minimum", [result, _operand(b, high, out.dtype, out.shape)], out)
    return result


# -- reductions ---------------------------------------------------------------------------------

def _extreme(dtype: torch.dtype, largest: bool) -> float | int | bool:
    if dtype == torch.bool:
        return largest
    if dtype.is_floating_point:
        return float("inf") if largest else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


def reduce(b: Builder, x: Value, dims: Sequence[int], combiner: str, init: float | int | bool,
           keepdim: bool = False) -> Value:
    """``x`` reduced over ``dims`` by ``combiner`` (a binary StableHLO op) from ``init``."""
    kept = [d for i, d in enumerate(x.shape) if i not in dims]
    result = b.op("stablehlo.reduce", [x, b.constant(init, x.dtype)], TensorType(tuple(kept), x.dtype),
                  {"dimensions": array(dims)}, regions=[b.binary_region(combiner, x.dtype)])
    if keepdim:
        result = b.reshape(result, [1 if i in dims else d for i, d in enumerate(x.shape)])
    return result


def _sum(cx: LoweringContext, x: Value, dim=None, keepdim: bool = False, dtype=None) -> Value:
    b = cx.builder
    return b.reshape(reduce(b, b.convert(x, cx.out_type.dtype), _dims(dim, x.type.rank), "stablehlo.add", 0,
                            keepdim), cx.out_type.shape)


register_lowering(aten.sum.dim_IntList)(_sum)
register_lowering(aten.sum.default)(lambda cx, x, dtype=None: _sum(cx, x))


def mean(b: Builder, x: Value, dims: Sequence[int], keepdim: bool) -> Value:
    total = reduce(b, x, dims, "stablehlo.add", 0, keepdim)
    count = math.prod(x.shape[d] for d in dims)
    return b.op("stablehlo.divide", [total, b.constant(count, x.dtype, total.shape)], total.type)


register_lowering(aten.mean.dim)(
    lambda cx, x, dim=None, keepdim=False, dtype=None: cx.builder.reshape(
        mean(cx.builder, cx.builder.convert(x, cx.out_type.dtype), _dims(dim, x.type.rank), keepdim),
        cx.out_type.shape))
register_lowering(aten.mean.default)(
    lambda cx, x, dtype=None: cx.builder.reshape(
        mean(cx.builder, cx.builder.convert(x, cx.out_type.dtype), _dims(None, x.type.rank), False), ()))


def _extremum(largest: bool):
    def lower(cx: LoweringContext, x: Value, dim=None, keepdim: bool = False) -> Value:
        combiner = "stablehlo.maximum" if largest else "stablehlo.minimum"
        return cx.builder.reshape(reduce(cx.builder, x, _dims(dim, x.type.rank), combiner,
                                         _extreme(x.dtype, not largest), keepdim), cx.out_type.shape)
    return lower


register_lowering(aten.amax.default, aten.max.default)(_extremum(True))
register_lowering(aten.amin.default, aten.min.default)(_extremum(False))


def _any_or_all(any_: bool):
    def lower(cx: LoweringContext, x: Value, dim=None, keepdim: bool = False) -> Value:
        b = cx.builder
        result = reduce(b, truth(b, x), _dims(dim, x.type.rank), "stablehlo.or" if any_ else "stablehlo.and",
                        not any_, keepdim)
        return b.convert(b.reshape(result, cx.out_type.shape), cx.out_type.dtype)
    return lower


register_lowering(aten.any.dim, aten.any.dims, aten.any.default)(_any_or_all(True))
register_lowering(aten.all.dim, aten.all.dims, aten.all.default)(_any_or_all(False))
register_lowering(aten.prod.dim_int)(
    lambda cx, x, dim, keepdim=False, dtype=None: cx.builder.reshape(
        reduce(cx.builder, cx.builder.convert(x, cx.out_type.dtype), _dims(dim, x.type.rank),
               "stablehlo.multiply", 1, keepdim), cx.out_type.shape))


@register_lowering(aten.var_mean.correction, aten.var.correction)
def _variance(cx: LoweringContext, x: Value, dim=None, *, correction=None, keepdim: bool = False):
    b = cx.builder
    dims = _dims(dim, x.type.rank)
    centre = mean(b, x, dims, keepdim=True)
    deviation = b.op("stablehlo.subtract", [x, b.broadcast(centre, x.shape)], x.type)
    squares = b.op("stablehlo.multiply", [deviation, deviation], x.type)
    count = math.prod(x.shape[d] for d in dims)
    total = reduce(b, squares, dims, "stablehlo.add", 0, keepdim)
    divisor = max(count - (1 if correction is None else correction), 0)
    variance = b.op("stablehlo.divide", [total, b.constant(divisor, x.dtype, total.shape)], total.type)
    if isinstance(cx.out, TensorType):
        return variance
    return [variance, b.reshape(centre, variance.shape)]


# -- shapes -------------------------------------------------------------------------------------

def _reshape_to_out(cx: LoweringContext, x: Value, *_args, **_kwargs) -> Value:
    return cx.builder.reshape(x, cx.out_type.shape)


register_lowering(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                  aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.view_copy.default)(_reshape_to_out)


def _identity(cx: LoweringContext, x: Value, *_args, **_kwargs) -> Value:
    return x


register_lowering(aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
                  aten.contiguous.default)(_identity)
register_lowering(aten._to_copy.default)(lambda cx, x, **_kwargs: cx.builder.convert(x, cx.out_type.dtype))
register_lowering(aten.permute.default)(lambda cx, x, dims: cx.builder.transpose(x, [d % x.type.rank for d in dims]))
register_lowering(aten.expand.default)(lambda cx, x, size, implicit=False: cx.builder.broadcast(x, cx.out_type.shape))


def _no_value(cx: LoweringContext, *_args, **_kwargs) -> None:
    """Checks of the captured program (metadata, scalar asserts): nothing to compute."""


register_lowering(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
                  aten.sym_constrain_range_for_size.default)(_no_value)


@register_lowering(aten.cat.default)
def _cat(cx: LoweringContext, tensors: Sequence[Value], dim: int = 0) -> Value:
    out = cx.out_type
    dim = dim % out.rank
    # torch.cat skips 1-D empty tensors whatever the others' shapes.
    parts = [cx.builder.convert(t, out.dtype) for t in tensors if not (t.type.rank == 1 and t.shape == (0,))]
    if len(parts) == 1:
        return cx.builder.reshape(parts[0], out.shape)
    return cx.builder.op("stablehlo.concatenate", parts, out, {"dimension": f"{dim} : i64"})


def slice_dim(b: Builder, x: Value, dim: int, start: int, stop: int, step: int = 1) -> Value:
    starts, limits, strides = [0] * x.type.rank, list(x.shape), [1] * x.type.rank
    starts[dim], limits[dim], strides[dim] = start, stop, step
    shape = list(x.shape)
    shape[dim] = max(0, -(-(stop - start) // step))
    return b.op("stablehlo.slice", [x], TensorType(tuple(shape), x.dtype),
                {"start_indices": array(starts), "limit_indices": array(limits), "strides": array(strides)})


def _bounds(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    return start, end


@register_lowering(aten.slice.Tensor)
def _slice(cx: LoweringContext, x: Value, dim: int = 0, start=None, end=None, step: int = 1) -> Value:
    dim %= x.type.rank
    lo, hi = _bounds(x.shape[dim], start, end)
    return slice_dim(cx.builder, x, dim, lo, hi, step)


@register_lowering(aten.select.int)
def _select(cx: LoweringContext, x: Value, dim: int, index: int) -> Value:
    dim %= x.type.rank
    index %= x.shape[dim]
    return cx.builder.reshape(slice_dim(cx.builder, x, dim, index, index + 1), cx.out_type.shape)


@register_lowering(aten.split_with_sizes.default, aten.split.Tensor)
def _split(cx: LoweringContext, x: Value, sizes, dim: int = 0) -> list[Value]:
    dim %= x.type.rank
    if isinstance(sizes, int):
        sizes = [min(sizes, x.shape[dim] - s) for s in range(0, x.shape[dim], sizes)]
    parts, start = [], 0
    for size in sizes:
        parts.append(slice_dim(cx.builder, x, dim, start, start + size))
        start += size
    return parts


@register_lowering(aten.constant_pad_nd.default)
def _pad(cx: LoweringContext, x: Value, pad: Sequence[int], value: float = 0) -> Value:
    low, high = [0] * x.type.rank, [0] * x.type.rank
    for i in range(len(pad) // 2):  # pairs from the last dim backwards
        low[x.type.rank - 1 - i], high[x.type.rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    b = cx.builder
    return b.op("stablehlo.pad", [x, b.constant(value, x.dtype)], cx.out_type,
                {"edge_padding_low": array(low), "edge_padding_high": array(high),
                 "interior_padding": array([0] * x.type.rank)})


@register_lowering(aten.full.default, aten.full_like.default, aten.scalar_tensor.default)
def _full(cx: LoweringContext, *args, **_kwargs) -> Value:
    # full(size, value), full_like(x, value), scalar_tensor(value): the value is the last positional.
    return cx.builder.constant(args[-1], cx.out_type.dtype, cx.out_type.shape)


@register_lowering(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(cx: LoweringContext, *args, **_kwargs) -> Value:
    numbers = [a for a in args if isinstance(a, (int, float))]
    start, step = (0, 1) if len(numbers) == 1 else (numbers[0], numbers[2] if len(numbers) > 2 else 1)
    b, out = cx.builder, cx.out_type
    positions = b.op("stablehlo.iota", [], out, {"iota_dimension": "0 : i64"})
    scaled = b.op("stablehlo.multiply", [positions, b.constant(step, out.dtype, out.shape)], out)
    return b.op("stablehlo.add", [scaled, b.constant(start, out.dtype, out.shape)], out)


register_lowering(operator.getitem)(lambda cx, values, index: values[index])


# -- matmul and convolution ---------------------------------------------------------------------

def dot_general(cx: LoweringContext, x: Value, y: Value, batch: int, out: TensorType) -> Value:
    """``x @ y`` over the last dim of ``x`` and dim ``batch`` of ``y`` (the first non-batch dim),
    with ``batch`` leading batch dims on both."""
    precision = f"#stablehlo<precision {PRECISION[cx.precision]}>"
    numbers = (f"#stablehlo.dot<lhs_batching_dimensions = {ints(range(batch))}, "
               f"rhs_batching_dimensions = {ints(range(batch))}, "
               f"lhs_contracting_dimensions = [{x.type.rank - 1}], rhs_contracting_dimensions = [{batch}]>")
    b = cx.builder
    return b.op("stablehlo.dot_general", [b.convert(x, out.dtype), b.convert(y, out.dtype)], out,
                {"dot_dimension_numbers": numbers, "precision_config": f"[{precision}, {precision}]"})


register_lowering(aten.mm.default)(lambda cx, x, y: dot_general(cx, x, y, 0, cx.out_type))
register_lowering(aten.bmm.default)(lambda cx, x, y: dot_general(cx, x, y, 1, cx.out_type))


@register_lowering("torch_tpu::dot_interaction")
def _dot_interaction(cx: LoweringContext, dense: Value, sparse: Value) -> Value:
    """torch_tpu's fused DLRM interaction (torch_tpu.interaction) as its unfused form: the
    Gram matrix of [dense, sparse rows] by one batched dot_general, its strict upper triangle
    by row slices, after the dense features."""
    b, out = cx.builder, cx.out_type
    batch, dim = dense.shape
    n = sparse.shape[1] + 1
    dense = b.convert(dense, out.dtype)
    x = b.op("stablehlo.concatenate", [b.reshape(dense, (batch, 1, dim)), b.convert(sparse, out.dtype)],
             TensorType((batch, n, dim), out.dtype), {"dimension": "1 : i64"})
    gram = dot_general(cx, x, b.transpose(x, [0, 2, 1]), 1, TensorType((batch, n, n), out.dtype))
    rows = [b.reshape(slice_dim(b, slice_dim(b, gram, 1, i, i + 1), 2, i + 1, n), (batch, n - 1 - i))
            for i in range(n - 1)]
    return b.op("stablehlo.concatenate", [dense, *rows], out, {"dimension": "1 : i64"})


@register_lowering(aten.addmm.default)
def _addmm(cx: LoweringContext, bias: Value, x: Value, y: Value, *, beta=1, alpha=1) -> Value:
    b, out = cx.builder, cx.out_type
    product = _scaled(b, dot_general(cx, x, y, 0, out), alpha)
    if beta == 0:
        return product
    return b.op("stablehlo.add", [product, _scaled(b, _operand(b, bias, out.dtype, out.shape), beta)], out)


@register_lowering(aten.convolution.default)
def _convolution(cx: LoweringContext, x: Value, weight: Value, bias, stride, padding, dilation, transposed: bool,
                 output_padding, groups: int) -> Value:
    if transposed:
        raise UnsupportedOpsError({"aten::convolution.default": 1}, "transposed convolution")
    b, out = cx.builder, cx.out_type
    spatial = x.type.rank - 2
    layout = ", ".join(str(i) for i in range(spatial))
    precision = f"#stablehlo<precision {PRECISION[cx.precision]}>"
    result = b.op("stablehlo.convolution", [x, b.convert(weight, x.dtype)], out, {
        "batch_group_count": "1 : i64",
        "dimension_numbers": f"#stablehlo.conv<[b, f, {layout}]x[o, i, {layout}]->[b, f, {layout}]>",
        "feature_group_count": f"{groups} : i64",
        "lhs_dilation": array([1] * spatial),
        "padding": f"dense<{[[p, p] for p in _expand(padding, spatial)]}> : tensor<{spatial}x2xi64>",
        "rhs_dilation": array(_expand(dilation, spatial)),
        "window_strides": array(_expand(stride, spatial)),
        "precision_config": f"[{precision}, {precision}]",
    })
    if bias is None:
        return result
    return b.op("stablehlo.add", [result, b.broadcast_in_dim(bias, out.shape, [1])], out)


def _expand(values: int | Sequence[int], n: int) -> list[int]:
    return [values] * n if isinstance(values, int) else list(values) * (n // len(values))


@register_lowering(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_inference(cx: LoweringContext, x: Value, weight, bias, running_mean: Value, running_var: Value,
                          momentum: float, eps: float) -> list[Value]:
    b = cx.builder
    channels = TensorType((x.shape[1],), x.dtype)
    scale = weight if weight is not None else b.constant(1, x.dtype, channels.shape)
    offset = bias if bias is not None else b.constant(0, x.dtype, channels.shape)
    out = b.op("stablehlo.batch_norm_inference", [x, scale, offset, running_mean, running_var], x.type,
               {"epsilon": f"{literal(eps, torch.float32)} : f32", "feature_index": "1 : i64"})
    # The saved mean and inverse deviation are empty in inference.
    return [out, b.constant(0, x.dtype, (0,)), b.constant(0, x.dtype, (0,))]


def _per_channel(b: Builder, v: Value, like: Value) -> Value:
    """A (C,) vector along dim 1 of ``like``'s shape, in its dtype."""
    return b.broadcast_in_dim(b.convert(v, like.dtype), like.shape, [1])


def _channel_result(b: Builder, v: Value, out: TensorType) -> Value:
    """A (C,) statistic as the result type recorded (the empty tensor eager gives some)."""
    if out.numel == 0:
        return b.constant(0, out.dtype, out.shape)
    return b.convert(b.reshape(v, out.shape), out.dtype)


@register_lowering(aten._native_batch_norm_legit_functional.default)
def _batch_norm(cx: LoweringContext, x: Value, weight, bias, running_mean: Value | None, running_var: Value | None,
                training: bool, momentum: float, eps: float) -> list[Value]:
    """Batch norm as ATen computes it: in training, the batch's mean and biased variance over
    every dim but the channels (dim 1) normalize, and the running statistics become
    ``momentum * batch + (1 - momentum) * running`` with the batch's unbiased variance; results
    (output, saved mean, saved inverse deviation[, new running mean, new running var]).
    Half-precision inputs are computed in float32, as ATen does."""
    b, outs = cx.builder, cx.out
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xc = b.convert(x, compute)
    channels = TensorType((x.shape[1],), compute)
    if training:
        dims = [0, *range(2, x.type.rank)]
        count = x.type.numel // x.shape[1]
        centre = mean(b, xc, dims, keepdim=False)
        deviation = b.op("stablehlo.subtract", [xc, _per_channel(b, centre, xc)], xc.type)
        squares = reduce(b, b.op("stablehlo.multiply", [deviation, deviation], xc.type), dims, "stablehlo.add", 0)
        variance = b.op("stablehlo.divide", [squares, b.constant(count, compute, channels.shape)], channels)
    else:
        centre, variance = b.convert(running_mean, compute), b.convert(running_var, compute)
        deviation = b.op("stablehlo.subtract", [xc, _per_channel(b, centre, xc)], xc.type)
    rstd = b.op("stablehlo.rsqrt", [b.op("stablehlo.add", [variance, b.constant(eps, compute, channels.shape)],
                                         channels)], channels)
    output = b.op("stablehlo.multiply", [deviation, _per_channel(b, rstd, xc)], xc.type)
    if weight is not None:
        output = b.op("stablehlo.multiply", [output, _per_channel(b, weight, xc)], xc.type)
    if bias is not None:
        output = b.op("stablehlo.add", [output, _per_channel(b, bias, xc)], xc.type)
    results = [b.convert(output, outs[0].dtype), _channel_result(b, centre, outs[1]), _channel_result(b, rstd, outs[2])]
    if len(outs) == 3:
        return results
    new_mean, new_var = running_mean, running_var
    if training:
        unbiased = b.op("stablehlo.divide", [squares, b.constant(count - 1, compute, channels.shape)], channels)

        def updated(batch: Value, running: Value) -> Value:
            return b.op("stablehlo.add", [_scaled(b, batch, momentum),
                                          _scaled(b, b.convert(running, compute), 1 - momentum)], channels)
        new_mean, new_var = updated(centre, running_mean), updated(unbiased, running_var)
    return results + [_channel_result(b, new_mean, outs[3]), _channel_result(b, new_var, outs[4])]


register_lowering(aten._native_batch_norm_legit.no_stats)(
    lambda cx, x, weight, bias, training, momentum, eps: _batch_norm(cx, x, weight, bias, None, None, training,
                                                                     momentum, eps))


# -- gather and scatter -------------------------------------------------------------------------

def _wrapped(b: Builder, index: Value, size: int) -> Value:
    """Negative indices counted from the end, as torch does (gather would clamp them)."""
    index = b.convert(index, torch.int64)
    negative = compare(b, "LT", index, b.constant(0, torch.int64, index.shape))
    shifted = b.op("stablehlo.add", [index, b.constant(size, torch.int64, index.shape)], index.type)
    return b.op("stablehlo.select", [negative, shifted, index], index.type)


def index_coordinates(b: Builder, x: Value, indices: Sequence[Value], first: int) -> Value:
    """The (broadcast) index tensors picking along ``x``'s dims ``first, first + 1, ...`` as one
    coordinate tensor: their broadcast shape plus a last dim of one coordinate per index."""
    index_shape = tuple(torch.broadcast_shapes(*(i.shape for i in indices)))
    columns = [b.reshape(b.broadcast(_wrapped(b, i, x.shape[first + k]), index_shape), (*index_shape, 1))
               for k, i in enumerate(indices)]
    if len(columns) == 1:
        return columns[0]
    return b.op("stablehlo.concatenate", columns, TensorType((*index_shape, len(columns)), torch.int64),
                {"dimension": f"{len(index_shape)} : i64"})


def _untouched_dims(x: Value, first: int, m: int, index_rank: int) -> list[int]:
    """Where ``x``'s dims outside the indexed ``first .. first + m - 1`` sit in the indexed
    result (``x``'s dims before them, the index dims, then ``x``'s after them)."""
    return list(range(first)) + [first + index_rank + i for i in range(x.type.rank - first - m)]


def gather_along(b: Builder, x: Value, indices: Sequence[Value], first: int, out: TensorType) -> Value:
    """``x[:, ..., i0, i1, ...]``: the (broadcast) index tensors pick along the consecutive dims
    ``first, first + 1, ...``; the result's dims are ``x``'s before them, the indices', then
    ``x``'s after them."""
    coordinates = index_coordinates(b, x, indices, first)
    picked = list(range(first, first + len(indices)))
    offset_dims = _untouched_dims(x, first, len(indices), coordinates.type.rank - 1)
    slice_sizes = [1 if d in picked else size for d, size in enumerate(x.shape)]
    numbers = (f"#stablehlo.gather<offset_dims = {ints(offset_dims)}, collapsed_slice_dims = {ints(picked)}, "
               f"start_index_map = {ints(picked)}, index_vector_dim = {coordinates.type.rank - 1}>")
    return b.op("stablehlo.gather", [x, coordinates], out,
                {"dimension_numbers": numbers, "slice_sizes": array(slice_sizes), "indices_are_sorted": "false"})


def _index_block(indices: Sequence[Value | None], op: str) -> tuple[int, list[Value]]:
    """The first indexed dim and the index tensors of an advanced index (``x[:, i, j]``)."""
    present = [k for k, v in enumerate(indices) if v is not None]
    if any(indices[k].dtype == torch.bool for k in present):
        raise UnsupportedOpsError({op: 1}, "boolean mask indices")
    if present != list(range(present[0], present[-1] + 1)):
        raise UnsupportedOpsError({op: 1}, "index tensors on non-consecutive dims")
    return present[0], [indices[k] for k in present]


@register_lowering(aten.index_select.default)
def _index_select(cx: LoweringContext, x: Value, dim: int, index: Value) -> Value:
    dim %= x.type.rank
    return gather_along(cx.builder, x, [cx.builder.reshape(index, (index.type.numel,))], dim, cx.out_type)


@register_lowering(aten.embedding.default)
def _embedding(cx: LoweringContext, weight: Value, indices: Value, *_args) -> Value:
    return gather_along(cx.builder, weight, [indices], 0, cx.out_type)


@register_lowering(aten.index.Tensor)
def _index(cx: LoweringContext, x: Value, indices: Sequence[Value | None]) -> Value:
    first, tensors = _index_block(indices, "aten::index.Tensor")
    return gather_along(cx.builder, x, tensors, first, cx.out_type)


def _coordinates(b: Builder, index: Value, dim: int, rank: int) -> Value:
    """For dim-wise gather/scatter: every element's full coordinates, ``index`` on ``dim``
    and its own position elsewhere: shape ``index.shape + (rank,)``."""
    shape = index.shape
    columns = []
    for d in range(rank):
        if d == dim:
            column = b.convert(index, torch.int64)
        else:
            column = b.op("stablehlo.iota", [], TensorType(shape, torch.int64), {"iota_dimension": f"{d} : i64"})
        columns.append(b.reshape(column, (*shape, 1)))
    return b.op("stablehlo.concatenate", columns, TensorType((*shape, rank), torch.int64),
                {"dimension": f"{len(shape)} : i64"})


@register_lowering(aten.gather.default)
def _gather(cx: LoweringContext, x: Value, dim: int, index: Value, sparse_grad: bool = False) -> Value:
    b, rank = cx.builder, x.type.rank
    dim %= rank
    everything = ints(range(rank))
    numbers = (f"#stablehlo.gather<offset_dims = [], collapsed_slice_dims = {everything}, "
               f"start_index_map = {everything}, index_vector_dim = {rank}>")
    return b.op("stablehlo.gather", [x, _coordinates(b, _wrapped(b, index, x.shape[dim]), dim, rank)], cx.out_type,
                {"dimension_numbers": numbers, "slice_sizes": array([1] * rank), "indices_are_sorted": "false"})


def scatter(b: Builder, x: Value, indices: Value, updates: Value, window_dims: Sequence[int],
            inserted: Sequence[int], accumulate: bool) -> Value:
    """``stablehlo.scatter`` of ``updates`` into ``x`` at ``indices`` (last dim: the coordinates
    of dims ``inserted``), adding when ``accumulate``, else replacing."""
    numbers = (f"#stablehlo.scatter<update_window_dims = {ints(window_dims)}, inserted_window_dims = "
               f"{ints(inserted)}, scatter_dims_to_operand_dims = {ints(inserted)}, "
               f"index_vector_dim = {indices.type.rank - 1}>")
    scalar = TensorType((), x.dtype)
    combine = b.binary_region("stablehlo.add", x.dtype) if accumulate else \
        b.region([scalar, scalar], lambda _b, _old, new: new)
    return b.op("stablehlo.scatter", [x, indices, b.convert(updates, x.dtype)], x.type,
                {"scatter_dimension_numbers": numbers, "indices_are_sorted": "false", "unique_indices": "false"},
                regions=[combine])


def _scatter_dim(accumulate: bool):
    def lower(cx: LoweringContext, x: Value, dim: int, index: Value, src) -> Value:
        b, rank = cx.builder, x.type.rank
        dim %= rank
        if isinstance(src, Value):  # only the part of src that index covers is scattered
            for d, size in enumerate(index.shape):
                src = slice_dim(b, src, d, 0, size) if src.shape[d] != size else src
        updates = _operand(b, src, x.dtype, index.shape)
        coordinates = _coordinates(b, _wrapped(b, index, x.shape[dim]), dim, rank)
        return scatter(b, x, coordinates, updates, [], list(range(rank)), accumulate)
    return lower


register_lowering(aten.scatter_add.default)(_scatter_dim(True))
register_lowering(aten.scatter.src, aten.scatter.value)(_scatter_dim(False))


def put_along(b: Builder, x: Value, indices: Sequence[Value], first: int, values: Value | float,
              accumulate: bool) -> Value:
    """``x[:, ..., i0, i1, ...] = values`` (``+=`` when ``accumulate``) as gather_along picks."""
    coordinates = index_coordinates(b, x, indices, first)
    index_shape = coordinates.shape[:-1]
    m = len(indices)
    indexed_shape = (*x.shape[:first], *index_shape, *x.shape[first + m:])  # the shape of x[indices]
    updates = _operand(b, values, x.dtype, indexed_shape)
    window_dims = _untouched_dims(x, first, m, len(index_shape))
    return scatter(b, x, coordinates, updates, window_dims, list(range(first, first + m)), accumulate)


@register_lowering(aten.index_put.default)
def _index_put(cx: LoweringContext, x: Value, indices: Sequence[Value | None], values: Value,
               accumulate: bool = False) -> Value:
    first, tensors = _index_block(indices, "aten::index_put.default")
    return put_along(cx.builder, x, tensors, first, values, accumulate)


@register_lowering(aten.index_add.default)
def _index_add(cx: LoweringContext, x: Value, dim: int, index: Value, source: Value, *, alpha=1) -> Value:
    b = cx.builder
    return put_along(b, x, [index], dim % x.type.rank, _scaled(b, b.convert(source, x.dtype), alpha), True)
